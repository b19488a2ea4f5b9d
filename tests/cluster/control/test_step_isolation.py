"""Per-request isolation in the workers' steps (:mod:`engine.isolation`), on a prefill + decode pair in one process
(:class:`~cluster.control.local_pair.LocalPair`: the real workers, the in-process transport). Poisoned requests mixed
into a batch of valid ones, with faults injected on the prefill side (its sampling: the hand-off says why, and the
decode side fails it as not retryable; its KV export: a transfer failure, which another pair may avoid) and on the
decode side (a token's append, a decode worker's KV write): every valid request completes with the local engine's
greedy tokens, each poisoned one fails with its own reason, and neither worker holds anything afterwards."""

from __future__ import annotations

import dataclasses

import pytest

from cluster.control.local_pair import LocalPair
from decode_node.request_state import StepReport, step_events
from engine import LLM
from engine.config import EngineConfig
from node_common.events import RequestFailed
from tests.conftest import LLM_DEFAULTS, greedy, make_request

PROMPTS = [make_request(8, seed=s) for s in range(6)]
BAD = {1: "prefill-sample", 3: "decode-append", 4: "prefill-export"}  # prompt index -> where it is poisoned


@pytest.fixture(scope="module")
def want(tiny_model_dir):
    return [o.outputs[0].token_ids for o in LLM(tiny_model_dir, **LLM_DEFAULTS).generate(PROMPTS, greedy(6))]


def _faults(pair: LocalPair) -> None:
    rid = lambda i: f"pair-{i}"  # noqa: E731 - LocalPair's ids, in prompt order

    def on_prefill(stage, seq):
        if (stage, seq.request_id) in {("sample", rid(1)), ("export", rid(4))}:
            raise ValueError(f"injected at prefill {stage}")

    def on_decode(stage, seq):
        if stage == "append" and seq.request_id == rid(3) and seq.num_output_tokens == 2:
            raise ValueError("injected at decode append")

    for worker, hook in ((pair.prefill, on_prefill), (pair.decode, on_decode)):  # the test's injection point
        worker.engine.hooks = dataclasses.replace(worker.engine.hooks, request_fault=hook)


@pytest.mark.parametrize("stream_layers", [True, False])
def test_poisoned_requests_fail_alone_on_both_workers(tiny_model_dir, want, stream_layers):
    pair = LocalPair(tiny_model_dir, EngineConfig(**LLM_DEFAULTS), stream_layers=stream_layers)
    try:
        _faults(pair)
        outs, failed = pair.generate(PROMPTS, greedy(6))
        for i, out in enumerate(outs):
            if i in BAD:
                assert out is None
                continue
            assert out is not None and out.outputs[0].token_ids == want[i], i
        assert set(failed) == {f"pair-{i}" for i in BAD}
        assert "ValueError: injected at prefill sample" in failed["pair-1"]
        assert "ValueError: injected at decode append" in failed["pair-3"]
        assert failed["pair-4"].startswith("TransferAborted") and "KV export failed" in failed["pair-4"]
        report = pair.prefill.take_report()
        assert [rid for rid, _ in report["dropped"]] == ["pair-4"] and "injected" in report["dropped"][0][1]
        pair.check_no_leaks()
    finally:
        pair.close()


def test_own_faults_are_reported_not_retryable():
    report = StepReport(failed={"a": "transfer failed"}, errors={"b": "ValueError: x"})
    events = {ev.request_id: ev for ev in step_events(report, {})}
    assert isinstance(events["a"], RequestFailed) and events["a"].retryable
    assert isinstance(events["b"], RequestFailed) and not events["b"].retryable
