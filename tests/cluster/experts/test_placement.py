"""Expert placement: worked examples computed by hand, the issue's figures, and properties over random loads."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duet_bench.experts_bench import drifting_loads, zipf_load
from cluster.experts.placement import (
    Placement,
    align,
    balancedness,
    duet_placement,
    greedy_placement,
    layer_balancedness,
    migrate_placement,
    should_rebalance,
    slots_changed,
    static_placement,
    worker_loads,
)


def _duplicates(p: Placement) -> int:
    """Replicas beyond the first of an expert on one worker, over all layers and workers."""
    return sum(int(np.maximum(np.bincount(p.worker_experts(li, w)) - 1, 0).sum())
               for li in range(p.num_layers) for w in range(p.workers))


def _unavoidable(p: Placement) -> int:
    return int(np.maximum(p.replica_counts() - p.workers, 0).sum())


# ------------------------------------------------------------------------------------------------ worked examples
def test_balancedness_by_hand():
    # slots [0 1 | 0 2]: expert 0 has two replicas (3 each); workers 3 + 3 = 6 and 3 + 1 = 4; mean 5
    p = Placement(np.array([[0, 1, 0, 2]]), num_experts=3, workers=2, slots_per_worker=2)
    load = np.array([[6.0, 3.0, 1.0]])
    assert worker_loads(load, p).tolist() == [[6.0, 4.0]]
    assert balancedness(load, p) == pytest.approx(5 / 6)
    # a layer without load counts as balanced; layers average
    two = Placement(np.array([[0, 1, 0, 2], [0, 1, 0, 2]]), 3, 2, 2)
    assert layer_balancedness(np.array([[6.0, 3, 1], [0, 0, 0]]), two).tolist() == pytest.approx([5 / 6, 1.0])


def test_placement_lookups():
    p = Placement(np.array([[0, 1, 0, 2]]), 3, 2, 2)
    assert p.replicas(0, 0) == (0, 2) and p.replicas(0, 2) == (3,)
    assert [p.worker_of(s) for s in range(4)] == [0, 0, 1, 1]
    assert p.logical_to_physical() == (((0, 2), (1,), (3,)),)
    assert p.replica_counts().tolist() == [[2, 1, 1]]
    assert p.worker_experts(0, 1).tolist() == [0, 2]
    with pytest.raises(ValueError):
        p.slots[0, 0] = 1  # read-only


def test_every_expert_needs_a_replica():
    with pytest.raises(AssertionError, match="without a replica"):
        Placement(np.array([[0, 1, 0, 1]]), 3, 2, 2)


def test_dict_round_trip_through_msgpack():
    p = greedy_placement(np.array([[7.0, 9, 4, 1], [1, 2, 3, 4]]), 2, 3)
    d = msgpack.unpackb(msgpack.packb(p.to_dict()))
    assert d["version"] == 1 and Placement.from_dict(d) == p
    with pytest.raises(ValueError, match="version"):
        Placement.from_dict({**d, "version": 99})


def test_static_round_robin_by_hand():
    # experts 0..3 alternate over 2 workers; spare slots: expert 0 skips worker 0 (holds it) -> worker 1, then 1 -> 0
    p = static_placement(4, 2, 3, layers=2)
    assert p.slots.tolist() == [[0, 2, 1, 1, 3, 0]] * 2
    assert static_placement(4, 2, 2, 1).slots.tolist() == [[0, 2, 1, 3]]


def test_greedy_worked_example():
    # the module docstring's example: counts [2, 2, 1, 1]; LPT 1:4.5 1:4.5 2:4 0:3.5 0:3.5 3:1 -> workers 0 1 0 1 0 1
    load = np.array([[7.0, 9.0, 4.0, 1.0]])
    p = greedy_placement(load, 2, 3)
    assert p.slots.tolist() == [[1, 2, 0, 1, 0, 3]]
    assert worker_loads(load, p).tolist() == [[12.0, 9.0]]
    assert balancedness(load, p) == pytest.approx(10.5 / 12)


def test_duet_worked_example_beats_greedy():
    # three replicas of expert 1 (3 each) and one of expert 0: loads 11 and 10
    load = np.array([[7.0, 9.0, 4.0, 1.0]])
    p = duet_placement(load, 2, 3)
    assert p.replica_counts().tolist() == [[1, 3, 1, 1]]
    assert sorted(worker_loads(load, p)[0].tolist()) == [10.0, 11.0]
    assert balancedness(load, p) == pytest.approx(10.5 / 11)


def test_migrate_one_move_by_hand():
    # the load moved from expert 0 to expert 1: [0 1 | 0 2] puts 0.5 + 6 on worker 0 and 0.5 + 1 on worker 1.
    # One move: worker 1's replica of 0 becomes a second replica of 1 -> 1 + 3 and 3 + 1 (perfect). Turning worker
    # 0's replica of 0 into 1 instead would put two replicas of 1 on worker 0 (avoidable).
    cur = Placement(np.array([[0, 1, 0, 2]]), 3, 2, 2)
    load = np.array([[1.0, 6.0, 1.0]])
    new, n = migrate_placement(load, cur, max_moves=1)
    assert new.slots.tolist() == [[0, 1, 1, 2]] and n == 1 == slots_changed(cur, new)
    assert balancedness(load, new) == 1.0
    same, n0 = migrate_placement(load, cur, max_moves=0)
    assert same == cur and n0 == 0
    # already at the target: nothing moves
    assert migrate_placement(load, new, max_moves=4)[1] == 0


def test_should_rebalance_formula():
    cur = Placement(np.array([[0, 1, 0, 2]]), 3, 2, 2)
    cand = Placement(np.array([[0, 1, 1, 2]]), 3, 2, 2)
    load = np.array([[1.0, 6.0, 1.0]])
    # max load 6.5 -> 4: saved = 100 steps * 10 ms * (1 - 4/6.5) = 0.3846 s; copy 1 slot * 1 GB / 10 GB/s = 0.1 s
    d = should_rebalance(load, cur, cand, bytes_per_expert=1e9, link_gbps=10, step_s=0.01, horizon_steps=100)
    assert d and d.slots == 1
    assert d.saved_s == pytest.approx(1 - 4 / 6.5) and d.copy_s == pytest.approx(0.1)
    assert not should_rebalance(load, cur, cand, bytes_per_expert=1e10, link_gbps=10, step_s=0.01, horizon_steps=100)
    assert not should_rebalance(load, cur, cur, bytes_per_expert=1, link_gbps=10, step_s=0.01, horizon_steps=100)


def test_align_recovers_relabelled_workers():
    cur = greedy_placement(zipf_load(1.2, 2, 16), 4, 5)
    perm = cur.slots.reshape(2, 4, 5)[:, [2, 0, 3, 1], ::-1].reshape(2, 20)
    shuffled = Placement(perm, 16, 4, 5)
    assert slots_changed(cur, shuffled) > 0
    assert slots_changed(cur, align(shuffled, cur)) == 0


def test_nodes_spread_replicas_without_losing_balance():
    load = zipf_load(1.2, 3, 16, seed=1)
    flat = duet_placement(load, 4, 5)
    spread = duet_placement(load, 4, 5, nodes=2)
    assert balancedness(load, spread) >= balancedness(load, flat) - 1e-12
    for li in range(3):
        for e in range(16):
            nodes = {spread.worker_of(s) // 2 for s in spread.replicas(li, e)}
            assert len(nodes) == min(2, len(spread.replicas(li, e))), (li, e)
    assert duet_placement(load, 4, 5, nodes=[0, 1, 0, 1]).num_slots == 20


# ---------------------------------------------------------------------------------------------- the figures
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_zipf12_with_25pct_extra_slots(seed):
    load = zipf_load(1.2, 4, 16, seed=seed)
    static = balancedness(load, static_placement(16, 4, 5, 4))
    greedy = balancedness(load, greedy_placement(load, 4, 5))
    duet = balancedness(load, duet_placement(load, 4, 5))
    assert duet >= 0.98 and duet >= greedy >= 0.98
    assert 0.4 <= static <= 0.7


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_migration_on_a_drifting_load(seed):
    loads = drifting_loads(1.2, 4, 16, 20, seed=seed)
    scratch = migrate = duet_placement(loads[0], 4, 5)
    from_scratch = moved = 0
    for load in loads[1:]:
        fresh = align(duet_placement(load, 4, 5), scratch)
        from_scratch += slots_changed(scratch, fresh)
        scratch = fresh
        migrate, n = migrate_placement(load, migrate, max_moves=4, target=0.9)
        moved += n
        assert balancedness(load, migrate) >= 0.9
    assert moved <= from_scratch / 4


# ----------------------------------------------------------------------------------------------------- properties
@st.composite
def _problems(draw):
    layers = draw(st.integers(1, 2))
    experts = draw(st.integers(2, 9))
    workers = draw(st.integers(1, 4))
    slots = draw(st.integers(-(-experts // workers), -(-experts // workers) + 2))
    cells = st.floats(0, 100, allow_nan=False, allow_infinity=False)
    load = np.array(draw(st.lists(st.lists(cells, min_size=experts, max_size=experts), min_size=layers,
                                  max_size=layers)))
    return load, workers, slots


@settings(max_examples=60, deadline=None)
@given(_problems())
def test_placements_are_valid_and_duet_never_loses_to_greedy(problem):
    load, workers, slots = problem
    greedy = greedy_placement(load, workers, slots)
    duet = duet_placement(load, workers, slots)
    for p in (greedy, duet, static_placement(load.shape[1], workers, slots, load.shape[0])):
        assert p.slots.shape == (load.shape[0], workers * slots)  # every worker exactly S slots
        assert (p.replica_counts() >= 1).all()
        assert _duplicates(p) == _unavoidable(p)
    assert (layer_balancedness(load, duet) >= layer_balancedness(load, greedy) - 1e-9).all()


@settings(max_examples=40, deadline=None)
@given(_problems(), st.integers(0, 3))
def test_migration_respects_its_budget(problem, max_moves):
    load, workers, slots = problem
    cur = static_placement(load.shape[1], workers, slots, load.shape[0])
    new, n = migrate_placement(load, cur, max_moves=max_moves)
    assert n == slots_changed(cur, new) <= max_moves * load.shape[0]
    assert (new.replica_counts() >= 1).all()
    assert balancedness(load, new) >= balancedness(load, cur) - 1e-9
