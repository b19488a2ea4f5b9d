"""Unit tests of the KV block pool's bookkeeping (``engine.block_manager``) and block hashing (``engine.sequence``).

Sequences are driven by hand the way the scheduler and engine drive them: ``lookup_prefix`` -> ``can_allocate`` ->
``allocate_prefix`` -> ``append_slots``, then ``num_computed_tokens += n`` and ``register_computed`` after the step,
``free`` when done.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import MultiModalInput, Sequence

BS = 4
_ids = itertools.count()


def make_seq(tokens: list[int], mm: MultiModalInput | None = None, block_size: int = BS) -> Sequence:
    i = next(_ids)
    return Sequence(seq_id=i, request_id=f"r{i}", token_ids=list(tokens), num_prompt_tokens=len(tokens),
                    params=SamplingParams(), block_size=block_size, mm=mm)


def make_mm(positions: list[int], hashes: list[bytes], tokens_per_image: int) -> MultiModalInput:
    assert len(positions) == len(hashes) * tokens_per_image
    return MultiModalInput(pixel_values=torch.zeros(len(hashes), 3, 2, 2), image_hashes=hashes,
                           positions=np.asarray(positions, dtype=np.int64), tokens_per_image=tokens_per_image)


def admit(bm: BlockManager, seq: Sequence, num_new_tokens: int | None = None) -> list[int]:
    """Admit ``seq`` like the scheduler does (whole remainder in one chunk by default); returns the prefix hits."""
    hits = bm.lookup_prefix(seq)
    n = seq.num_tokens - len(hits) * bm.block_size if num_new_tokens is None else num_new_tokens
    assert bm.can_allocate(seq, hits, n)
    bm.allocate_prefix(seq, hits)
    assert bm.append_slots(seq, n)
    return hits


def compute(bm: BlockManager, seq: Sequence, n: int | None = None) -> None:
    """Mark ``n`` more tokens (default: all) computed and publish full blocks, as the engine does after a step."""
    seq.num_computed_tokens += seq.num_tokens - seq.num_computed_tokens if n is None else n
    bm.register_computed(seq)


def run_and_free(bm: BlockManager, tokens: list[int], mm: MultiModalInput | None = None) -> list[int]:
    """Admit, compute and release a prompt; returns the block table it had."""
    seq = make_seq(tokens, mm)
    admit(bm, seq)
    compute(bm, seq)
    table = list(seq.block_table)
    bm.free(seq)
    return table


def unreferenced_order(bm: BlockManager) -> list[int]:
    return list(bm.unreferenced)


# --------------------------------------------------------------------------------------------------- allocation
def test_allocate_takes_blocks_in_pool_order_with_one_reference():
    bm = BlockManager(8, BS)
    seq = make_seq(list(range(10)))
    assert bm.blocks_needed(seq, 10) == 3
    assert admit(bm, seq) == []
    assert seq.block_table == [0, 1, 2]
    assert [bm.blocks[b].ref_count for b in seq.block_table] == [1, 1, 1]
    assert bm.num_free_blocks == 5
    assert seq.num_computed_tokens == 0  # nothing computed yet: the engine adds after the step


def test_append_slots_grows_only_when_a_block_fills():
    bm = BlockManager(8, BS)
    seq = make_seq(list(range(6)))
    admit(bm, seq)
    compute(bm, seq)
    assert len(seq.block_table) == 2
    for new_len, expected_blocks in [(7, 2), (8, 2), (9, 3)]:
        seq.token_ids.append(100 + new_len)  # a decode step: one sampled token, then its slot
        assert bm.blocks_needed(seq, 1) == expected_blocks - len(seq.block_table)
        assert bm.append_slots(seq, 1)
        compute(bm, seq, 1)
        assert len(seq.block_table) == expected_blocks
        assert seq.num_computed_tokens == new_len
    bm.free(seq)
    bm.check_no_leaks()


def test_append_slots_when_pool_is_short_changes_nothing():
    bm = BlockManager(2, BS)
    seq = make_seq(list(range(12)))
    hits = bm.lookup_prefix(seq)
    assert not bm.can_allocate(seq, hits, 12)
    assert not bm.append_slots(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2
    assert bm.append_slots(seq, 8)  # a chunk that fits
    assert bm.num_free_blocks == 0
    compute(bm, seq, 8)
    assert not bm.append_slots(seq, 4)
    assert len(seq.block_table) == 2
    bm.free(seq)
    bm.check_no_leaks()


# ------------------------------------------------------------------------------------------------ prefix caching
def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(16, BS)
    prompt = list(range(13))
    a = make_seq(prompt)
    admit(bm, a)
    compute(bm, a)
    b = make_seq(prompt)
    hits = admit(bm, b)
    assert hits == a.block_table[:3]
    assert b.block_table[:3] == hits and b.block_table[3] != a.block_table[3]
    assert b.num_computed_tokens == 12 and b.num_registered_blocks == 3
    assert [bm.blocks[x].ref_count for x in hits] == [2, 2, 2]
    bm.free(a)
    assert [bm.blocks[x].ref_count for x in hits] == [1, 1, 1]
    assert all(x not in bm.unreferenced for x in hits)  # still in use by b
    bm.free(b)
    bm.check_no_leaks()


def test_prefix_miss_and_partial_hit():
    bm = BlockManager(16, BS)
    prompt = list(range(13))
    table = run_and_free(bm, prompt)
    assert bm.lookup_prefix(make_seq([99] + prompt[1:])) == []  # first block differs: nothing matches
    second_differs = prompt[:5] + [99] + prompt[6:]
    assert bm.lookup_prefix(make_seq(second_differs)) == table[:1]
    assert bm.lookup_prefix(make_seq(prompt[:8] + [1, 2, 3, 4, 5])) == table[:2]


def test_hash_chain_covers_the_whole_prefix():
    tail = [7, 7, 7, 7]
    x, y = make_seq([1, 2, 3, 4] + tail), make_seq([1, 2, 3, 5] + tail)
    assert x.block_hash(0) != y.block_hash(0)
    assert x.block_hash(1) != y.block_hash(1)  # same tokens in block 1, different history
    z = make_seq([1, 2, 3, 4] + tail + [9])
    assert z.block_hash(0) == x.block_hash(0) and z.block_hash(1) == x.block_hash(1)
    with pytest.raises(AssertionError):
        z.block_hash(2)  # only full blocks have a hash


def test_generated_tokens_extend_the_chain():
    seq = make_seq([1, 2, 3, 4, 5, 6])
    with pytest.raises(AssertionError):
        seq.block_hash(1)
    seq.token_ids += [7, 8]
    assert seq.block_hash(1) == make_seq([1, 2, 3, 4, 5, 6, 7, 8]).block_hash(1)


IMG = 255


def test_image_content_hash_changes_block_hash_with_identical_token_ids():
    # Blocks: [0-3] text, [4-7] text + image tokens at 6, 7, [8-11] image token at 8 + text, [12-15] text.
    tokens = [1, 2, 3, 4, 5, 6, IMG, IMG, IMG, 9, 10, 11, 12, 13, 14, 15]
    positions = [6, 7, 8]
    cat, cat2 = (make_seq(tokens, make_mm(positions, [b"cat" * 6], 3)) for _ in range(2))
    dog = make_seq(tokens, make_mm(positions, [b"dog" * 6], 3))
    text_only = make_seq(tokens)
    assert cat.block_hash(0) == dog.block_hash(0) == text_only.block_hash(0)  # before the image
    for i in (1, 2, 3):  # the image's blocks and everything after them
        assert cat.block_hash(i) != dog.block_hash(i)
        assert cat.block_hash(i) != text_only.block_hash(i)
        assert cat.block_hash(i) == cat2.block_hash(i)


def test_image_order_matters_in_the_hash():
    tokens = [1, IMG, IMG, 2, IMG, IMG, 3, 4]
    ab = make_seq(tokens, make_mm([1, 2, 4, 5], [b"a" * 16, b"b" * 16], 2))
    ba = make_seq(tokens, make_mm([1, 2, 4, 5], [b"b" * 16, b"a" * 16], 2))
    assert ab.block_hash(0) != ba.block_hash(0)


def test_prefix_lookup_stops_at_a_different_image():
    bm = BlockManager(16, BS)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, IMG, IMG, IMG, 9, 10, 11, 12, 13, 14]
    positions = [8, 9, 10]
    table = run_and_free(bm, tokens, make_mm(positions, [b"x" * 16], 3))
    assert bm.lookup_prefix(make_seq(tokens, make_mm(positions, [b"y" * 16], 3))) == table[:2]
    assert bm.lookup_prefix(make_seq(tokens, make_mm(positions, [b"x" * 16], 3))) == table[:4]


def test_at_least_one_token_is_left_to_compute():
    bm = BlockManager(16, BS)
    prompt = list(range(8))
    table = run_and_free(bm, prompt)
    b = make_seq(prompt)  # fully cached, but the last token must run to produce logits
    hits = admit(bm, b)
    assert hits == table[:1] and b.num_computed_tokens == 4
    assert bm.lookup_prefix(make_seq(prompt[:1])) == []
    bm.free(b)
    bm.check_no_leaks()


def test_only_computed_blocks_are_registered():
    bm = BlockManager(16, BS)
    prompt = list(range(12))
    a = make_seq(prompt)
    admit(bm, a)
    assert bm.hash_to_block == {}  # allocated, nothing computed
    compute(bm, a, 5)  # first chunk: block 0 full, block 1 partial
    assert list(bm.hash_to_block.values()) == a.block_table[:1]
    assert bm.lookup_prefix(make_seq(prompt + [50])) == a.block_table[:1]
    compute(bm, a, 7)
    assert sorted(bm.hash_to_block.values()) == sorted(a.block_table)
    assert bm.lookup_prefix(make_seq(prompt + [50])) == a.block_table
    bm.free(a)
    bm.check_no_leaks()


def test_duplicate_content_keeps_one_cached_copy():
    bm = BlockManager(8, BS)
    prompt = list(range(9))
    a, b = make_seq(prompt), make_seq(prompt)
    admit(bm, a)
    admit(bm, b)  # admitted before a's KV exists: no hit, own blocks
    assert set(a.block_table).isdisjoint(b.block_table)
    compute(bm, a)
    compute(bm, b)
    a_full, b_full = a.block_table[:2], b.block_table[:2]
    assert sorted(bm.hash_to_block.values()) == sorted(a_full)  # one block per hash: the first one computed
    assert all(bm.blocks[x].hash is None for x in b_full)
    bm.free(b)
    bm.free(a)
    order = unreferenced_order(bm)
    assert order[-2:] == a_full[::-1]  # only a's full blocks are cached, at the back in release order
    assert all(bm.blocks[x].hash is None for x in order[:-2])
    bm.check_no_leaks()


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    prompt = list(range(9))
    run_and_free(bm, prompt)
    assert bm.hash_to_block == {}
    assert bm.lookup_prefix(make_seq(prompt)) == []


def test_can_allocate_counts_cached_hits_taken_off_the_free_queue():
    bm = BlockManager(3, 2)
    a = make_seq([1, 2, 3, 4], block_size=2)
    admit(bm, a)
    compute(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 3
    fits = make_seq([1, 2, 3, 4, 5], block_size=2)
    hits = bm.lookup_prefix(fits)
    assert len(hits) == 2 and bm.can_allocate(fits, hits, 1)
    too_long = make_seq([1, 2, 3, 4, 5, 6, 7], block_size=2)
    hits = bm.lookup_prefix(too_long)
    assert len(hits) == 2 and not bm.can_allocate(too_long, hits, 3)  # 2 hits + 2 new blocks > 3


# ------------------------------------------------------------------------------------------------------ eviction
def test_free_blocks_are_used_before_cached_ones():
    bm = BlockManager(6, BS)
    assert run_and_free(bm, list(range(8))) == [0, 1]  # blocks 0, 1 cached
    assert sorted(bm.hash_to_block.values()) == [0, 1]
    assert unreferenced_order(bm) == [2, 3, 4, 5, 1, 0]  # free first; cached in release order (tail first)
    b = make_seq(list(range(100, 116)))  # needs 4 blocks: all the never-cached ones
    admit(bm, b)
    assert b.block_table == [2, 3, 4, 5]
    assert sorted(bm.hash_to_block.values()) == [0, 1]
    c = make_seq(list(range(200, 204)))  # one more: evicts a's tail block, released first
    admit(bm, c)
    assert c.block_table == [1]
    assert bm.blocks[1].hash is None and list(bm.hash_to_block.values()) == [0]
    assert bm.lookup_prefix(make_seq(list(range(9)))) == [0]  # a's head survives
    bm.free(b)
    bm.free(c)
    bm.check_no_leaks()


def test_least_recently_released_cached_block_is_evicted_first():
    bm = BlockManager(4, BS)
    run_and_free(bm, list(range(4)) + [0])  # block 0 full and cached, block 1 partial (free again)
    run_and_free(bm, list(range(10, 14)) + [0])
    a_block, b_block = bm.lookup_prefix(make_seq(list(range(4)) + [0]))[0], bm.lookup_prefix(
        make_seq(list(range(10, 14)) + [0]))[0]
    assert a_block != b_block
    cached = [x for x in unreferenced_order(bm) if bm.blocks[x].hash is not None]
    assert cached == [a_block, b_block]  # release order
    # touching a's block (a hit) and releasing it again makes it the most recent
    again = make_seq(list(range(4)) + [0])
    admit(bm, again)
    bm.free(again)
    cached = [x for x in unreferenced_order(bm) if bm.blocks[x].hash is not None]
    assert cached == [b_block, a_block]
    filler = make_seq(list(range(50, 62)))  # 3 blocks: 2 free ones, then evicts b's block
    admit(bm, filler)
    assert b_block in filler.block_table and a_block not in filler.block_table
    assert bm.lookup_prefix(make_seq(list(range(10, 14)) + [0])) == []
    assert bm.lookup_prefix(make_seq(list(range(4)) + [0])) == [a_block]
    bm.free(filler)
    bm.check_no_leaks()


def test_a_partial_block_released_later_is_still_used_before_cached_blocks():
    bm = BlockManager(3, BS)
    a = make_seq(list(range(6)))  # block 0 full (cached on release), block 1 partial
    admit(bm, a)
    compute(bm, a)
    full, partial = a.block_table
    bm.free(a)
    order = unreferenced_order(bm)
    assert order[0] == partial and order[-1] == full


def test_reused_cached_block_leaves_the_free_queue():
    bm = BlockManager(4, BS)
    run_and_free(bm, list(range(8)))
    assert bm.num_free_blocks == 4
    b = make_seq(list(range(9)))
    hits = admit(bm, b)
    assert len(hits) == 2 and all(h not in bm.unreferenced for h in hits)
    assert bm.num_free_blocks == 1  # 2 hits + 1 new block
    bm.free(b)
    bm.check_no_leaks()


# ------------------------------------------------------------------------------------------------- leaks / frees
def test_double_free_asserts():
    bm = BlockManager(4, BS)
    seq = make_seq(list(range(6)))
    admit(bm, seq)
    table = list(seq.block_table)
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    seq.block_table = table  # a stale block table released twice
    with pytest.raises(AssertionError, match="double free"):
        bm.free(seq)


def test_free_resets_the_sequence_for_recompute():
    bm = BlockManager(8, BS)
    seq = make_seq(list(range(10)))
    admit(bm, seq)
    compute(bm, seq)
    bm.free(seq)  # preemption
    assert (seq.block_table, seq.num_computed_tokens, seq.num_registered_blocks) == ([], 0, 0)
    hits = admit(bm, seq)  # recompute: its own computed blocks are hits
    assert len(hits) == 2 and seq.num_computed_tokens == 8
    bm.free(seq)
    bm.check_no_leaks()


def test_check_no_leaks():
    bm = BlockManager(4, BS)
    bm.check_no_leaks()
    seq = make_seq(list(range(9)))
    admit(bm, seq)
    with pytest.raises(AssertionError, match="still referenced"):
        bm.check_no_leaks()
    compute(bm, seq)
    bm.free(seq)
    bm.check_no_leaks()  # cached blocks are not leaks
    assert bm.hash_to_block
