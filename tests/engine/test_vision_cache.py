"""The vision cache (engine.vision_cache): bounded by bytes and entries, least recently used out, entries owning
their memory; and the engine's use of it: an image over the whole bound is encoded for its request and not kept."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.config import EngineConfig
from engine.vision_cache import VisionCache
from tests.conftest import assert_no_leaked_blocks
from tests.engine.test_qwen_vl import ENGINE, SIZES, build_prompt, greedy, hf_dir, ckpts, image, request  # noqa: F401


def rows(n: int, hidden: int = 8, levels: int | None = None, fill: float = 1.0):
    feats = torch.full((n, hidden), fill)
    return feats, None if levels is None else torch.full((levels, n, hidden), fill)


def test_bounded_by_bytes_least_recently_used_out():
    cache = VisionCache(capacity_bytes=3 * 10 * 8 * 4, max_entries=10)  # three 10-row float32 images
    for h in (b"a", b"b", b"c"):
        cache.put(h, *rows(10))
    assert len(cache) == 3 and cache.nbytes == 3 * 320
    assert cache.get(b"a") is not None  # a is now the most recent: b goes first
    cache.put(b"d", *rows(10))
    assert b"b" not in cache and {b"a", b"c", b"d"} == {h for h in (b"a", b"b", b"c", b"d") if h in cache}
    assert cache.evictions == 1 and cache.nbytes == 3 * 320
    big = cache.put(b"e", *rows(15))  # the two least recently used must go for it
    assert [h in cache for h in (b"a", b"c", b"d", b"e")] == [False, False, True, True]
    assert cache.nbytes == 320 + big.nbytes == 320 + 15 * 32 and cache.evictions == 3


def test_deepstack_levels_count_and_entry_limits():
    cache = VisionCache(capacity_bytes=10**6, max_entries=2)
    e = cache.put(b"a", *rows(4, levels=3))
    assert e.nbytes == 4 * 8 * 4 * (1 + 3)
    cache.put(b"b", *rows(4))
    cache.put(b"c", *rows(4))
    assert len(cache) == 2 and b"a" not in cache
    cache.put(b"c", *rows(6))  # replacing an entry recounts its bytes
    assert cache.nbytes == (4 + 6) * 32
    assert cache.clear() == 2 and cache.nbytes == 0 and len(cache) == 0


def test_an_entry_over_the_whole_bound_is_returned_not_kept():
    cache = VisionCache(capacity_bytes=100, max_entries=8)
    cache.put(b"small", *rows(2))
    e = cache.put(b"huge", *rows(100))
    assert e.features.shape == (100, 8) and b"huge" not in cache and b"small" in cache and cache.evictions == 0
    off = VisionCache(capacity_bytes=10**6, max_entries=0)
    assert off.put(b"x", *rows(2)).features.shape == (2, 8) and len(off) == 0


def test_an_entry_owns_its_memory():
    """A slice of one tower call's output is copied out: the cached image does not keep the whole batch alive."""
    out = torch.arange(1000.0).reshape(100, 10)
    e = VisionCache(10**6, 8).put(b"a", out[10:14])
    assert torch.equal(e.features, out[10:14])
    assert e.features.untyped_storage().nbytes() == 4 * 10 * 4


def test_config_bounds():
    assert EngineConfig(kv_cache_memory_gb=2.0).vision_cache_bytes == int(2 * 1024 * 0.1 * 2**20)
    assert EngineConfig(vision_cache_mb=16).vision_cache_bytes == 16 * 2**20
    for bad in ({"vision_cache_mb": -1}, {"vision_cache_size": -1}):
        with pytest.raises(ValueError, match="vision_cache"):
            EngineConfig(**bad)


def test_an_image_over_the_bound_is_encoded_for_its_request_and_not_kept(hf_dir):  # noqa: F811
    big, small = image(21, SIZES["150x170"]), image(22, SIZES["33x47"])
    ids = build_prompt([big], hf_dir)
    ref = LLM(hf_dir, **ENGINE).generate([request(ids, [big])], greedy(3))[0].outputs[0].token_ids
    # room for the small image's features (a few rows) but not the big one's
    llm = LLM(hf_dir, **ENGINE, vision_cache_mb=0.004)
    out = llm.generate([request(ids, [big])], greedy(3))[0].outputs[0].token_ids
    assert out == ref and len(llm.engine.runner.vision_cache) == 0
    llm.generate([request(build_prompt([small], hf_dir), [small])], greedy(1))
    cache = llm.engine.runner.vision_cache
    assert len(cache) == 1 and 0 < cache.nbytes <= 0.004 * 2**20
    assert llm.engine.kv_memory().vision_cache_bytes == cache.nbytes
    assert_no_leaked_blocks(llm)


# -- cached features in lent KV blocks (one budget with KV) ------------------------------------------------------

def small_pool(num_blocks: int = 8, layers: int = 2, block_size: int = 4, dtype=torch.float32):
    from engine.block_manager import BlockManager
    from engine.vision_cache import PoolStore

    shape = (num_blocks, block_size, 2, 4)  # 2 KV heads of 4: 32 values per tensor per block
    pool = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(layers)]
    bm = BlockManager(num_blocks, block_size)
    return pool, bm, PoolStore(pool, bm)


def test_entries_round_trip_through_lent_blocks_exactly():
    pool, bm, store = small_pool()
    assert store.block_bytes == 2 * 2 * 4 * 2 * 4 * 4  # 2 layers x K,V x 32 float32 values
    cache = VisionCache(10**6, 8, store)
    gen = torch.Generator().manual_seed(0)
    feats, deep = torch.randn(5, 24, generator=gen), torch.randn(2, 5, 24, generator=gen)  # 1440 B: 3 blocks
    cache.put(b"a", feats, deep)
    half = torch.randn(7, 8, generator=gen).to(torch.bfloat16)
    cache.put(b"b", half)
    assert bm.num_lent == 3 + 1 and bm.num_free_blocks == 4 and cache.nbytes == 4 * store.block_bytes
    bm.reclaim = cache.reclaim  # reclaimable: lent blocks count as free
    assert bm.num_free_blocks == 8
    a, b = cache.get(b"a"), cache.get(b"b")
    assert torch.equal(a.features, feats) and torch.equal(a.deepstack, deep) and a.features.dtype == torch.float32
    assert torch.equal(b.features, half) and b.deepstack is None and b.features.dtype == torch.bfloat16
    assert cache.clear() == 2 and bm.num_lent == 0
    bm.check_no_leaks()


def test_kv_takes_lent_blocks_back_before_evicting_prefix_blocks():
    from tests.engine.test_block_manager import admit, make_seq

    pool, bm, store = small_pool(num_blocks=4)
    cache = VisionCache(10**6, 8, store)
    bm.reclaim = cache.reclaim
    cached = make_seq(list(range(8)))  # two full blocks, then registered: a prefix cache entry
    admit(bm, cached)
    cached.num_computed_tokens = 8
    bm.register_computed(cached)
    bm.free(cached)
    cache.put(b"old", torch.ones(2, 8))  # 64 B: one 512-byte block each
    cache.put(b"new", torch.ones(2, 8))
    assert bm.num_lent == 2 and bm.num_free_blocks == 4
    seq = make_seq([100, 101, 102, 103, 104])  # needs 2 blocks: both come from the vision cache, oldest first
    admit(bm, seq)
    assert b"old" not in cache and b"new" not in cache and cache.evictions == 2 and bm.num_lent == 0
    again = make_seq(list(range(8)) + [9])
    assert len(bm.lookup_prefix(again)) == 2  # the prefix blocks survived
    bm.free(seq)
    bm.check_no_leaks()


def test_a_full_pool_makes_room_from_the_cache_itself_or_keeps_nothing():
    from tests.engine.test_block_manager import admit, make_seq

    pool, bm, store = small_pool(num_blocks=3)
    cache = VisionCache(10**6, 8, store)
    bm.reclaim = cache.reclaim
    cache.put(b"a", torch.ones(2, 8))
    cache.put(b"b", torch.ones(2, 8))
    running = make_seq([1, 2, 3, 4])
    admit(bm, running)  # the one free block
    e = cache.put(b"c", torch.full((2, 8), 3.0))  # no free block: its own oldest entry makes room
    assert b"a" not in cache and b"c" in cache and torch.equal(cache.get(b"c").features, e.features)
    big = cache.put(b"d", torch.ones(20, 8))  # 640 B, 2 blocks of 512: both entries give theirs back
    assert b"d" in cache and len(cache) == 1 and torch.equal(cache.get(b"d").features, big.features)
    bm.free(running)
    admit(bm, make_seq(list(range(12))))  # KV takes the whole pool back
    assert len(cache) == 0 and bm.num_lent == 0
    assert cache.put(b"e", torch.ones(2, 8)).features.shape == (2, 8) and len(cache) == 0  # nothing to lend


def test_engine_cache_lives_in_the_pool_and_yields_it_to_kv(hf_dir):  # noqa: F811
    im = image(31, SIZES["100x61"])
    llm = LLM(hf_dir, **ENGINE)
    bm, cache = llm.engine.block_manager, llm.engine.runner.vision_cache
    ids = build_prompt([im], hf_dir)
    first = llm.generate([request(ids, [im])], greedy(3))[0].outputs[0].token_ids
    assert len(cache) == 1 and bm.num_lent > 0 and cache.nbytes == bm.num_lent * cache.store.block_bytes
    assert llm.engine.kv_memory().vision_cache_bytes == cache.nbytes
    free_before = bm.num_free_blocks
    # two text prompts that need every block of the pool together: the cached image gives its blocks back
    n = bm.num_blocks * 4 // 2  # 48 blocks each (one token is sampled in the prefill step: no decode block)
    llm.generate([{"prompt_token_ids": [5 + (i * (k + 1)) % 50 for i in range(n)]} for k in range(2)], greedy(1))
    assert len(cache) == 0 and bm.num_lent == 0 and bm.num_free_blocks == free_before
    calls = []
    hook = llm.engine.model.vision.register_forward_hook(lambda *a: calls.append(1))
    try:
        again = llm.generate([request(ids, [im])], greedy(3))[0].outputs[0].token_ids
    finally:
        hook.remove()
    assert again == first and calls == [1]  # encoded again, the same answer
    assert_no_leaked_blocks(llm)


def test_a_sliced_encoding_keeps_the_images_that_were_cached_when_it_started(hf_dir):  # noqa: F811
    """The vision stage takes a prompt's cached images when its tower job starts: KV reclaiming the cache's blocks
    while the job runs in slices does not send them to the tower again, and the answer is the whole-call engine's."""
    old, new = image(41, SIZES["47x133"]), image(42, SIZES["100x61"])
    ids = build_prompt([old, new], hf_dir, seed=4)
    want = LLM(hf_dir, **ENGINE).generate([request(ids, [old, new])], greedy(3))[0].outputs[0].token_ids
    llm = LLM(hf_dir, **ENGINE, vision_slice_s=1e-6)
    eng = llm.engine
    llm.generate([request(build_prompt([old], hf_dir), [old])], greedy(1))  # `old` is cached now
    encoded = []
    hook = eng.model.vision.register_forward_hook(lambda *a: encoded.append(1))
    starts = []
    start = eng.model.vision.start
    eng.model.vision.start = lambda *a, **k: starts.append(int(a[1].shape[0])) or start(*a, **k)
    try:
        eng.add_request("both", request(ids, [old, new]), greedy(3))
        eng.step()  # the job starts (one slice)
        assert eng.encoding.jobs and len(eng.runner.vision_cache) == 1
        eng.runner.vision_cache.clear()  # as when KV takes the blocks back
        outs = []
        while eng.has_unfinished_requests():
            outs += [o for o in eng.step() if o.finished]
    finally:
        hook.remove()
        del eng.model.vision.start
    assert starts == [1] and encoded == []  # one tower job, for the new image only; no whole call after it
    assert outs[0].outputs[0].token_ids == want
    assert_no_leaked_blocks(llm)
