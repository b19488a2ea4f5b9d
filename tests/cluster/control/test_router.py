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


def test_a_cached_image_spares_its_tower_work_where_it_is_cached():
    # 4 images of 12 tokens weighing 10 text tokens each (vision tower): 51 tokens -> 483 equivalents; the holder has
    # the first 48 tokens cached. Without the spared tower work a noisy 1.5x slower holder lost the prompt:
    # (483 - 48) * 0.015 > 483 * 0.01
    holder = PrefillLoad("holder", 0, 0.015, cached_tokens=48)
    assert pick_prefill([PrefillLoad("other", 0, 0.01), holder], 483).worker_id == "other"
    spared = PrefillLoad("holder", 0, 0.015, cached_tokens=48, cached_extra=9 * 48)
    assert expected_prefill_s(spared, 483, 0.015) == pytest.approx(3 * 0.015)
    assert pick_prefill([PrefillLoad("other", 0, 0.01), spared], 483).worker_id == "holder"
    with pytest.raises(AssertionError):  # never more spared than the prompt holds
        expected_prefill_s(PrefillLoad("x", 0, 0.01, cached_tokens=48, cached_extra=435), 483, 0.01)


def test_only_workers_with_room_are_picked():
    loads = [PrefillLoad("a", 0, 0.01, cached_tokens=8, has_room=False), PrefillLoad("b", 500, 0.05)]
    assert pick_prefill(loads, 10).worker_id == "b"
    assert pick_prefill([PrefillLoad("a", 9, 0.01, has_room=False)], 10) is None


def test_cached_prefix_counts_leading_blocks_only():
    idx = PrefixIndex(8)
    idx.update(1, [b"h0", b"h1", b"h3"], [])
    assert cached_prefix_tokens(idx, [b"h0", b"h1", b"h2", b"h3"], 4) == 8
    assert cached_prefix_tokens(idx, [b"x", b"h1"], 4) == 0
    assert cached_prefix_tokens(idx, [], 4) == 0


def test_prefix_index_is_a_bounded_lru():
    idx = PrefixIndex(3)
    idx.update(1, [b"a", b"b", b"c"], [])
    idx.update(2, [b"a"], [])  # seen again: most recent
    idx.add_predicted([b"d"], since=2)
    assert len(idx) == 3 and b"b" not in idx and b"a" in idx and b"d" in idx


def test_decode_goes_to_most_free_blocks_that_fit():
    loads = [WorkerLoad("d0", free_blocks=10), WorkerLoad("d1", free_blocks=30), WorkerLoad("d2", 50, alive=False)]
    assert pick_decode(loads, 5).worker_id == "d1"
    assert pick_decode(loads, 5, exclude=frozenset({"d1"})).worker_id == "d0"
    assert pick_decode(loads, 40) is None


def test_prefix_index_forgets_evicted_blocks_the_docstring_example():
    idx = PrefixIndex(2)
    idx.update(1, [b"a", b"b"], [])
    idx.update(3, [], [b"a"])
    assert b"a" not in idx and cached_prefix_tokens(idx, [b"a", b"b"], 4) == 0  # a's holder no longer attracts it
    idx.update(2, [b"a", b"c"], [])  # late: a's eviction in report 3 is newer
    assert b"a" not in idx and b"b" in idx and b"c" in idx
    idx.update(4, [], [b"b"])
    idx.add_predicted([b"b", b"d"], since=3)  # b was evicted after that request's submit: not added back
    assert list(idx._hashes) == [b"c", b"d"]


def test_a_prediction_yields_to_a_later_eviction_not_an_earlier_one():
    idx = PrefixIndex(8)
    idx.add_predicted([b"p"], since=5)
    idx.update(5, [], [b"p"])  # the same report as the submit reply: before the request's own prefill
    assert b"p" in idx
    idx.update(6, [], [b"p"])  # after it: gone
    assert b"p" not in idx
    idx.update(7, [b"p"], [])  # registered again
    assert b"p" in idx


def test_prefix_index_memory_is_bounded_under_churn():
    idx = PrefixIndex(16)
    for seq in range(1, 200):
        idx.update(seq, [seq.to_bytes(4, "big")], [(seq - 1).to_bytes(4, "big"), (seq + 10_000).to_bytes(4, "big")])
    assert len(idx) <= 16 and len(idx._evicted) <= 16
    assert (199).to_bytes(4, "big") in idx and (198).to_bytes(4, "big") not in idx


def test_a_hybrid_workers_hit_ends_at_its_last_snapshot():
    """Hybrid models: the run of held blocks is cut back to the last block with a GDN state snapshot (``ends``); no
    snapshot in the run, no hit."""
    idx, ends = PrefixIndex(), PrefixIndex()
    idx.update(1, [b"h0", b"h1", b"h2", b"h3"], [])
    ends.update(1, [b"h1", b"h3"], [])
    assert cached_prefix_tokens(idx, [b"h0", b"h1", b"h2", b"h3"], 4, ends) == 16
    assert cached_prefix_tokens(idx, [b"h0", b"h1", b"h2", b"y"], 4, ends) == 8  # h2 has none: back to h1
    ends.update(2, [], [b"h1"])
    assert cached_prefix_tokens(idx, [b"h0", b"h1", b"h2", b"y"], 4, ends) == 0
    assert cached_prefix_tokens(idx, [b"h0", b"h1", b"h2", b"y"], 4) == 12  # without ends: every held block
