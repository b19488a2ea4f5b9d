"""Tiny random-weight Qwen3.5(-MoE) checkpoints, written locally with transformers (no hub access).

``make_tiny_qwen35_checkpoint(path, spec)`` builds ``Qwen3_5MoeForConditionalGeneration`` (``text="qwen3_5_moe"``)
or ``Qwen3_5ForConditionalGeneration`` (``"qwen3_5"``), re-initialises every parameter from ``spec.seed`` and writes
one of two key layouts (observed with transformers 5.24):

``layout="published"`` -- what ``save_pretrained`` writes, which is the released checkpoints' layout
(Qwen/Qwen3.5-35B-A3B): ``model.language_model.*``, ``model.visual.*``, ``lm_head.weight`` (absent when tied); one
tensor per expert ``mlp.experts.N.{gate,up,down}_proj.weight`` (transformers 5 fuses them on load and splits them
again on save); GDN layers ``linear_attn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,conv1d,norm,out_proj,A_log,
dt_bias}``; gated
attention ``self_attn.q_proj`` of ``2 * heads * head_dim`` rows (per head: query rows, then gate rows); the shared
expert ``mlp.shared_expert.{gate,up,down}_proj`` and ``mlp.shared_expert_gate [1, H]``.

``layout="fused"`` -- transformers 5's in-memory ``state_dict`` written with ``safetensors.torch.save_file``: the same
names with the experts fused, ``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj [E, H, I]``.

The tokenizer, chat template and image processor are the Qwen3-VL builder's (:mod:`duet_testing.qwen_checkpoints`): the
family shares Qwen2VLImageProcessor and the special tokens.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from duet_testing.checkpoints import _DTYPES, _init_stats, _save_fused, _shard_bytes, write_atomically
from duet_testing.qwen_checkpoints import SPECIALS, write_qwen_processor, write_qwen_tokenizer

if TYPE_CHECKING:
    import transformers


@dataclass(frozen=True)
class Qwen35TinySpec:
    """Everything that determines a tiny Qwen3.5 checkpoint. ``layer_types`` default: GDN, GDN, full, GDN."""

    text: Literal["qwen3_5_moe", "qwen3_5"] = "qwen3_5_moe"
    layout: Literal["published", "fused"] = "published"
    sharded: bool = False
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    layer_types: tuple[str, ...] = ("linear_attention", "linear_attention", "full_attention", "linear_attention")
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    partial_rotary_factor: float = 0.5
    mrope_section: tuple[int, int, int] = (2, 3, 3)
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    intermediate_size: int = 96
    moe_intermediate_size: int = 24
    shared_expert_intermediate_size: int = 32
    num_experts: int = 8
    top_k: int = 2
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    vision_depth: int = 2
    vision_hidden: int = 32
    vision_heads: int = 2
    vision_intermediate: int = 64
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    num_position_embeddings: int = 36
    min_pixels: int = 32 * 32
    max_pixels: int = 128 * 128
    seed: int = 0
    with_tokenizer: bool = True
    with_processor: bool = True

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_layers or "full_attention" not in self.layer_types:
            raise ValueError("invalid Qwen35TinySpec: one layer type per layer, at least one full_attention layer")
        if sum(self.mrope_section) * 2 != int(self.head_dim * self.partial_rotary_factor):
            raise ValueError("invalid Qwen35TinySpec: mrope_section must sum to the rotary dim / 2")

    @property
    def special_token_ids(self) -> dict[str, int]:
        return {tok: self.vocab_size - 1 - i for i, tok in enumerate(SPECIALS)}

    @property
    def image_token_id(self) -> int:
        return self.special_token_ids["<|image_pad|>"]


def build_qwen35_config(spec: Qwen35TinySpec) -> transformers.PreTrainedConfig:
    import transformers

    ids = spec.special_token_ids
    text = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        layer_types=list(spec.layer_types), num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                         "partial_rotary_factor": spec.partial_rotary_factor,
                         "mrope_section": list(spec.mrope_section), "mrope_interleaved": True},
        linear_num_key_heads=spec.linear_num_key_heads, linear_num_value_heads=spec.linear_num_value_heads,
        linear_key_head_dim=spec.linear_key_head_dim, linear_value_head_dim=spec.linear_value_head_dim,
        linear_conv_kernel_dim=spec.linear_conv_kernel_dim, tie_word_embeddings=spec.tie_word_embeddings,
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    vision = dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
                  num_heads=spec.vision_heads, patch_size=spec.patch_size, temporal_patch_size=spec.temporal_patch_size,
                  spatial_merge_size=spec.merge_size, out_hidden_size=spec.hidden_size,
                  num_position_embeddings=spec.num_position_embeddings)
    if spec.text == "qwen3_5_moe":
        text.update(moe_intermediate_size=spec.moe_intermediate_size, num_experts=spec.num_experts,
                    num_experts_per_tok=spec.top_k,
                    shared_expert_intermediate_size=spec.shared_expert_intermediate_size)
        cls = transformers.Qwen3_5MoeConfig
    else:
        text.update(intermediate_size=spec.intermediate_size)
        cls = transformers.Qwen3_5Config
    return cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
               video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
               vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=spec.tie_word_embeddings)


@torch.no_grad()
def _reinit35_(model: torch.nn.Module, seed: int) -> None:
    """The LLaVA builder's init rules, zero-centred norm weights around 0, and GDN decays: ``A = exp(A_log)`` around
    1 and ``dt_bias`` around 1, so states decay over a few tokens to a few tens (every token's contribution stays
    visible in the logits)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(("A_log", "dt_bias")):
            mean, std = (0.0, 0.5) if name.endswith("A_log") else (1.0, 0.3)
        elif name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.language_model.norm.weight")):
            mean, std = 0.0, 0.1  # zero-centred RMSNorm: the scale is 1 + w
        elif name.endswith("conv1d.weight"):
            mean, std = 0.0, 1.0 / math.sqrt(p.shape[-1])
        else:
            mean, std = _init_stats(name, p.shape)
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std + mean)


def reference_class(model_type: str) -> type:
    import transformers

    return (transformers.Qwen3_5MoeForConditionalGeneration if model_type == "qwen3_5_moe"
            else transformers.Qwen3_5ForConditionalGeneration)


def build_qwen35_model(spec: Qwen35TinySpec) -> transformers.PreTrainedModel:
    """The in-memory reference model of ``spec`` (eval mode, ``spec.dtype``, eager attention)."""
    from transformers import GenerationConfig

    config = build_qwen35_config(spec)
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = reference_class(spec.text)(config)
    _reinit35_(model, spec.seed)
    ids = spec.special_token_ids
    model.generation_config = GenerationConfig(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    return model.to(_DTYPES[spec.dtype]).eval()


def make_tiny_qwen35_checkpoint(path: str | os.PathLike, spec: Qwen35TinySpec = Qwen35TinySpec(),
                                **overrides) -> Path:
    """Write the checkpoint of ``dataclasses.replace(spec, **overrides)`` to ``path`` (absent or empty)."""
    spec = dataclasses.replace(spec, **overrides)

    def write(tmp: Path) -> None:
        model = build_qwen35_model(spec)
        if spec.layout == "fused":
            _save_fused(model, tmp, spec)  # type: ignore[arg-type]  # reads dtype, sharded, tie_word_embeddings
        else:
            model.save_pretrained(tmp, max_shard_size=_shard_bytes(model) if spec.sharded else "50GB")
        if spec.with_tokenizer:
            write_qwen_tokenizer(tmp, spec)  # type: ignore[arg-type]  # reads vocab_size, seed, special ids
        if spec.with_processor:
            write_qwen_processor(tmp, spec)  # type: ignore[arg-type]  # reads the patch / pixel fields

    return write_atomically(Path(path), write)


def load_qwen35_reference(path: str | os.PathLike) -> transformers.PreTrainedModel:
    """transformers' own model of a Qwen3.5(-MoE) checkpoint directory (checkpoint dtype, eager, eval)."""
    import json

    mt = json.loads((Path(path) / "config.json").read_text())["model_type"]
    return reference_class(mt).from_pretrained(path, dtype="auto", attn_implementation="eager").eval()
