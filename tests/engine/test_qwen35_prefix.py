"""Prefix caching for Qwen3.5 hybrid models (GDN state snapshots, :class:`engine.state_cache.Snapshots`) against
transformers on tiny random checkpoints built here.

The same prompt twice in one engine gives transformers' greedy tokens (and logits within tolerance) both times, and
the second run reports every block a repeat can hit as cached: one image, two images of different sizes, 300 tokens
of text, both key layouts. Also: a shared prefix with a different tail resumes from the periodic snapshot; chunked
prefill whose chunks cross snapshot points; ``n > 1`` choices of a hit; a pool small enough that blocks (and their
snapshots) are evicted; abort with snapshots planned; nothing leaked (blocks, state slots, snapshot pins).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.block_manager import snapshot_points
from engine.sequence import Sequence
from engine.state_cache import Snapshots
from duet_testing.qwen35_checkpoints import Qwen35TinySpec, load_qwen35_reference, make_tiny_qwen35_checkpoint
from tests.conftest import assert_no_leaked_blocks
from tests.engine.test_qwen_vl import SIZES, assert_matches, build_prompt, greedy, image, reference_generate, request

SPEC = Qwen35TinySpec()
BS = 4
ENGINE = dict(dtype="float32", num_kv_blocks=256, block_size=BS, max_num_seqs=8, max_model_len=512)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``models(layout)``: (checkpoint, transformers reference) for ``published`` or ``fused`` (sharded) keys."""
    made: dict[str, tuple[Path, object]] = {}

    def get(layout: str):
        if layout not in made:
            extra = {} if layout == "published" else dict(layout="fused", sharded=True)
            path = make_tiny_qwen35_checkpoint(tmp_path_factory.mktemp(f"q35p-{layout}") / "ckpt",
                                               dataclasses.replace(SPEC, **extra))
            made[layout] = (path, load_qwen35_reference(path))
        return made[layout]

    return get


def hittable(n: int) -> int:
    """Prompt tokens a repeat of an ``n``-token prompt can take from the cache (the last token is always computed)."""
    return (n - 1) // BS * BS


CASES = {"one-image": ([("100x61", 0)], 5), "two-sizes": ([("47x133", 2), ("150x170", 3)], 5), "text-300": ([], 300)}


@pytest.mark.parametrize("layout", ["published", "fused"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_repeated_prompt_hits_and_matches_transformers(models, case, layout):
    path, ref = models(layout)
    shapes, text = CASES[case]
    images = [image(seed, SIZES[name]) for name, seed in shapes]
    ids = build_prompt(images, path, seed=len(case), text=text)
    want = reference_generate(ref, path, ids, images, 6)
    llm = LLM(path, **ENGINE)
    first = llm.generate([request(ids, images)], greedy())[0]
    second = llm.generate([request(ids, images)], greedy())[0]
    assert first.num_cached_tokens == 0
    assert_matches(first, *want)
    assert_matches(second, *want)
    assert second.num_cached_tokens == hittable(len(ids)) >= len(ids) - 2 * BS, (second.num_cached_tokens, len(ids))
    assert llm.engine.block_manager.snapshots.num_filed > 0
    assert_no_leaked_blocks(llm)


def test_a_shared_prefix_resumes_from_the_periodic_snapshot(models):
    """Two prompts share their first 70 tokens: the second resumes from the last periodic snapshot inside the shared
    part (every 4 blocks = 16 tokens here) and still gives transformers' tokens."""
    path, ref = models("published")
    head = build_prompt([], path, seed=1, text=70)[:-1]  # without <|im_end|>
    tails = [build_prompt([], path, seed=s, text=20)[1:] for s in (2, 3)]
    prompts = [head + t for t in tails]
    llm = LLM(path, **ENGINE, state_snapshot_every_blocks=4)
    outs = [llm.generate([request(p, [])], greedy(4))[0] for p in prompts]
    assert outs[1].num_cached_tokens == len(head) // 16 * 16 > 0  # the last multiple of 16 within the shared head
    for out, p in zip(outs, prompts, strict=True):
        assert_matches(out, *reference_generate(ref, path, p, [], 4))
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("budget", [7, 13])
def test_chunks_that_cross_snapshot_points(models, budget):
    """A small token budget: prefill chunks end off the snapshot points, so a chunk writes a snapshot part-way
    through (the GDN span split there) -- both runs still match, and the repeat hits."""
    path, ref = models("published")
    images = [image(4, SIZES["150x170"]), image(5, SIZES["47x133"])]
    ids = build_prompt(images, path, seed=9, text=40)
    want = reference_generate(ref, path, ids, images, 5)
    llm = LLM(path, **{**ENGINE, "max_num_batched_tokens": budget}, state_snapshot_every_blocks=3)
    for run in range(2):
        out = llm.generate([request(ids, images)], greedy(5))[0]
        assert_matches(out, *want)
        assert out.num_cached_tokens == (hittable(len(ids)) if run else 0)
    assert_no_leaked_blocks(llm)


def test_choices_of_a_hit_each_get_the_restored_state(models):
    path, ref = models("published")
    ids = build_prompt([image(6, SIZES["100x61"])], path, seed=4, text=9)
    images = [image(6, SIZES["100x61"])]
    want_tokens, _ = reference_generate(ref, path, ids, images, 5)
    llm = LLM(path, **ENGINE)
    llm.generate([request(ids, images)], greedy(2))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, n=3)
    out = llm.generate([request(ids, images)], params)[0]
    assert out.num_cached_tokens == hittable(len(ids))
    assert [c.token_ids for c in out.outputs] == [want_tokens] * 3
    assert_no_leaked_blocks(llm)


def test_evicted_blocks_take_their_snapshots_with_them(models):
    """A pool of 40 blocks: each new 100-token prompt evicts the previous one's blocks, and its snapshots go with them;
    the first prompt again is computed cold (no hit on a block whose snapshot is gone, nor on a snapshot whose blocks
    are gone) and is still right."""
    path, ref = models("published")
    prompts = [build_prompt([], path, seed=40 + i, text=100) for i in range(3)]
    llm = LLM(path, **{**ENGINE, "num_kv_blocks": 40, "max_model_len": 160})
    outs = [llm.generate([request(p, [])], greedy(3))[0] for p in [*prompts, prompts[0]]]
    assert outs[-1].num_cached_tokens == 0
    assert_matches(outs[-1], *reference_generate(ref, path, prompts[0], [], 3))
    snaps = llm.engine.block_manager.snapshots
    bm = llm.engine.block_manager
    assert all(h in bm.hash_to_block for h in snaps._filed), "a snapshot outlived its block"
    assert_no_leaked_blocks(llm)


def test_too_few_snapshot_slots_and_none(models):
    """One snapshot slot: the newest prompt's last one wins (least recently used dropped), hits stay right.
    ``state_snapshots=0``: no prefix cache, and the reason says why."""
    path, ref = models("published")
    prompts = [build_prompt([], path, seed=60 + i, text=30) for i in range(2)]
    llm = LLM(path, **ENGINE, state_snapshots=1)
    for p in prompts:
        llm.generate([request(p, [])], greedy(2))
    again = [llm.generate([request(p, [])], greedy(3))[0] for p in reversed(prompts)]
    assert again[0].num_cached_tokens == hittable(len(prompts[1])) and again[1].num_cached_tokens == 0
    for out, p in zip(again, reversed(prompts), strict=True):
        assert_matches(out, *reference_generate(ref, path, p, [], 3))
    assert_no_leaked_blocks(llm)
    off = LLM(path, **ENGINE, state_snapshots=0).engine
    assert "state_snapshots=0" in off.prefix_caching_off_reason and not off.block_manager.enable_prefix_caching


def test_abort_with_snapshots_planned_frees_everything(models):
    """Mid-prefill, a chunk scheduled (its snapshots reserved) and aborted before it runs: the reserved snapshot
    slots go back, the filed ones stay with their cached blocks."""
    path, _ = models("published")
    llm = LLM(path, **{**ENGINE, "max_num_batched_tokens": 8}, state_snapshot_every_blocks=1)
    engine = llm.engine
    engine.add_request("a", request(build_prompt([], path, text=30), []), greedy())
    engine.step()
    seq = engine.requests["a"]
    assert 0 < seq.num_computed_tokens < seq.num_prompt_tokens
    assert engine.block_manager.snapshots.num_filed == 2  # every block so far (8 tokens, 4-token blocks)
    engine.scheduler.schedule()  # the next chunk: two more snapshots reserved, not written
    assert len(seq.snapshot_writes) == 2
    assert engine.abort_request("a")
    assert seq.state_slot is None and not seq.snapshot_writes
    assert engine.block_manager.snapshots.num_filed == 2
    assert_no_leaked_blocks(llm)


def test_memory_counts_the_snapshots(models):
    path, _ = models("published")
    engine = LLM(path, **ENGINE, state_snapshots=5).engine
    mem, t = engine.kv_memory(), engine.model_config.text
    assert mem.state_bytes == (engine.num_state_slots + 5) * t.state_bytes_per_seq(torch.float32)


# ---------------------------------------------------------------------------------------------- the pieces alone
def test_snapshot_points_policy():
    seq = Sequence(0, "r", list(range(70)), 70, SamplingParams(), 4)
    assert snapshot_points(seq, 0, 70, 4, 0) == [68]  # only the last block a repeat can hit ((70 - 1) // 4 * 4)
    assert snapshot_points(seq, 0, 70, 4, 4) == [16, 32, 48, 64, 68]
    assert snapshot_points(seq, 17, 40, 4, 4) == [32]  # only inside the chunk (start, end]
    assert snapshot_points(Sequence(0, "r", list(range(8)), 8, SamplingParams(), 4), 0, 8, 4, 1) == [4]


def test_snapshot_slots_reserve_file_drop_and_pins():
    s = Snapshots(first=10, num=2)
    a, b = s.reserve(), s.reserve()
    assert {a, b} == {10, 11} and s.reserve() is None  # both pinned by planned writes
    s.file(a, b"A")
    s.cancel(b)
    assert s.find(b"A") == a and s.num_filed == 1
    s.pin(a)  # a planned restore
    c = s.reserve()
    assert c == b and s.reserve() is None  # the filed one is pinned: not taken
    s.file(c, b"C")
    s.unpin(a)
    d = s.reserve()  # no free slot: the least recently used unpinned snapshot goes
    assert d == a and s.find(b"A") is None and s.find(b"C") == c
    s.file(d, b"C")  # that block already has one: the slot is freed, not filed twice
    assert s.num_filed == 1
    s.drop(b"C")
    assert s.find(b"C") is None
    s.check_no_leaks()
