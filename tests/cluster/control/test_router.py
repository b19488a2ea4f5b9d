"""The pure placement functions of :mod:`cluster.control.router`: prefill by expected time to first token (queued work plus
the uncached part of the prompt, times the worker's measured speed), among workers with room; decode by free blocks;
the bounded prefix index."""

from __future__ import annotations

import pytest

from cluster.control.router import (
    PrefillLoad,
    PrefixIndex,
    WorkerLoad,
    cached_prefix_tokens,
    expected_prefill_s,
    pick_decode,
    pick_prefill,
)


def test_the_docstring_example():
    loads = [PrefillLoad("prefill-0", 100, 0.010), PrefillLoad("prefill-1", 100, 0.012, cached_tokens=24),
             PrefillLoad("prefill-2", 0, None, has_room=False)]
    assert expected_prefill_s(loads[0], 40, 0.010) == pytest.approx(1.40)
    assert expected_prefill_s(loads[1], 40, 0.012) == pytest.approx(1.392)
    assert pick_prefill(loads, 40).worker_id == "prefill-1"


def test_idle_workers_share_instead_of_tying_to_the_lowest_id():
    # the old rule tied at 0 outstanding tokens and took prefill-0 every time
    loads = [PrefillLoad("prefill-0", 30, 0.01), PrefillLoad("prefill-1", 0, 0.01)]
    assert pick_prefill(loads, 10).worker_id == "prefill-1"
    tie = [PrefillLoad("prefill-1", 0, None), PrefillLoad("prefill-0", 0, None)]
    assert pick_prefill(tie, 10).worker_id == "prefill-0"  # a true tie: lower id


def test_speed_weights_the_queue():
    # twice the queue on a worker three times as fast is still sooner
    loads = [PrefillLoad("slow", 100, 0.03), PrefillLoad("fast", 200, 0.01)]
    assert pick_prefill(loads, 20).worker_id == "fast"


def test_a_noisy_slow_measurement_counts_at_most_twice_the_fastest():
    # measured 5x slower (a sample taken while the host was busy): placed as if 2x slower, so an idle worker still
    # takes the next prompt while the fast one has one queued
    loads = [PrefillLoad("fast", 10, 0.01), PrefillLoad("noisy", 0, 0.05)]
    assert pick_prefill(loads, 10).worker_id == "noisy"  # (0 + 10) * 0.02 <= (10 + 10) * 0.01: a tie, fewer queued
    assert pick_prefill([PrefillLoad("fast", 30, 0.01), PrefillLoad("noisy", 0, 0.05)], 10).worker_id == "noisy"
    assert pick_prefill([PrefillLoad("fast", 5, 0.01), PrefillLoad("noisy", 10, 0.05)], 10).worker_id == "fast"


def test_unmeasured_worker_counts_at_the_mean_speed():
    loads = [PrefillLoad("a", 50, 0.02), PrefillLoad("b", 40, None)]
    assert pick_prefill(loads, 10).worker_id == "b"  # (40 + 10) * 0.02 < (50 + 10) * 0.02


def test_cache_wins_against_a_little_more_queue_but_not_a_lot():
    cached = PrefillLoad("warm", 20, 0.01, cached_tokens=32)
    assert pick_prefill([PrefillLoad("cold", 0, 0.01), cached], 40).worker_id == "warm"
    busy = PrefillLoad("warm", 200, 0.01, cached_tokens=32)
    assert pick_prefill([PrefillLoad("cold", 0, 0.01), busy], 40).worker_id == "cold"


def test_only_workers_with_room_are_picked():
    loads = [PrefillLoad("a", 0, 0.01, cached_tokens=8, has_room=False), PrefillLoad("b", 500, 0.05)]
    assert pick_prefill(loads, 10).worker_id == "b"
    assert pick_prefill([PrefillLoad("a", 9, 0.01, has_room=False)], 10) is None


def test_cached_prefix_counts_leading_blocks_only():
    idx = PrefixIndex(8)
    idx.add([b"h0", b"h1", b"h3"])
    assert cached_prefix_tokens(idx, [b"h0", b"h1", b"h2", b"h3"], 4) == 8
    assert cached_prefix_tokens(idx, [b"x", b"h1"], 4) == 0
    assert cached_prefix_tokens(idx, [], 4) == 0


def test_prefix_index_is_a_bounded_lru():
    idx = PrefixIndex(3)
    idx.add([b"a", b"b", b"c"])
    idx.add([b"a"])  # seen again: most recent
    idx.add([b"d"])
    assert len(idx) == 3 and b"b" not in idx and b"a" in idx and b"d" in idx


def test_decode_goes_to_most_free_blocks_that_fit():
    loads = [WorkerLoad("d0", free_blocks=10), WorkerLoad("d1", free_blocks=30), WorkerLoad("d2", 50, alive=False)]
    assert pick_decode(loads, 5).worker_id == "d1"
    assert pick_decode(loads, 5, exclude=frozenset({"d1"})).worker_id == "d0"
    assert pick_decode(loads, 40) is None
