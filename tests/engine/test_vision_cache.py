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
