"""Tiny random-weight Qwen3-VL(-MoE) checkpoints, written locally with transformers (no hub access).

``make_tiny_qwen_checkpoint(path, spec)`` builds ``Qwen3VLMoeForConditionalGeneration`` (``text="qwen3_vl_moe"``) or
``Qwen3VLForConditionalGeneration`` (``"qwen3_vl"``), re-initialises every parameter from ``spec.seed`` and writes
one of two key layouts (observed with transformers 5.24):

``layout="hf"`` -- what ``save_pretrained`` writes: ``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``
(absent when tied); fused experts ``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj [E, H, I]``.

``layout="published"`` -- the released checkpoints' layout (Qwen/Qwen3-VL-30B-A3B-*): the same names, the fused
expert tensors transposed (``[E, H, 2I]`` and ``[E, I, H]``), and ``transformers_version`` 4.x in config.json (what
transformers 5 reads to transpose them back).

Beside the weights: config.json, generation_config.json, a byte-level BPE tokenizer with Qwen's special tokens
(``<|im_start|>``, ``<|im_end|>`` = eos, ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``,
``<|video_pad|>``, ``<|endoftext|>`` = pad; no BOS), a chat template that writes each image part as
``<|vision_start|><|image_pad|><|vision_end|>``, and a ``preprocessor_config.json`` for ``Qwen2VLImageProcessor``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from duet_testing.checkpoints import _DTYPES, _reinit_, _shard_bytes, write_atomically

if TYPE_CHECKING:
    import transformers

SPECIALS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_start|>", "<|im_end|>",
            "<|endoftext|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class QwenTinySpec:
    """Everything that determines a tiny Qwen3-VL checkpoint."""

    text: Literal["qwen3_vl_moe", "qwen3_vl"] = "qwen3_vl_moe"
    layout: Literal["hf", "published"] = "hf"
    sharded: bool = False
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    moe_intermediate_size: int = 24
    num_experts: int = 8
    top_k: int = 2
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    mrope_section: tuple[int, int, int] = (2, 3, 3)
    max_position_embeddings: int = 8192
    vision_depth: int = 3
    vision_hidden: int = 32
    vision_heads: int = 2
    vision_intermediate: int = 64
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    num_position_embeddings: int = 36
    deepstack_visual_indexes: tuple[int, ...] = (0, 1)
    min_pixels: int = 32 * 32
    max_pixels: int = 128 * 128
    seed: int = 0
    with_tokenizer: bool = True
    with_processor: bool = True

    def __post_init__(self) -> None:
        if self.vocab_size < 16 or self.num_heads % self.num_kv_heads or not 1 <= self.top_k <= self.num_experts:
            raise ValueError("invalid QwenTinySpec: vocab_size >= 16, num_heads % num_kv_heads == 0, 1 <= top_k <= E")
        if sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError("invalid QwenTinySpec: mrope_section must sum to head_dim / 2")

    @property
    def special_token_ids(self) -> dict[str, int]:
        return {tok: self.vocab_size - 1 - i for i, tok in enumerate(SPECIALS)}

    @property
    def image_token_id(self) -> int:
        return self.special_token_ids["<|image_pad|>"]

    @property
    def eos_token_id(self) -> int:
        return self.special_token_ids["<|im_end|>"]


def build_qwen_config(spec: QwenTinySpec) -> transformers.PreTrainedConfig:
    import transformers

    ids = spec.special_token_ids
    text = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size, max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                         "mrope_section": list(spec.mrope_section), "mrope_interleaved": True},
        tie_word_embeddings=spec.tie_word_embeddings, eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"])
    vision = dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
                  num_heads=spec.vision_heads, patch_size=spec.patch_size, temporal_patch_size=spec.temporal_patch_size,
                  spatial_merge_size=spec.merge_size, out_hidden_size=spec.hidden_size,
                  num_position_embeddings=spec.num_position_embeddings,
                  deepstack_visual_indexes=list(spec.deepstack_visual_indexes))
    if spec.text == "qwen3_vl_moe":
        text.update(moe_intermediate_size=spec.moe_intermediate_size, num_experts=spec.num_experts,
                    num_experts_per_tok=spec.top_k, decoder_sparse_step=spec.decoder_sparse_step,
                    mlp_only_layers=list(spec.mlp_only_layers))
        cls = transformers.Qwen3VLMoeConfig
    else:
        cls = transformers.Qwen3VLConfig
    return cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
               video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
               vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=spec.tie_word_embeddings)


def build_qwen_model(spec: QwenTinySpec) -> transformers.PreTrainedModel:
    """The in-memory reference model of ``spec`` (eval mode, ``spec.dtype``, eager attention)."""
    import transformers
    from transformers import GenerationConfig

    config = build_qwen_config(spec)
    config._attn_implementation = "eager"
    cls = (transformers.Qwen3VLMoeForConditionalGeneration if spec.text == "qwen3_vl_moe"
           else transformers.Qwen3VLForConditionalGeneration)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = cls(config)
    _reinit_(model, spec.seed)
    ids = spec.special_token_ids
    model.generation_config = GenerationConfig(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    return model.to(_DTYPES[spec.dtype]).eval()


def _publish_experts(path: Path) -> None:
    """Transpose the fused expert tensors in every shard and mark the config as written before transformers 5."""
    from safetensors.torch import load_file, save_file

    for f in sorted(path.glob("*.safetensors")):
        tensors = load_file(f)
        for k in [k for k in tensors if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
            tensors[k] = tensors[k].transpose(1, 2).contiguous()
        save_file(tensors, f, metadata={"format": "pt"})
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["transformers_version"] = "4.57.0.dev0"
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")


def write_qwen_tokenizer(path: Path, spec: QwenTinySpec) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from duet_testing.tiny_tokenizer import _byte_alphabet, _train_merges

    specials = spec.special_token_ids
    n_regular = spec.vocab_size - len(specials)
    tokens, merges = (_byte_alphabet()[:n_regular], []) if n_regular <= 256 else _train_merges(n_regular, spec.seed)
    tokens += [f"<unused{i}>" for i in range(n_regular - len(tokens))]
    vocab = {**dict(zip(tokens, range(n_regular))), **specials}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    assert tok.get_vocab_size(with_added_tokens=True) == spec.vocab_size
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>").save_pretrained(path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def write_qwen_processor(path: Path, spec: QwenTinySpec) -> None:
    cfg = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": spec.patch_size,
           "temporal_patch_size": spec.temporal_patch_size, "merge_size": spec.merge_size,
           "size": {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True, "do_normalize": True,
           "do_convert_rgb": True, "do_resize": True, "resample": 3, "rescale_factor": 1 / 255}
    (path / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def make_tiny_qwen_checkpoint(path: str | os.PathLike, spec: QwenTinySpec = QwenTinySpec(), **overrides) -> Path:
    """Write the checkpoint of ``dataclasses.replace(spec, **overrides)`` to ``path`` (absent or empty)."""
    spec = dataclasses.replace(spec, **overrides)

    def write(tmp: Path) -> None:
        model = build_qwen_model(spec)
        model.save_pretrained(tmp, max_shard_size=_shard_bytes(model) if spec.sharded else "50GB")
        if spec.layout == "published":
            _publish_experts(tmp)
        if spec.with_tokenizer:
            write_qwen_tokenizer(tmp, spec)
        if spec.with_processor:
            write_qwen_processor(tmp, spec)

    return write_atomically(Path(path), write)


def load_qwen_reference(path: str | os.PathLike) -> transformers.PreTrainedModel:
    """transformers' own model of a Qwen3-VL(-MoE) checkpoint directory (checkpoint dtype, eager, eval)."""
    import transformers

    mt = json.loads((Path(path) / "config.json").read_text())["model_type"]
    cls = (transformers.Qwen3VLMoeForConditionalGeneration if mt == "qwen3_vl_moe"
           else transformers.Qwen3VLForConditionalGeneration)
    return cls.from_pretrained(path, dtype="auto", attn_implementation="eager").eval()
