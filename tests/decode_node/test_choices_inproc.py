"""n > 1 and logprobs across the prefill -> decode hand-off (in-process workers, no Ray).

The prefill worker samples every choice's first token (with its logprobs and generator state) and hands them over in
the versioned hand-off; the decode worker forks the choices onto the prompt's received blocks. The result must equal
the local engine's, choice for choice, with the prompt computed once, and free every block on both sides.
"""

from __future__ import annotations

import pytest

from decode_node.worker import DecodeWorker
from engine import LLM, EngineConfig, SamplingParams
from kv_transfer.inproc.manager import Manager as InprocManager
from prefill_node.worker import PrefillWorker
from tests.conftest import greedy, make_image, make_request

CFG = dict(dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128)


def _disaggregated(model_dir, prompt, params) -> tuple[dict[int, list[int]], dict[int, list], list | None,
                                                        PrefillWorker, DecodeWorker]:
    pm = InprocManager()
    pw = PrefillWorker(model_dir, EngineConfig(**CFG))
    dw = DecodeWorker(model_dir, EngineConfig(**CFG), InprocManager())
    pw.submit("r", prompt, params, pm.sender(dw.allocate("r", prompt, params)))
    events = []
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list] = {}
    prompt_logprobs = None
    finished = False
    for _ in range(2000):
        if finished and not (pw.has_work() or dw.has_work()):
            break
        pw.step()
        report = dw.step()
        assert not report.failed
        events.extend(report.events)
        for out in report.outputs:
            for c in out.outputs:
                tokens[c.index], logprobs[c.index] = c.token_ids, c.logprobs
            if out.prompt_logprobs is not None:
                prompt_logprobs = out.prompt_logprobs
            finished = finished or out.finished
        if not pw.has_work() and dw.receivers:
            next(iter(dw.receivers.values())).wait(0.05)
    _check_events(events, tokens, params)
    return tokens, logprobs, prompt_logprobs, pw, dw


def _check_events(events, tokens: dict[int, list[int]], params: SamplingParams) -> None:
    """Per choice the events carry its tokens once (logprobs alongside), its end once; only the last event of the
    request says finished; prompt logprobs come on choice 0's first event."""
    for index, want in tokens.items():
        mine = [e for e in events if e.index == index]
        assert [t for e in mine for t in e.token_ids] == want
        assert [e.choice_finished for e in mine].count(True) == 1 and mine[-1].choice_finished
        if params.logprobs is not None:
            assert sum(len(e.logprobs) for e in mine) == len(want)
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    with_prompt = [e for e in events if e.prompt_logprobs is not None]
    assert with_prompt == ([] if params.prompt_logprobs is None else [next(e for e in events if e.index == 0)])


@pytest.mark.parametrize("params", [
    greedy(6, n=3, logprobs=2, prompt_logprobs=1),
    SamplingParams(temperature=0.9, top_k=40, max_tokens=7, ignore_eos=True, seed=5, n=4, logprobs=1),
], ids=["greedy-n3", "seeded-n4"])
def test_choices_and_logprobs_cross_the_handoff(tiny_model_dir, params):
    prompt = make_request(9, seed=3, images=[make_image(1)])
    want = LLM(tiny_model_dir, **CFG).generate(prompt, params)[0]
    tokens, logprobs, prompt_logprobs, pw, dw = _disaggregated(tiny_model_dir, prompt, params)
    assert sorted(tokens) == list(range(params.n))
    for c in want.outputs:
        assert tokens[c.index] == c.token_ids
        assert len(logprobs[c.index]) == len(c.token_ids)
        for got, ref in zip(logprobs[c.index], c.logprobs, strict=True):
            assert got.token_id == ref.token_id
            assert abs(got.logprob - ref.logprob) <= 1e-4  # decode steps batch differently than the local run
            assert [t for t, _ in got.top] == [t for t, _ in ref.top]
    if params.prompt_logprobs is not None:  # computed on the prefill worker, carried in the hand-off
        assert prompt_logprobs[0] is None and want.prompt_logprobs[0] is None
        assert [x.logprob for x in prompt_logprobs[1:]] == pytest.approx([x.logprob for x in want.prompt_logprobs[1:]],
                                                                         abs=1e-5)
    assert pw.prompt_tokens == len(prompt["prompt_token_ids"])  # the prompt was prefilled once, for all choices
    for w in (pw, dw):
        w.engine.block_manager.check_no_leaks()
        assert not w.engine.requests


def test_handoff_with_the_wrong_number_of_choices_fails_cleanly(tiny_model_dir):
    """A hand-off whose choices do not match the request's n (a broken or foreign sender) is a failed request, and
    the blocks reserved for it are freed."""
    dw = DecodeWorker(tiny_model_dir, EngineConfig(**CFG), InprocManager())
    prompt = make_request(9, seed=3)
    dw.allocate("r", prompt, greedy(4, n=3))
    with pytest.raises(Exception, match="first tokens for n=3"):
        dw.engine.commit_prefilled("r", 5, choices=[(6, None, None)])
    dw.engine.block_manager.check_no_leaks()
    assert not dw.engine.requests
