"""Tiered expert memory (:mod:`decode_node.expert_tiers`): a bounded set of experts on the device, the rest in host
memory, loaded on demand or pre-warmed.

Greedy tokens and float32 logits equal the all-resident engine's (lru and duet, 25% and 50% resident, a three-layer
top-3 model so the combine adds three terms per token); the counters add up; a pre-warm list makes the next step's
experts hits; eviction prefers the lowest forecast (a worked example against LRU); the decode worker feeds committed
requests' routing hints to the policy and forgets them when the requests finish.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from decode_node.expert_residency import Residency
from decode_node.expert_tiers import ExpertTiers, TierConfig
from decode_node.worker import DecodeWorker
from engine import LLM, EngineConfig
from engine.errors import InvalidRequestError
from engine.moe import SparseMoe
from kv_transfer.inproc.manager import Manager as InprocManager
from node_common.expert_policies import DuetPolicy, LRUPolicy
from prefill_node.worker import PrefillWorker
from tests.conftest import (
    LLM_DEFAULTS,
    assert_no_leaked_blocks,
    greedy,
    make_image,
    make_request,
)

SPEC = {"num_layers": 3, "top_k": 3, "num_experts": 8}
PROMPTS = [make_request(6 + 3 * i, seed=i, images=[make_image(i)] * (i % 2)) for i in range(4)]


@pytest.fixture(scope="module")
def model_dir(tiny_ckpt):
    return tiny_ckpt(**SPEC)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The all-resident engine's greedy tokens and logits."""
    outs = LLM(model_dir, **LLM_DEFAULTS).generate(PROMPTS, greedy(10, return_logits=True))
    return [(o.outputs[0].token_ids, o.outputs[0].logits) for o in outs]


def moes(llm: LLM) -> list[SparseMoe]:
    return [layer.mlp for layer in llm.engine.model.text.layers if isinstance(layer.mlp, SparseMoe)]


@pytest.mark.parametrize("resident", [0.25, 0.5], ids=["25pct", "50pct"])
@pytest.mark.parametrize("policy", ["lru", "duet"])
def test_equal_to_all_resident_and_counters_add_up(model_dir, reference, policy, resident):
    llm = LLM(model_dir, **LLM_DEFAULTS)
    tiers = ExpertTiers(llm.engine, TierConfig(resident, policy))
    try:
        outs = llm.generate(PROMPTS, greedy(10, return_logits=True))
        assert tiers.wait_idle()
    finally:
        tiers.close()
    for out, (tokens, logits) in zip(outs, reference, strict=True):
        assert out.outputs[0].token_ids == tokens
        # the tiers run the same experts from other tensors (slot order, strides): equal to rounding on any CPU
        for a, b in zip(out.outputs[0].logits, logits, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert_no_leaked_blocks(llm)
    tiers.res.check()
    assert tiers.capacity == round(resident * 3 * 8) and tiers.dev_gu.shape[0] == tiers.capacity + 8
    assert all(m.gate_up_proj.numel() == 0 for m in moes(llm))  # the all-resident tensors are gone

    s = tiers.stats
    assert s.assignments == sum(int(m.expert_counts.sum()) for m in moes(llm))  # every (token, expert) pair
    assert 0 <= s.hits <= s.assignments and s.hit_rate == s.hits / s.assignments < 1
    assert (s.hits > 0) == (policy == "duet" or resident == 0.5)  # 6 slots cycled through 3 layers: LRU never hits
    assert s.accesses == s.expert_hits + s.stalled_loads and s.stalled_loads > 0
    assert s.stalled_loads == s.demand_copies + s.late
    assert s.bytes_copied == (s.demand_copies + s.prefetches) * tiers.bytes_per_expert
    assert tiers.bytes_per_expert == 3 * 64 * 32 * 4  # [2I, H] + [H, I] in float32
    assert (s.prefetches > 0) == (policy == "duet")  # lru loads on demand only
    assert len(tiers.res.resident()) <= tiers.capacity


def test_a_prefetch_list_makes_the_next_step_hits(model_dir):
    """Step a reference engine one step ahead, send its experts as the pre-warm list: the tiered step stalls on none."""
    ref, llm = LLM(model_dir, **LLM_DEFAULTS), LLM(model_dir, **LLM_DEFAULTS)
    for m in moes(ref):
        m.record_routing = True
    tiers = ExpertTiers(llm.engine, TierConfig(0.5, "lru"))  # 12 slots; one token needs 3 experts in each of 3 layers
    try:
        for e in (ref.engine, llm.engine):
            e.add_request("r", PROMPTS[0], greedy(6))
            e.step()  # the prompt
        for _ in range(4):
            ref.engine.step()
            keys = [(li, int(e)) for li, m in enumerate(moes(ref)) for e in m.last_experts.unique()]
            tiers.prefetch(keys)
            assert tiers.wait_idle()
            before = dataclasses.replace(tiers.stats)
            out = llm.engine.step()
            s = tiers.stats
            assert s.stalled_loads == before.stalled_loads and s.expert_hits - before.expert_hits == len(keys) == 9
            assert s.hits - before.hits == 3 * 3  # 3 layers x top-3 for one token
        assert out[0].outputs[0].token_ids == ref.engine.requests["r"].output_token_ids
    finally:
        tiers.close()
    tiers.res.check()


def _run_layer(res: Residency, policy, tau: int, counts: list[int]) -> None:
    """One layer of the tiered executor's bookkeeping, without tensors."""
    counts = np.asarray(counts)
    policy.at(tau)
    res.invalidate_scores()
    got = res.acquire(0, np.flatnonzero(counts), tau)
    policy.observe(0, counts)
    policy.at(tau + 1)
    res.invalidate_scores()
    res.release()
    res.keep(got.missing)


@pytest.mark.parametrize(("policy", "kept"), [(DuetPolicy(decay=0.5, hint_weight=0.0), {(0, 0), (0, 2)}),
                                              (LRUPolicy(), {(0, 1), (0, 2)})], ids=["duet", "lru"])
def test_eviction_prefers_the_lowest_forecast(policy, kept):
    """One layer, 4 experts, 2 slots. Expert 0 gets 5 tokens, then expert 1 gets 1, then expert 2 gets 3 and must
    evict one. Forecasts then (EWMA, decay 0.5): expert 0 0.625, expert 1 0.25, expert 2 1.5 -> Duet evicts
    expert 1, though expert 0 is the least recently used (LRU evicts expert 0)."""
    policy.reset(1, 4, 2, 1)
    res = Residency(policy, num_layers=1, num_experts=4, capacity=2, per_layer=False)
    for tau, counts in enumerate([[5, 0, 0, 0], [0, 1, 0, 0], [0, 0, 3, 0]]):
        _run_layer(res, policy, tau, counts)
        res.check()
    assert set(res.resident()) == kept


def test_look_ahead_experts_and_certain_copies_stay_until_their_layer():
    policy = LRUPolicy()
    policy.reset(2, 4, 1, 1)
    res = Residency(policy, num_layers=2, num_experts=4, capacity=1, per_layer=True)
    res.enqueue([(1, 3)], 1, certain=True)
    assert [k for k, _ in res.take_copies(4)] == [(1, 3)]
    res.loaded((1, 3))
    res.enqueue([(1, 2)], 1, certain=True)  # a second certain copy for the same one-slot pool: may not evict (1, 3)
    assert res.take_copies(4) == []
    _run_layer(res, policy, 0, [1, 0, 0, 0])
    got = res.acquire(1, [3], 1)
    assert got.hits == [(1, 3)] and not res.pinned


def test_decode_worker_feeds_routing_hints_and_equals_local(model_dir, reference):
    pm, dm = InprocManager(), InprocManager()
    cfg = EngineConfig(**LLM_DEFAULTS)
    pw = PrefillWorker(model_dir, cfg)
    dw = DecodeWorker(model_dir, cfg, dm, expert_tiers=TierConfig(0.5, "duet"))
    seen = []
    on_requests = dw.tiers.policy.on_requests
    dw.tiers.policy.on_requests = lambda arrivals, departures: (seen.append((arrivals, departures)),
                                                               on_requests(arrivals, departures))
    params = greedy(10)
    tokens = {}
    try:
        for i, p in enumerate(PROMPTS):
            pw.submit(f"r{i}", p, params, pm.sender(dw.allocate(f"r{i}", p, params)))
        for _ in range(500):
            if not (pw.has_work() or dw.has_work()):
                break
            pw.step()
            report = dw.step()
            assert not report.failed
            tokens.update({o.request_id: o.outputs[0].token_ids for o in report.outputs})
            if not pw.has_work() and dw.receivers:
                next(iter(dw.receivers.values())).wait(0.05)
        assert dw.tiers.wait_idle()
    finally:
        dw.tiers.close()
        pm.close()
        dm.close()
    assert [tokens[f"r{i}"] for i in range(4)] == [t for t, _ in reference]
    arrived = {rid: hint for a, _ in seen for rid, hint in a}
    assert sorted(arrived) == [f"r{i}" for i in range(4)]
    assert all(h.shape == (3, 8) and h.sum() > 0 for h in arrived.values())  # [MoE layers, E] from prefill
    assert sorted(r for _, d in seen for r in d) == sorted(arrived)  # each left once it finished
    assert dw.tiers.policy.hints == {} and dw.tiers.stats.prefetches > 0
    dw.engine.block_manager.check_no_leaks()


def test_config_errors(model_dir, tiny_ckpt):
    for bad in (0.0, 1.5, 0, True, "half"):
        with pytest.raises(InvalidRequestError, match="expert_resident"):
            TierConfig(bad)
    with pytest.raises(InvalidRequestError, match="policy"):
        TierConfig(0.5, "belady")
    with pytest.raises(InvalidRequestError, match="scope"):
        TierConfig(0.5, scope="node")
    with pytest.raises(InvalidRequestError, match="exceeds"):
        TierConfig(9).capacity(3, 8)
    assert TierConfig(2).capacity(3, 8) == 6 and TierConfig(2, scope="layer").capacity(3, 8) == 2
    assert TierConfig(0.25).capacity(3, 8) == 6 and TierConfig(1.0).capacity(3, 8) == 24
    with pytest.raises(InvalidRequestError, match="MoE"):
        ExpertTiers(LLM(tiny_ckpt(text="qwen3"), **LLM_DEFAULTS).engine, TierConfig(0.5))
    from decode_node.expert_parallel import ExpertParallelConfig

    with pytest.raises(InvalidRequestError, match="expert-parallel"):
        DecodeWorker(model_dir, EngineConfig(**LLM_DEFAULTS), InprocManager(), expert_tiers=TierConfig(0.5),
                     expert_parallel=ExpertParallelConfig(rank=0, world=2, slots_per_worker=4))
