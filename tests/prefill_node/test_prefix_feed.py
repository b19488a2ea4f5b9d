"""The prefill worker's prefix-cache feed (:mod:`prefill_node.prefix_feed`): what it registered and evicted since its
last report, each hash once with its latest state, numbered, bounded; fed by the block manager's eviction hook."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from prefill_node.prefix_feed import PrefixFeed


def test_a_report_has_each_hash_once_with_its_latest_state():
    feed = PrefixFeed()
    feed.registered([b"a", b"b"])
    feed.evicted(b"a")
    feed.registered([b"c"])
    feed.evicted(b"c")
    feed.registered([b"c"])  # evicted and registered again: registered
    assert feed.take() == {"prefix_seq": 1, "registered": [b"b", b"c"], "evicted": [b"a"]}
    assert feed.take() == {"prefix_seq": 2, "registered": [], "evicted": []}


def test_the_feed_is_bounded():
    feed = PrefixFeed(capacity=3)
    feed.registered(bytes([i]) for i in range(10))
    assert feed.take()["registered"] == [bytes([7]), bytes([8]), bytes([9])]


def test_the_block_manager_reports_each_evicted_cached_block():
    feed = PrefixFeed()
    bm = BlockManager(num_blocks=2, block_size=4, on_evict=feed.evicted)
    seq = Sequence(0, "a", list(range(9)), 9, SamplingParams(), 4)
    assert bm.append_slots(seq, 8)
    seq.num_computed_tokens = 8
    bm.register_computed(seq)
    cached = [seq.block_hash(0), seq.block_hash(1)]
    bm.free(seq)
    assert feed.take()["evicted"] == []  # cached, not evicted
    other = Sequence(1, "b", [50, 51, 52, 53, 54], 5, SamplingParams(), 4)
    assert bm.append_slots(other, 4)  # reuses the least recently used cached block: the tail's (freed tail first)
    assert feed.take()["evicted"] == [cached[1]]
    assert len(bm.lookup_prefix(Sequence(2, "c", list(range(9)), 9, SamplingParams(), 4))) == 1  # the head stays


def test_a_hybrid_workers_feed_reports_where_hits_end():
    """A hybrid model's worker also says which blocks it keeps a GDN state snapshot after (a hit ends only there),
    and which snapshots its block manager dropped (least recently used, or with their block)."""
    feed = PrefixFeed()
    feed.registered([b"a"])
    assert "ends_registered" not in feed.take()  # not hybrid: the report is as before
    feed.hybrid = True
    feed.registered([b"a", b"b", b"c"])
    feed.ends_registered([b"c"])
    feed.ends_dropped(b"x")
    assert feed.take() == {"prefix_seq": 2, "registered": [b"a", b"b", b"c"], "evicted": [],
                           "ends_registered": [b"c"], "ends_dropped": [b"x"]}

    bm = BlockManager(4, 2, num_state_slots=1, num_snapshots=1, on_snapshot_drop=feed.ends_dropped,
                      on_evict=feed.evicted)
    seqs = [Sequence(i, str(i), [10 * i, 10 * i + 1, 10 * i + 2], 3, SamplingParams(), 2) for i in range(2)]
    for seq in seqs:  # one snapshot slot: the second prompt's snapshot takes it from the first's
        bm.allocate_prefix(seq, bm.lookup_prefix(seq))
        assert bm.append_slots(seq, 3)
        bm.plan_snapshots(seq, 3)
        seq.num_computed_tokens = 3
        bm.register_computed(seq)
        bm.free(seq)
    assert bm.snapshots.holds(seqs[1].block_hash(0)) and not bm.snapshots.holds(seqs[0].block_hash(0))
    assert feed.take()["ends_dropped"] == [seqs[0].block_hash(0)]
