"""Greedy tokens and logits against transformers' LlavaForConditionalGeneration (float32, CPU).

Every supported combination is built as a tiny random checkpoint at test time; the reference generates each prompt
alone (batch 1, no padding) while the engine runs all prompts of a case in one continuous batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from engine import LLM, SamplingParams
from duet_testing.checkpoints import TinySpec, image_tokens_per_image, load_reference_model, make_tiny_checkpoint

MAX_NEW = 6
LOGIT_TOL = 1e-4

CASES = {
    "siglip-qwen3moe-default": dict(),
    "clip-qwen3moe-default": dict(vision="clip"),
    "clip-qwen3moe-full": dict(vision="clip", vision_feature_select_strategy="full"),
    "siglip-full-multilayer": dict(vision_feature_select_strategy="full", vision_feature_layer=(1, -1)),
    "clip-default-multilayer": dict(vision="clip", vision_feature_layer=(0, -2)),
    "mixtral-top1": dict(text="mixtral", top_k=1),
    "mixtral-top3-mha": dict(text="mixtral", top_k=3, num_kv_heads=4),
    "qwen3moe-mqa-no-norm-topk": dict(num_kv_heads=1, norm_topk_prob=False, top_k=3),
    "qwen3moe-sparse-step-mlp-only": dict(num_layers=4, decoder_sparse_step=2, mlp_only_layers=(3,)),
    "qwen3-dense-tied": dict(text="qwen3", tie_word_embeddings=True),
    "llama-dense": dict(text="llama", vision="clip"),
    "mistral-dense-gqa4": dict(text="mistral", num_heads=8, num_kv_heads=2, head_dim=8),
    "fused-layout": dict(layout="fused"),
    "published-layout-sharded": dict(layout="published", sharded=True, vision="clip"),
    "fused-sharded-mixtral": dict(layout="fused", sharded=True, text="mixtral"),
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory):
    spec = TinySpec(**CASES[request.param])
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", spec)
    return spec, path


def _prompts(spec: TinySpec, seed: int = 0) -> list[tuple[list[int], list[Image.Image]]]:
    """Text-only, one image, and two images (with text between), random ids that avoid special tokens."""
    rng = np.random.default_rng(seed)
    img_id, n = spec.image_token_id, image_tokens_per_image(spec)
    text = lambda k: rng.integers(0, spec.vocab_size - 8, k).tolist()  # noqa: E731
    image = lambda: Image.fromarray(rng.integers(0, 256, (33, 47, 3), dtype=np.uint8))  # noqa: E731
    return [
        (text(11), []),
        (text(3) + [img_id] * n + text(5), [image()]),
        (text(2) + [img_id] * n + text(4) + [img_id] * n + text(3), [image(), image()]),
    ]


def _reference(path, ids: list[int], images: list[Image.Image], ref) -> tuple[list[int], list[torch.Tensor]]:
    kwargs = {}
    if images:
        kwargs["pixel_values"] = AutoImageProcessor.from_pretrained(path)(images, return_tensors="pt")["pixel_values"]
    ref.generation_config.eos_token_id = None  # like ignore_eos: never stop early, never mask EOS
    with torch.inference_mode():
        g = ref.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=MAX_NEW, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **kwargs)
    return g.sequences[0, len(ids):].tolist(), [x[0].float() for x in g.logits]


@pytest.mark.parametrize("cpu_linear", ["auto", "packed"])  # packed: every linear layer and expert through oneDNN
def test_greedy_tokens_and_logits_match_reference(case, cpu_linear):
    spec, path = case
    ref = load_reference_model(path)
    prompts = _prompts(spec)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=4, cpu_linear=cpu_linear)
    if cpu_linear == "packed":
        assert llm.engine.model.linear_kernels["packed"] == llm.engine.model.linear_kernels["layers"] > 0
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, return_logits=True)
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}} for ids, imgs in prompts],
                        params)
    for (ids, imgs), out in zip(prompts, outs, strict=True):
        want_tokens, want_logits = _reference(path, ids, imgs, ref)
        got = out.outputs[0]
        assert got.token_ids == want_tokens, f"{len(imgs)} image(s): tokens differ"
        for step, (a, b) in enumerate(zip(got.logits, want_logits, strict=True)):
            diff = (a - b).abs().max().item()
            assert diff < LOGIT_TOL, f"{len(imgs)} image(s), step {step}: max |logit diff| {diff:.2e}"
    llm.engine.block_manager.check_no_leaks()


def test_moe_counts_match_routing(case):
    """Tokens counted per (layer, expert) equal prompt+generated tokens x top_k on every MoE layer."""
    spec, path = case
    llm = LLM(path, num_kv_blocks=64, block_size=4)
    cfg = llm.engine.model_config.text
    if not cfg.is_moe:
        pytest.skip("dense model")
    ids, imgs = _prompts(spec)[1]
    llm.engine.reset_moe_counts()
    llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}],
                 SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    counts = llm.engine.moe_counts()
    # the last sampled token is never fed back, so computed tokens = prompt + max_tokens - 1
    expected = (len(ids) + 2) * cfg.top_k
    for layer, is_moe in enumerate(cfg.moe_layers):
        assert counts[layer].sum().item() == (expected if is_moe else 0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_reference(dtype, tmp_path_factory):
    """Half-precision runs the same math; first-token logits agree to half-precision rounding."""
    spec = TinySpec()
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(dtype) / "ckpt", spec)
    ref = load_reference_model(path).to(getattr(torch, dtype))
    llm = LLM(path, dtype=dtype, num_kv_blocks=64, block_size=4)
    for ids, imgs in _prompts(spec, seed=1):
        out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}],
                           SamplingParams(temperature=0, max_tokens=1, return_logits=True))[0]
        _, want = _reference(path, ids, imgs, ref)
        got = out.outputs[0].logits[0]
        assert got.argmax() == want[0].argmax()
        assert (got - want[0]).abs().max().item() < 0.1 * want[0].abs().max().item()
    llm.engine.block_manager.check_no_leaks()
