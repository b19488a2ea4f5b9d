"""Scheduling policies (``EngineConfig.scheduling_policy``: ``fcfs`` / ``shortest``) and the reserved decode
staging (``EngineConfig.decode_mirror_tokens``): the scheduler alone, then the engine on the tiny checkpoint (same
tokens as the defaults)."""

from __future__ import annotations

import time

import pytest

from engine import EngineConfig
from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from tests.conftest import greedy
from tests.engine.test_scheduler import EDGES, MIXED, _advance, _plan, _seq, _tokens


def _arrived(seq: Sequence, at: float) -> Sequence:
    seq.metrics.arrival_time = at
    return seq


def _scheduler(**kw) -> tuple[BlockManager, Scheduler]:
    bm = BlockManager(64, 4)
    return bm, Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, **kw)


def test_shortest_policy_gives_short_prompts_a_step_of_their_own():
    bm, sch = _scheduler(policy="shortest")
    now = time.perf_counter()
    long_, short1, short2 = (_arrived(_seq(n), now) for n in (40, 6, 5))
    for s in (long_, short1, short2):
        sch.add(s)
    out = sch.schedule()  # shortest first; the 40-token prompt is more than twice the step's 11 tokens
    assert _plan(out) == ([(short2.request_id, 5), (short1.request_id, 6)], [])
    _advance(out, bm)
    out = sch.schedule()  # decodes do not count as prompt tokens: the long prompt still gets a step
    assert _plan(out) == ([(long_.request_id, 40)], [(short2.request_id, 1), (short1.request_id, 1)])


def test_fcfs_policy_batches_in_arrival_order():
    _, sch = _scheduler()
    long_, short = _seq(40), _seq(6)
    sch.add(long_)
    sch.add(short)
    assert _plan(sch.schedule()) == ([(long_.request_id, 40), (short.request_id, 6)], [])


def test_shortest_policy_serves_a_prompt_that_waited_too_long_first():
    _, sch = _scheduler(policy="shortest", max_wait_s=2.0)
    now = time.perf_counter()
    old, fresh = _arrived(_seq(40), now - 3.0), _arrived(_seq(6), now)
    sch.add(fresh)
    sch.add(old)
    assert _plan(sch.schedule()) == ([(old.request_id, 40), (fresh.request_id, 6)], [])


def test_unknown_scheduling_policy_is_rejected():
    with pytest.raises(ValueError, match="scheduling policy"):
        Scheduler(BlockManager(4, 4), max_num_seqs=1, max_num_batched_tokens=8, policy="lifo")
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="scheduling_max_wait_s"):
        EngineConfig(scheduling_max_wait_s=0)


def test_shortest_policy_engine_gives_the_same_tokens(make_llm):
    prompts = MIXED + EDGES
    full = _tokens(make_llm().generate(prompts, greedy(10)))
    llm = make_llm(scheduling_policy="shortest", max_num_batched_tokens=16)
    assert _tokens(llm.generate(prompts, greedy(10))) == full


def test_reserved_decode_mirror_never_grows_and_gives_the_same_tokens(make_llm):
    prompts = MIXED + EDGES
    full = _tokens(make_llm().generate(prompts, greedy(10)))
    llm = make_llm(decode_mirror_tokens=64, max_num_seqs=8)
    mirror = llm.engine.runner.mirror
    k0 = mirror.k[0]
    assert k0.shape[0] == 8 and k0.shape[2] == 64  # [max_num_seqs, kv_heads, reserved tokens, head_dim]
    assert _tokens(llm.generate(prompts, greedy(10))) == full
    assert mirror.k[0] is k0  # reserved at start: no growth (and no copy) while decoding
    with pytest.raises(ValueError, match="decode_mirror_tokens"):
        EngineConfig(decode_mirror_tokens=0)
