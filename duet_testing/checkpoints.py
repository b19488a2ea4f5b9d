"""Tiny random-weight LLaVA checkpoints, written locally with transformers (no hub access).

Used by tests as the reference-model source, by the CLI for its embedded demo model, and by ``duet bench``.
``make_tiny_checkpoint(path, spec)`` builds ``LlavaForConditionalGeneration(LlavaConfig(...))``, re-initialises every
parameter from ``spec.seed`` (same spec -> bit-identical tensors) and writes one of three key layouts, observed with
transformers 5.24:

``layout="hf"`` -- exactly what ``save_pretrained`` writes (``model.safetensors`` or ``-0000k-of-0000n`` shards +
``model.safetensors.index.json``). Text keys keep the llava-hf names, vision keys are FLAT (no ``vision_model.``)::

    language_model.model.embed_tokens.weight            language_model.lm_head.weight (absent when tied)
    language_model.model.norm.weight                    language_model.model.layers.0.self_attn.{q,k,v,o}_proj.weight
    language_model.model.layers.0.self_attn.{q,k}_norm.weight                      (qwen3 / qwen3_moe only)
    language_model.model.layers.0.mlp.experts.3.{gate,up,down}_proj.weight         qwen3_moe, per expert
    language_model.model.layers.0.mlp.gate.weight                                  qwen3_moe router [E, H]
    language_model.model.layers.0.block_sparse_moe.experts.3.w{1,2,3}.weight        mixtral (w1 gate, w3 up, w2 down)
    language_model.model.layers.0.block_sparse_moe.gate.weight                     mixtral router [E, H]
    language_model.model.layers.0.mlp.{gate,up,down}_proj.weight                   dense layers / dense models
    vision_tower.embeddings.patch_embedding.weight      vision_tower.embeddings.position_embedding.weight
    vision_tower.embeddings.class_embedding  (clip)     vision_tower.pre_layrnorm.{weight,bias}  (clip)
    vision_tower.encoder.layers.0.self_attn.{q,k,v,out}_proj.{weight,bias}
    vision_tower.encoder.layers.0.{layer_norm1,layer_norm2,mlp.fc1,mlp.fc2}.{weight,bias}
    vision_tower.post_layernorm.{weight,bias}           multi_modal_projector.linear_{1,2}.{weight,bias}

``layout="published"`` -- "hf" with ``vision_tower.`` renamed to ``vision_tower.vision_model.``: the key layout of
the checkpoints on the hub (llava-hf/*), which older transformers and vLLM expect. transformers 5.24 loads it too.

``layout="fused"`` -- the in-memory transformers-5 ``state_dict`` written with ``safetensors.torch.save_file``::

    model.language_model.*  model.vision_tower.*  (flat, as above)  model.multi_modal_projector.*  lm_head.weight
    model.language_model.layers.0.mlp.experts.gate_up_proj   [E, 2*I, H]  rows [0, I) = gate, [I, 2I) = up
    model.language_model.layers.0.mlp.experts.down_proj      [E, H, I]
    model.language_model.layers.0.mlp.gate.weight            [E, H]   (mixtral too: block_sparse_moe -> mlp)

``I`` is ``moe_intermediate_size`` for qwen3_moe and ``intermediate_size`` for mixtral. With tied embeddings
``lm_head.weight`` / ``language_model.lm_head.weight`` is omitted in every layout.

Beside the weights: ``config.json``, ``generation_config.json`` (bos/eos/pad), and optionally a tokenizer
(``tokenizer.json`` + ``tokenizer_config.json``; byte-level BPE, total vocab == ``vocab_size``, ``<image>`` at
``image_token_index``, BOS added by the post-processor) and an image processor (``preprocessor_config.json``, plus
``processor_config.json`` for ``AutoProcessor``/``LlavaProcessor`` when a tokenizer is written too).
Default special ids: ``<image>`` V-1, ``</s>`` (eos) V-2, ``<s>`` V-3, ``<pad>`` V-4 (V = ``vocab_size``). In
config.json, qwen3_moe's ``num_experts`` is serialized as ``text_config.num_local_experts``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from duet_testing.tiny_tokenizer import write_tokenizer

if TYPE_CHECKING:
    import transformers

_LM_HEAD_GAIN = 3.0  # logits ~ N(0, 3^2): greedy top-1/top-2 gaps far above float noise
_ROUTER_GAIN = 2.0  # decisive expert routing, so routing ties are rare


@dataclass(frozen=True)
class TinySpec:
    """Everything that determines a tiny checkpoint; validated on construction. ``None`` ids take defaults."""

    vision: Literal["siglip", "clip"] = "siglip"
    text: Literal["qwen3_moe", "mixtral", "qwen3", "llama", "mistral"] = "qwen3_moe"
    layout: Literal["hf", "published", "fused"] = "hf"
    sharded: bool = False
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    num_experts: int = 8
    top_k: int = 2
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    vision_hidden: int = 32
    vision_layers: int = 3
    vision_heads: int = 2
    vision_intermediate: int = 64
    image_size: int = 28
    patch_size: int = 14
    vision_feature_layer: int | tuple[int, ...] = -2
    vision_feature_select_strategy: Literal["default", "full"] = "default"
    projector_hidden_act: str = "gelu"
    image_token_index: int | None = None
    eos_token_id: int | None = None
    seed: int = 0
    with_tokenizer: bool = True
    with_processor: bool = True

    def __post_init__(self) -> None:
        ids = self.special_token_ids if self.vocab_size >= 16 else {}
        checks = {
            "vision/text/layout/dtype": self.vision in ("siglip", "clip") and self.text in _TEXT_CONFIGS
            and self.layout in ("hf", "published", "fused") and self.dtype in _DTYPES,
            "vocab_size >= 16": self.vocab_size >= 16,
            "num_heads % num_kv_heads == 0": self.num_heads % self.num_kv_heads == 0,
            "1 <= top_k <= num_experts": 1 <= self.top_k <= self.num_experts,
            "image_size % patch_size == 0": self.image_size % self.patch_size == 0,
            "vision_hidden % vision_heads == 0": self.vision_hidden % self.vision_heads == 0,
            "mlp_only_layers within num_layers": all(0 <= i < self.num_layers for i in self.mlp_only_layers),
            "decoder_sparse_step >= 1": self.decoder_sparse_step >= 1,
            "distinct special ids in [0, vocab_size)": len(set(ids.values())) == 4
            and all(0 <= i < self.vocab_size for i in ids.values()),
        }
        failed = [name for name, ok in checks.items() if not ok]
        if failed:
            raise ValueError(f"invalid TinySpec: {', '.join(failed)}")

    @property
    def image_token_id(self) -> int:
        return self.vocab_size - 1 if self.image_token_index is None else self.image_token_index

    @property
    def special_token_ids(self) -> dict[str, int]:
        """``{"<pad>", "<s>", "</s>", "<image>"} -> id``: eos and image as set; bos, pad the highest free ids."""
        eos = self.vocab_size - 2 if self.eos_token_id is None else self.eos_token_id
        free = [i for i in range(self.vocab_size - 1, -1, -1) if i not in (eos, self.image_token_id)]
        return {"<pad>": free[1], "<s>": free[0], "</s>": eos, "<image>": self.image_token_id}


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def image_tokens_per_image(spec: TinySpec) -> int:
    """Image tokens the projector yields per image: patches, +1 CLS for CLIP, -1 under strategy "default"."""
    n = (spec.image_size // spec.patch_size) ** 2 + (1 if spec.vision == "clip" else 0)
    return n - 1 if spec.vision_feature_select_strategy == "default" else n


def _text_config(spec: TinySpec) -> transformers.PreTrainedConfig:
    ids = spec.special_token_ids
    common = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size, max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=spec.tie_word_embeddings, use_cache=True,
        bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"],
    )
    return _TEXT_CONFIGS[spec.text](spec, common)


def _qwen3_moe(spec: TinySpec, common: dict) -> transformers.PreTrainedConfig:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **common, num_experts=spec.num_experts, num_experts_per_tok=spec.top_k, norm_topk_prob=spec.norm_topk_prob,
        moe_intermediate_size=spec.moe_intermediate_size, decoder_sparse_step=spec.decoder_sparse_step,
        mlp_only_layers=list(spec.mlp_only_layers),
    )


def _mixtral(spec: TinySpec, common: dict) -> transformers.PreTrainedConfig:
    from transformers import MixtralConfig

    return MixtralConfig(**common, num_local_experts=spec.num_experts, num_experts_per_tok=spec.top_k,
                         sliding_window=None)


def _dense(name: str, **extra):
    def make(spec: TinySpec, common: dict) -> transformers.PreTrainedConfig:
        import transformers

        return getattr(transformers, name)(**common, **extra)

    return make


_TEXT_CONFIGS = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "qwen3": _dense("Qwen3Config"),
                 "llama": _dense("LlamaConfig"), "mistral": _dense("MistralConfig", sliding_window=None)}


def build_config(spec: TinySpec) -> transformers.LlavaConfig:
    """The ``LlavaConfig`` a checkpoint of ``spec`` carries (vision_use_head=False, as llava-hf SigLIP towers)."""
    from transformers import CLIPVisionConfig, LlavaConfig, SiglipVisionConfig

    vision_kw = dict(hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
                     num_hidden_layers=spec.vision_layers, num_attention_heads=spec.vision_heads,
                     image_size=spec.image_size, patch_size=spec.patch_size, num_channels=3)
    vision = (SiglipVisionConfig(**vision_kw, vision_use_head=False) if spec.vision == "siglip"
              else CLIPVisionConfig(**vision_kw, projection_dim=spec.vision_hidden))
    layer = spec.vision_feature_layer
    return LlavaConfig(
        vision_config=vision, text_config=_text_config(spec), image_token_index=spec.image_token_id,
        image_seq_length=image_tokens_per_image(spec), projector_hidden_act=spec.projector_hidden_act,
        vision_feature_select_strategy=spec.vision_feature_select_strategy,
        vision_feature_layer=layer if isinstance(layer, int) else list(layer),
        tie_word_embeddings=spec.tie_word_embeddings,
    )


def _init_stats(name: str, shape: torch.Size) -> tuple[float, float]:
    """(mean, std) for one parameter: unit-scale activations everywhere, so logits are well separated."""
    if name.endswith("bias"):
        return 0.0, 0.02
    if len(shape) in (4, 5):  # patch-embedding conv [out, C, p, p] (or [out, C, T, p, p], Qwen3-VL)
        return 0.0, 1.0 / math.sqrt(math.prod(shape[1:]))
    if len(shape) == 1 and "norm" in name:  # LayerNorm / RMSNorm / q_norm / k_norm weights
        return 1.0, 0.1
    if "embed" in name:  # token / position / class embeddings
        return 0.0, 1.0
    gain = 1.0
    if name.endswith("lm_head.weight"):
        gain = _LM_HEAD_GAIN
    elif name.endswith("mlp.gate.weight"):  # the MoE router (mixtral's too: block_sparse_moe is mlp in memory)
        gain = _ROUTER_GAIN
    assert len(shape) in (2, 3), f"no init rule for {name} {tuple(shape)}"
    return 0.0, gain / math.sqrt(shape[-1])  # Linear [out, in] and fused experts [E, out, in]: fan_in = last dim


@torch.no_grad()
def _reinit_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # tied parameters appear once
        mean, std = _init_stats(name, p.shape)
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std + mean)


def build_model(spec: TinySpec) -> transformers.LlavaForConditionalGeneration:
    """The in-memory model of ``spec`` (eval mode, ``spec.dtype``, eager attention); the caller's RNG is untouched."""
    from transformers import GenerationConfig, LlavaForConditionalGeneration

    config = build_config(spec)
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlavaForConditionalGeneration(config)
    _reinit_(model, spec.seed)
    ids = spec.special_token_ids
    model.generation_config = GenerationConfig(bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                                               pad_token_id=ids["<pad>"])
    return model.to(_DTYPES[spec.dtype]).eval()


def _shard_bytes(model: torch.nn.Module) -> int:
    """A shard size that splits the model into about three shards."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return max(total // 3, 1)


def _save_fused(model: torch.nn.Module, path: Path, spec: TinySpec) -> None:
    from safetensors.torch import save_file

    model.config.dtype = spec.dtype  # what save_pretrained would record
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if spec.tie_word_embeddings:
        del state["lm_head.weight"]
    if not spec.sharded:
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    limit, size = _shard_bytes(model), 0
    for key, t in state.items():
        if shards[-1] and size + t.numel() * t.element_size() > limit:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += t.numel() * t.element_size()
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _publish_vision_keys(path: Path) -> None:
    """Rename ``vision_tower.*`` to ``vision_tower.vision_model.*`` in every shard (and the index)."""
    from safetensors.torch import load_file, save_file

    def rename(key: str) -> str:
        return "vision_tower.vision_model." + key[len("vision_tower."):] if key.startswith("vision_tower.") else key

    for f in sorted(path.glob("*.safetensors")):
        save_file({rename(k): v for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    index_path = path / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"] = {rename(k): v for k, v in index["weight_map"].items()}
        index_path.write_text(json.dumps(index, indent=2) + "\n")


def write_processor(path: Path, spec: TinySpec) -> None:
    """preprocessor_config.json for ``image_size``; processor_config.json too when a tokenizer is there."""
    from transformers import AutoTokenizer, CLIPImageProcessorPil, LlavaProcessor, SiglipImageProcessorPil

    side = {"height": spec.image_size, "width": spec.image_size}
    image_processor = (SiglipImageProcessorPil(size=side) if spec.vision == "siglip"
                       else CLIPImageProcessorPil(size={"shortest_edge": spec.image_size}, crop_size=side))
    image_processor.save_pretrained(path)
    if (path / "tokenizer.json").exists():
        LlavaProcessor(
            image_processor=image_processor, tokenizer=AutoTokenizer.from_pretrained(path),
            patch_size=spec.patch_size, vision_feature_select_strategy=spec.vision_feature_select_strategy,
            image_token="<image>", num_additional_image_tokens=1 if spec.vision == "clip" else 0,
        ).save_pretrained(path)


def make_tiny_checkpoint(path: str | os.PathLike, spec: TinySpec = TinySpec(), **overrides) -> Path:
    """Write the checkpoint of ``dataclasses.replace(spec, **overrides)`` to ``path`` and return it.

    ``path`` must be absent or an empty directory. The files are written to a sibling temporary directory and moved
    into place at the end, so a crash never leaves a half-written checkpoint at ``path``. Deterministic: the same
    spec gives identical tensors and tokenizer.
    """
    spec = dataclasses.replace(spec, **overrides)

    def write(tmp: Path) -> None:
        model = build_model(spec)
        if spec.layout == "fused":
            _save_fused(model, tmp, spec)
        else:
            model.save_pretrained(tmp, max_shard_size=_shard_bytes(model) if spec.sharded else "50GB")
            if spec.layout == "published":
                _publish_vision_keys(tmp)
        if spec.with_tokenizer:
            write_tokenizer(tmp, spec)
        if spec.with_processor:
            write_processor(tmp, spec)

    return write_atomically(Path(path), write)


def write_atomically(path: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` on a sibling temporary directory, then move it to ``path`` (absent or empty)."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not an empty directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write(tmp)
        if path.exists():
            path.rmdir()
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_reference_model(path: str | os.PathLike) -> transformers.LlavaForConditionalGeneration:
    """``LlavaForConditionalGeneration.from_pretrained`` in the checkpoint's dtype, eager attention, eval mode."""
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype="auto", attn_implementation="eager")
    return model.eval()


BENCH_SPEC = TinySpec(
    vision="siglip", text="qwen3_moe", vision_hidden=256, vision_layers=4, vision_heads=4, vision_intermediate=1024,
    image_size=224, patch_size=14, vocab_size=8192, hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=2,
    head_dim=64, num_experts=16, top_k=2, moe_intermediate_size=256, intermediate_size=1024, dtype="float32",
)  # 53,896,192 parameters (test_bench_spec_parameter_count)


def make_bench_checkpoint(path: str | os.PathLike) -> Path:
    """Write the ``duet bench`` model (``BENCH_SPEC``, ~210 MB in float32) to ``path``."""
    return make_tiny_checkpoint(path, BENCH_SPEC)
