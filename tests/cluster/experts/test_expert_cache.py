"""Tiered expert memory simulation: tiny traces checked by hand for each policy, the trace format, and the issue's
pre-warm criteria on Zipf 1.2 traces."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cluster.experts.expert_cache import (
    BeladyPolicy,
    DuetPolicy,
    LRUPolicy,
    Trace,
    TraceStep,
    capacity_for,
    load_trace,
    make_policy,
    save_trace,
    simulate,
    zipf_trace,
)


def _trace(steps: list[list[dict[int, int]]], num_experts: int, top_k: int = 1,
           arrivals: dict[int, list[tuple[str, list[list[int]]]]] | None = None) -> Trace:
    """``steps[t][layer]`` maps expert -> assignments."""
    layers = len(steps[0])
    out = []
    for t, step in enumerate(steps):
        counts = np.zeros((layers, num_experts), dtype=np.int64)
        for li, used in enumerate(step):
            for e, n in used.items():
                counts[li, e] = n
        arr = [(rid, np.array(h)) for rid, h in (arrivals or {}).get(t, [])]
        out.append(TraceStep(counts, arr, []))
    return Trace(layers, num_experts, top_k, out)


def test_capacity():
    assert capacity_for(0.25, 16) == 4 and capacity_for(0.5, 8) == 4 and capacity_for(0.01, 8) == 1
    assert capacity_for(2 / 3, 3) == 2


def test_lru_and_belady_by_hand():
    # one layer, 3 experts, 2 slots; uses 0 (2 tokens), 1, 2, 0
    tr = _trace([[{0: 2}], [{1: 1}], [{2: 1}], [{0: 1}]], 3)
    lru = simulate(tr, LRUPolicy(), resident=2 / 3)
    # 2 evicts 0 (least recent), then 0 evicts 1: every use misses
    assert (lru.stalled_loads, lru.hits, lru.assignments, lru.prefetches) == (4, 0, 5, 0)
    bel = simulate(tr, BeladyPolicy(tr), resident=2 / 3)
    # MIN: 2 is never used again, so it is not kept; 0 (used at step 3) stays -> one hit
    assert (bel.stalled_loads, bel.hits) == (3, 1) and bel.hit_rate == pytest.approx(1 / 5)
    assert bel.bytes_copied == 3.0  # one byte per expert unless told


def test_duet_evicts_the_lowest_forecast_not_the_least_recent():
    # expert 0 is used three times, then 1, then 2, then 0 again. When 2 arrives, LRU drops 0 (least recent); Duet's
    # moving average (decay 0.7) has 0 at 0.322 and 1 at 0.21, so it drops 1 and hits on 0 at the end.
    tr = _trace([[{0: 1}], [{0: 1}], [{0: 1}], [{1: 1}], [{2: 1}], [{0: 1}]], 3)
    lru = simulate(tr, LRUPolicy(), resident=2 / 3, link_rate=0)
    duet = simulate(tr, DuetPolicy(decay=0.7, prewarm=False), resident=2 / 3, link_rate=0)
    assert (lru.stalled_loads, lru.hits) == (4, 2)
    assert (duet.stalled_loads, duet.hits, duet.prefetches) == (3, 3, 0)


def test_duet_prewarms_from_hints_and_looks_one_layer_ahead():
    # two layers, 4 experts, 2 slots per layer. The request's hint says layer 0 -> expert 0, layer 1 -> expert 2:
    # both are copied before step 0. Step 1 uses 1 then 3: nothing predicted 1 (a stall), but 3 is known while
    # layer 0 runs and arrives in time.
    hint = [[8, 0, 0, 0], [0, 0, 8, 0]]
    tr = _trace([[{0: 1}, {2: 1}], [{1: 1}, {3: 1}]], 4, arrivals={0: [("r0", hint)]})
    duet = simulate(tr, DuetPolicy(), resident=0.5, scope="layer", link_rate=math.inf, bytes_per_expert=10)
    assert (duet.stalled_loads, duet.hits, duet.prefetches, duet.bytes_copied) == (1, 3, 3, 40.0)
    for policy in (LRUPolicy(), BeladyPolicy(tr)):
        s = simulate(tr, policy, resident=0.5, scope="layer")
        assert (s.stalled_loads, s.hits) == (4, 0)


@pytest.mark.parametrize(("rate", "stalls"), [(1.0, 3), (2.0, 2), (math.inf, 2)])
def test_link_rate_bounds_lookahead(rate, stalls):
    # one token, top-2: layer 0 uses {0, 1} (cold: two stalls), layer 1 uses {2, 3}, known while layer 0 runs;
    # one layer-time of link copies `rate` of them
    tr = _trace([[{0: 1, 1: 1}, {2: 1, 3: 1}]], 4, top_k=2)
    s = simulate(tr, DuetPolicy(prewarm=False), resident=1.0, scope="layer", link_rate=rate)
    assert s.stalled_loads == stalls and s.prefetches == 4 - stalls and s.hits == 4 - stalls


def test_global_pool_is_shared_by_layers():
    # 2 layers x 2 experts, one global slot: layer 0's expert and layer 1's expert evict each other (LRU does not
    # look ahead, so nothing protects the next layer's expert)
    tr = _trace([[{0: 1}, {1: 1}]] * 3, 2)
    s = simulate(tr, LRUPolicy(), resident=0.25, scope="global")
    assert s.capacity == 1 and s.stalled_loads == 6
    per_layer = simulate(tr, LRUPolicy(), resident=0.5, scope="layer")
    assert per_layer.capacity == 1 and per_layer.stalled_loads == 2


def test_zipf_trace_shape_and_determinism():
    tr = zipf_trace(s=1.2, num_layers=3, num_experts=8, top_k=2, steps=50, batch=3, prompt_tokens=10, seed=7)
    assert len(tr.steps) == 50 and (tr.num_layers, tr.num_experts, tr.top_k) == (3, 8, 2)
    for step in tr.steps:
        assert (step.counts.sum(1) == 3 * 2).all()
        assert all(h.shape == (3, 8) and (h.sum(1) == 10 * 2).all() for _, h in step.arrivals)
    ids = [r for s in tr.steps for r, _ in s.arrivals]
    assert len(ids) == len(set(ids)) and {r for s in tr.steps for r in s.departures} <= set(ids)
    again = zipf_trace(s=1.2, num_layers=3, num_experts=8, top_k=2, steps=50, batch=3, prompt_tokens=10, seed=7)
    assert all((a.counts == b.counts).all() for a, b in zip(tr.steps, again.steps, strict=True))
    assert tr.load().sum() == 50 * 3 * 3 * 2


def test_trace_json_round_trip(tmp_path):
    tr = zipf_trace(steps=5, seed=1)
    back = load_trace(save_trace(tr, tmp_path / "t.json"))
    assert back.bytes_per_expert == tr.bytes_per_expert and back.top_k == tr.top_k
    for a, b in zip(tr.steps, back.steps, strict=True):
        assert (a.counts == b.counts).all() and a.departures == b.departures
        assert [r for r, _ in a.arrivals] == [r for r, _ in b.arrivals]
        assert all((x == y).all() for (_, x), (_, y) in zip(a.arrivals, b.arrivals, strict=True))
    with pytest.raises(ValueError, match="version"):
        Trace.from_dict({**tr.to_dict(), "version": 0})


def test_bad_names():
    tr = zipf_trace(steps=2)
    with pytest.raises(ValueError, match="unknown"):
        make_policy("fifo", tr)
    with pytest.raises(ValueError, match="scope"):
        simulate(tr, LRUPolicy(), resident=0.5, scope="node")


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("resident", [0.25, 0.5])
def test_zipf12_criteria(seed, resident):
    tr = zipf_trace(s=1.2, steps=300, seed=seed)
    r = {p: simulate(tr, make_policy(p, tr), resident=resident) for p in ("lru", "duet", "belady")}
    assert r["duet"].stalled_loads <= 0.5 * r["lru"].stalled_loads
    assert r["duet"].bytes_copied <= 2.0 * r["belady"].bytes_copied
    assert r["duet"].hit_rate > r["lru"].hit_rate
    assert r["belady"].stalled_loads <= r["lru"].stalled_loads  # MIN is optimal among on-demand policies
