"""One request's fault in a step ends that request only (:mod:`engine.isolation`): poisoned requests (a fault
injected through ``EngineHooks.request_fault`` at each per-request stage, a logits processor that writes NaN or
forbids every token, a grammar-like processor whose ``accept`` raises) mixed into a batch of valid ones. The valid
ones come out exactly as in a run where the poisoned requests were valid and ended at the same step (the same
operations on the same batches), the poisoned ones end with ``finish_reason "error"`` and a reason, and nothing is
held afterwards."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineHooks, LLMEngine
from engine.config import EngineConfig
from engine.isolation import STAGES, edit_rows, non_finite_rows
from tests.conftest import LLM_DEFAULTS, assert_no_leaked_blocks, greedy, make_request

GOOD = [greedy(6), greedy(6, temperature=0.8, seed=11), greedy(6, n=2, temperature=1.0, seed=5),
        greedy(6, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2)]
FAULT_STEP = 3  # the poisoned requests fail in the step that samples their 3rd token


def _run(model_dir, bad_params, hooks=None, factory=None) -> tuple[dict, LLMEngine]:
    e = LLMEngine(model_dir, EngineConfig(**LLM_DEFAULTS), hooks=hooks)
    if factory is not None:
        e.logits_processor_factory = factory
    for i, p in enumerate(GOOD):
        e.add_request(f"good-{i}", make_request(8, seed=i), p)
        if i < len(bad_params):  # interleaved: a poisoned row between valid ones
            e.add_request(f"bad-{i}", make_request(7, seed=10 + i), bad_params[i])
    final = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                final[out.request_id] = out
    return final, e


def _tokens(out) -> list[list[int]]:
    return [c.token_ids for c in sorted(out.outputs, key=lambda c: c.index)]


def _check(final, e, reference, match: str) -> None:
    for rid, out in final.items():
        if rid.startswith("bad"):
            assert out.error is not None and match in out.error, out.error
            assert all(c.finish_reason == "error" for c in out.outputs)
            assert len(out.outputs[0].token_ids) <= FAULT_STEP
        else:
            assert out.error is None and _tokens(out) == _tokens(reference[rid]), rid
    assert {r for r in final if r.startswith("good")} == {f"good-{i}" for i in range(len(GOOD))}
    assert_no_leaked_blocks(e)


@pytest.mark.parametrize("stage", [s for s in STAGES if s != "export"])
def test_a_fault_at_each_stage_ends_only_its_request(tiny_model_dir, stage):
    at = FAULT_STEP if stage == "output" else FAULT_STEP - 1  # "output" runs after the step's token was appended
    seen = []

    def fault(where, seq):
        if where == stage and seq.request_id.startswith("bad") and seq.num_output_tokens == at:
            seen.append(seq.request_id)
            raise ValueError(f"injected at {where}")

    bad = [greedy(6), greedy(6)]
    reference, _ = _run(tiny_model_dir, [greedy(FAULT_STEP)] * 2)  # the same batches, every row valid
    final, e = _run(tiny_model_dir, bad, EngineHooks(request_fault=fault))
    assert sorted(set(seen)) == ["bad-0", "bad-1"]
    _check(final, e, reference, f"ValueError: injected at {stage}")


class _Poison:
    """A logits processor that, from the sequence's 3rd token on, writes ``value`` over its row (NaN: a model fault;
    -inf: nothing may be sampled) or raises in ``accept`` (a grammar that rejects a token)."""

    def __init__(self, value: float | None) -> None:
        self.value, self.n = value, 0

    def apply(self, logits: torch.Tensor) -> None:
        if self.value is not None and self.n == FAULT_STEP - 1:
            logits.fill_(self.value)

    def accept(self, token_id: int) -> None:
        self.n += 1
        if self.value is None and self.n == FAULT_STEP:
            raise RuntimeError(f"grammar rejected token {token_id}")


@pytest.mark.parametrize("value, match", [(float("nan"), "NonFiniteLogitsError: its logits were NaN"),
                                          (float("-inf"), "NonFiniteLogitsError: its logits were -inf"),
                                          (None, "RuntimeError: grammar rejected")])
def test_poisoned_logits_and_a_rejecting_grammar_end_only_their_request(tiny_model_dir, value, match):
    marker = 4242  # the poisoned requests' seed picks them out in the factory

    def factory(params):
        return _Poison(value) if params.seed == marker else None

    reference, _ = _run(tiny_model_dir, [greedy(FAULT_STEP)] * 2)
    final, e = _run(tiny_model_dir, [greedy(6, seed=marker)] * 2, factory=factory)
    _check(final, e, reference, match)


def test_llm_generate_returns_every_output_with_the_failed_one_marked(tiny_model_dir):
    def fault(where, seq):
        if where == "sample" and seq.request_id == "gen-1":
            raise KeyError("boom")

    llm = LLM(tiny_model_dir, hooks=EngineHooks(request_fault=fault), **LLM_DEFAULTS)
    outs = llm.generate([make_request(8, seed=s) for s in range(3)], greedy(4))
    assert [o.error for o in outs] == [None, "KeyError: 'boom'", None]
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 0, 4]
    assert_no_leaked_blocks(llm)


def test_edit_rows_reruns_row_by_row_and_restores_what_the_batch_call_changed():
    logits = torch.zeros(3, 4)
    calls = []

    def edit(x, seqs):  # adds 1 to every row it gets; raises for "b" -- after editing the rows before it
        calls.append(list(seqs))
        for r, s in enumerate(seqs):
            if s == "b":
                raise ValueError("b")
            x[r] += 1

    faults: dict[int, BaseException] = {}
    edit_rows(logits, ["a", "b", "c"], edit, [0, 1, 2], faults)
    assert list(faults) == [1] and logits.tolist() == [[1.0] * 4, [0.0] * 4, [1.0] * 4]  # "a" edited once, not twice
    assert calls == [["a", "b", "c"], ["a"], ["b"], ["c"]]


def test_non_finite_rows():
    logits = torch.tensor([[0.0, 1.0], [float("nan"), 1.0], [float("-inf"), float("-inf")], [float("-inf"), 2.0]])
    faults: dict[int, BaseException] = {}
    non_finite_rows(logits, faults)
    assert sorted(faults) == [1, 2]
