"""Qwen3.5(-MoE) in the local engine against transformers' own ``generate`` on tiny random checkpoints.

Greedy tokens identical and every step's logits within 1e-4 (float32): one image, two images of different sizes,
text only, a prompt several prefill chunks long (chunk boundaries inside an image and off the GDN's 64-token chunk
grid, the state carried across chunks), a batch of mixed requests, both key layouts, the dense family. The hybrid
cache: a request gets its KV blocks and its state slot together or waits; preemption and abort free both; memory is
reported per kind (prefix caching with state snapshots: tests/engine/test_qwen35_prefix.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM
from engine.config import ModelConfig, parse_config
from engine.errors import UnsupportedModelError
from engine.models.qwen3_5.gdn import chunked_delta_rule, prepare_qk, recurrent_step
from duet_testing.qwen35_checkpoints import Qwen35TinySpec, load_qwen35_reference, make_tiny_qwen35_checkpoint
from tests.conftest import assert_no_leaked_blocks
from tests.engine.test_qwen_vl import SIZES, assert_matches, build_prompt, greedy, image, reference_generate, request

SPEC = Qwen35TinySpec()
ENGINE = dict(dtype="float32", num_kv_blocks=96, block_size=4, max_num_seqs=8, max_model_len=256)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """``ckpts(name, **spec overrides)``: one checkpoint per name for the module."""
    made: dict[str, Path] = {}

    def make(name: str, **overrides) -> Path:
        return made.get(name) or made.setdefault(name, make_tiny_qwen35_checkpoint(
            tmp_path_factory.mktemp(f"qwen35-{name}") / "ckpt", dataclasses.replace(SPEC, **overrides)))

    return make


@pytest.fixture(scope="module")
def ckpt(ckpts) -> Path:
    return ckpts("published")


reference = pytest.fixture(scope="module", name="reference")(lambda ckpt: load_qwen35_reference(ckpt))


CASES = {"one-image": [("100x61", 0)], "two-sizes": [("47x133", 2), ("150x170", 3)], "text-only": []}


@pytest.mark.parametrize("cpu_linear", ["auto", "packed"])  # packed: every linear layer and expert through oneDNN
@pytest.mark.parametrize("case", list(CASES))
def test_generate_matches_transformers(ckpt, reference, case, cpu_linear):
    images = [image(seed, SIZES[name]) for name, seed in CASES[case]]
    ids = build_prompt(images, ckpt, seed=len(case), text=5)
    llm = LLM(ckpt, **ENGINE, cpu_linear=cpu_linear)
    assert_matches(llm.generate([request(ids, images)], greedy())[0],
                   *reference_generate(reference, ckpt, ids, images, 6))
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("budget", [7, 37], ids=["chunks-of-7", "chunks-of-37"])
def test_prompt_of_several_prefill_chunks(ckpt, reference, budget):
    images = [image(4, SIZES["150x170"]), image(5, SIZES["47x133"])]
    ids = build_prompt(images, ckpt, seed=9, text=40)  # > 64 tokens: spans straddle the GDN's chunk grid
    assert len(ids) > 2 * 64 and len(ids) % budget
    llm = LLM(ckpt, **{**ENGINE, "max_num_batched_tokens": budget})
    assert_matches(llm.generate([request(ids, images)], greedy())[0],
                   *reference_generate(reference, ckpt, ids, images, 6))
    assert_no_leaked_blocks(llm)


def test_batch_of_mixed_requests(ckpt, reference):
    """Prompts of different lengths and images in one engine with a small token budget: steps mix a prefill chunk
    of one request with decodes of others, each reading and writing its own state slot."""
    images = [[image(10, SIZES["100x61"])], [], [image(11, SIZES["33x47"]), image(12, SIZES["47x133"])], []]
    prompts = [build_prompt(ims, ckpt, seed=20 + i, text=3 + 17 * i) for i, ims in enumerate(images)]
    llm = LLM(ckpt, **{**ENGINE, "max_num_batched_tokens": 24})
    outs = llm.generate([request(p, ims) for p, ims in zip(prompts, images, strict=True)], greedy(5))
    for out, p, ims in zip(outs, prompts, images, strict=True):
        assert_matches(out, *reference_generate(reference, ckpt, p, ims, 5))
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("variant", ["fused-sharded", "dense"])
def test_layouts_and_dense_family(ckpts, ckpt, reference, variant):
    overrides = dict(layout="fused", sharded=True) if variant == "fused-sharded" else dict(text="qwen3_5")
    path = ckpts(variant, **overrides)
    ref = reference if variant == "fused-sharded" else load_qwen35_reference(path)
    assert ModelConfig.from_pretrained(path).text.is_moe == (variant != "dense")
    images = [image(7, SIZES["100x61"])]
    ids = build_prompt(images, path)
    llm = LLM(path, **ENGINE)
    assert_matches(llm.generate([request(ids, images)], greedy())[0], *reference_generate(ref, path, ids, images, 6))
    assert_no_leaked_blocks(llm)


def test_config_of_the_hybrid_family(ckpt):
    cfg = ModelConfig.from_pretrained(ckpt).text
    assert cfg.is_hybrid and cfg.kv_layers == (2,) and cfg.state_layers == (0, 1, 3)
    assert cfg.rope_dim == 16 and cfg.attn_output_gate and cfg.shared_expert_intermediate_size == 32
    g = cfg.gdn
    assert (g.conv_dim, g.conv_kernel) == (2 * 2 * 16 + 4 * 16, 4)
    assert cfg.state_bytes_per_seq(torch.float32) == 3 * (g.conv_dim * 3 * 4 + 4 * 16 * 16 * 4)
    assert cfg.kv_bytes_per_token(torch.float32) == 2 * 1 * 2 * 32 * 4  # one KV layer only
    raw = {"model_type": "qwen3_5_moe", "image_token_id": 1, "vision_config": {
        "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 16,
        "out_hidden_size": 64, "num_position_embeddings": 36}}
    text = {"model_type": "qwen3_5_moe_text", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "head_dim": 32, "num_experts": 2, "num_experts_per_tok": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                "mrope_section": [2, 3, 3]}}
    assert parse_config({**raw, "text_config": {**text, "full_attention_interval": 2}}).text.layer_types == (
        "linear_attention", "full_attention")
    for bad in ({"layer_types": ["linear_attention", "sliding_attention"]}, {"layer_types": ["full_attention"]},
                {"rope_parameters": {**text["rope_parameters"], "mrope_section": [4, 4, 4]}}):
        with pytest.raises(UnsupportedModelError):
            parse_config({**raw, "text_config": {**text, **bad}})


def test_state_slots_gate_admission_and_preemption_frees_them(ckpt, reference):
    """Two state slots for four requests: at most two run at once, the others wait for a slot; a KV pool too small
    for all of them preempts, and the recomputed prompts start from fresh state. Every output equals the reference."""
    prompts = [build_prompt([], ckpt, seed=40 + i, text=18) for i in range(4)]
    llm = LLM(ckpt, **{**ENGINE, "max_num_state_slots": 2, "num_kv_blocks": 12})
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", request(p, []), greedy(8))
    outs, most_running = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        running = [s for s in engine.scheduler.running if s.state_slot is not None]
        assert len(running) == len(engine.scheduler.running), "every running sequence holds a state slot"
        most_running = max(most_running, len(running))
        assert engine.block_manager.state_slots.num_free == 2 - len({s.state_slot for s in running})
    assert most_running == 2
    assert sum(o.metrics.num_preemptions for o in outs.values()) > 0, "the pool was meant to force a preemption"
    for i, p in enumerate(prompts):
        assert_matches(outs[f"r{i}"], *reference_generate(reference, ckpt, p, [], 8))
    assert_no_leaked_blocks(llm)


def test_abort_mid_prefill_frees_blocks_and_state(ckpt):
    llm = LLM(ckpt, **{**ENGINE, "max_num_batched_tokens": 8})
    engine = llm.engine
    engine.add_request("a", request(build_prompt([], ckpt, text=30), []), greedy())
    engine.step()
    seq = engine.requests["a"]
    assert seq.state_slot is not None and 0 < seq.num_computed_tokens < seq.num_prompt_tokens
    assert engine.abort_request("a")
    assert seq.state_slot is None
    assert_no_leaked_blocks(llm)


def test_memory_is_reported_per_kind(ckpt):
    llm = LLM(ckpt, **ENGINE)
    engine = llm.engine
    assert engine.prefix_caching_off_reason is None and engine.block_manager.enable_prefix_caching
    ids = build_prompt([], ckpt, text=20)
    first, second = llm.generate([request(ids, [])], greedy(2)), llm.generate([request(ids, [])], greedy(2))
    assert second[0].num_cached_tokens > 0 and first[0].outputs[0].token_ids == second[0].outputs[0].token_ids
    mem, t = engine.kv_memory(), engine.model_config.text
    assert engine.num_snapshots == ENGINE["max_num_seqs"]  # num_kv_blocks fixes the pool: one per sequence
    assert mem.state_bytes == (engine.num_state_slots + engine.num_snapshots) * t.state_bytes_per_seq(torch.float32)
    assert mem.pool_bytes == 96 * 4 * t.kv_bytes_per_token(torch.float32)
    assert mem.total_bytes == mem.pool_bytes + mem.mirror_bytes + mem.state_bytes


@pytest.mark.parametrize("splits", [[1, 1, 1], [5, 64, 3], [70], [13, 13, 44]], ids=str)
def test_chunked_rule_equals_the_recurrence_across_spans(splits):
    """Any split of a sequence into spans, the state carried between them, gives the token-by-token recurrence."""
    gen = torch.Generator().manual_seed(0)
    n, hk, hv, dk, dv = sum(splits), 2, 4, 8, 6
    q, k = torch.randn(n, hk, dk, generator=gen), torch.randn(n, hk, dk, generator=gen)
    v = torch.randn(n, hv, dv, generator=gen)
    g, beta = -torch.rand(n, hv, generator=gen), torch.rand(n, hv, generator=gen)
    q, k = prepare_qk(q, k, hv)
    state, outs = torch.zeros(1, hv, dk, dv), []
    for t in range(n):
        o, state = recurrent_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        outs.append(o[0])
    want = torch.stack(outs)
    s, start, got = None, 0, []
    for length in splits:
        e = start + length
        o, s = chunked_delta_rule(q[start:e], k[start:e], v[start:e], g[start:e], beta[start:e], s, chunk=8)
        got.append(o)
        start = e
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, state[0], atol=1e-5, rtol=1e-5)
    assert np.isfinite(want.numpy()).all()


def test_choices_of_an_n_request_each_get_a_copy_of_the_prompt_state(ckpt, reference):
    """n = 3 greedy choices fork after the prompt: each takes its own state slot holding a copy of the prompt's GDN
    state, so every one decodes the reference's tokens (a child left with a stale or zero state would not)."""
    ids = build_prompt([image(13, SIZES["47x133"])], ckpt, seed=5)
    llm = LLM(ckpt, **ENGINE)
    out = llm.generate([request(ids, [image(13, SIZES["47x133"])])], dataclasses.replace(greedy(6), n=3))[0]
    want, _ = reference_generate(reference, ckpt, ids, [image(13, SIZES["47x133"])], 6)
    assert [c.token_ids for c in out.outputs] == [want] * 3
    assert_no_leaked_blocks(llm)
