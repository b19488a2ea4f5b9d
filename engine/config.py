"""Model and engine configuration.

:class:`ModelConfig` is parsed from a Hugging Face LLaVA ``config.json`` and validated on construction: anything the
engine cannot run exactly as the reference does is rejected with :class:`UnsupportedModelError` before any weight is
read. :class:`EngineConfig` holds the serving knobs (dtype, KV pool size, batching limits).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.errors import CheckpointError, UnsupportedModelError
from engine.qwen35_config import QWEN35_MODELS, GdnConfig, base_text_dict, gdn_config, layer_types
from engine.qwen_vision import QwenVisionConfig
from engine.scheduler import POLICIES

SUPPORTED_TEXT_MODELS = ("qwen3_moe", "mixtral", "qwen3", "llama", "mistral")
# Qwen3-VL families: (text config model_type, whether its layers may be sparse)
QWEN_VL_MODELS = {"qwen3_vl_moe": ("qwen3_vl_moe_text", True), "qwen3_vl": ("qwen3_vl_text", False)}
SUPPORTED_VISION_MODELS = ("siglip_vision_model", "clip_vision_model")
SUPPORTED_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "gelu_new", "quick_gelu", "silu", "relu")
logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class VisionConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def has_cls_token(self) -> bool:
        return self.model_type == "clip_vision_model"

    @property
    def num_positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + int(self.has_cls_token)


@dataclass(frozen=True)
class TextConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    hidden_act: str
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]
    sliding_window: int | None
    mrope_section: tuple[int, int, int] | None = None  # interleaved M-RoPE (Qwen3-VL); None: 1-D RoPE
    # Qwen3.5 hybrids (engine.qwen35_config): per-layer "linear_attention" / "full_attention" (empty: all full)
    layer_types: tuple[str, ...] = ()
    gdn: GdnConfig | None = None
    shared_expert_intermediate_size: int = 0  # > 0: every MoE block adds a gated shared expert
    attn_output_gate: bool = False  # q_proj also yields a sigmoid gate on the attention output
    rotary_dim: int = 0  # channels of each head that RoPE rotates (partial rotary); 0: head_dim

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def is_hybrid(self) -> bool:
        """Some layers are Gated DeltaNet layers: they keep a per-sequence state instead of KV."""
        return self.gdn is not None

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Decoder layers with a KV cache (every layer unless the model is hybrid)."""
        if not self.layer_types:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def state_layers(self) -> tuple[int, ...]:
        """Decoder layers with a per-sequence recurrent state (GDN)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token over every KV layer (the paged pool's and the wire's unit)."""
        return 2 * len(self.kv_layers) * self.num_kv_heads * self.head_dim * torch.finfo(dtype).bits // 8

    def state_bytes_per_seq(self, dtype: torch.dtype) -> int:
        """One sequence's GDN state over every state layer (0 for models without them)."""
        if self.gdn is None:
            return 0
        return len(self.state_layers) * self.gdn.state_bytes(torch.finfo(dtype).bits // 8)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime needs to know about a checkpoint: the LLaVA architecture (``family == "llava"``, a
    fixed number of visual tokens per image) or a Qwen3-VL family (``"qwen3_vl"``, Qwen3.5 too: native-resolution
    vision, the visual-token count follows each image's grid, M-RoPE, DeepStack; Qwen3.5's hybrid text model is
    ``TextConfig.is_hybrid``)."""

    text: TextConfig
    vision: VisionConfig | QwenVisionConfig | None
    image_token_index: int | None
    image_seq_length: int
    vision_feature_layers: tuple[int, ...]
    vision_feature_select_strategy: str
    projector_hidden_act: str
    projector_bias: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    family: str = "llava"
    vision_start_token_id: int | None = None  # qwen3_vl: <|vision_start|> (precedes each image's placeholders)
    vision_end_token_id: int | None = None
    video_token_id: int | None = None
    expert_layout_hint: str = "hf"  # qwen3_vl_moe fused experts when shapes cannot tell: "hf" or "published"

    @property
    def is_qwen_vl(self) -> bool:
        return self.family == "qwen3_vl"

    @property
    def num_deepstack_levels(self) -> int:
        return len(self.vision.deepstack_visual_indexes) if isinstance(self.vision, QwenVisionConfig) else 0

    @property
    def tokens_per_image(self) -> int:
        """Number of placeholder tokens (and projected features) one image expands to (LLaVA; a Qwen3-VL image's
        count follows its grid: ``QwenVisionConfig.tokens_for_grid``)."""
        assert isinstance(self.vision, VisionConfig), "only LLaVA checkpoints have a fixed number of tokens per image"
        drop = 1 if self.vision_feature_select_strategy == "default" else 0
        return self.vision.num_positions - drop

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        if not path.is_dir():
            raise CheckpointError(f"model directory not found: {path}")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"no config.json in {path}")
        try:
            raw = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot parse {cfg_file}: {e}") from None
        gen = _read_optional_json(path / "generation_config.json")
        return parse_config(raw, gen)


def _read_optional_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot parse {file}: {e}") from None


def _as_tuple(x: int | list[int] | None) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, list | tuple) else (int(x),)


def _check_act(name: str, what: str) -> str:
    if name not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(f"unsupported {what} activation {name!r} (supported: {SUPPORTED_ACTIVATIONS})")
    return name


def parse_text_config(t: dict) -> TextConfig:
    mt = t.get("model_type")
    if mt in {text for text, _ in QWEN_VL_MODELS.values()}:
        return _parse_qwen_vl_text(t, sparse=mt == "qwen3_vl_moe_text")
    if mt in {text for text, _ in QWEN35_MODELS.values()}:
        return _parse_qwen35_text(t, sparse=mt == "qwen3_5_moe_text")
    if mt not in SUPPORTED_TEXT_MODELS:
        raise UnsupportedModelError(f"unsupported text model_type {mt!r} (supported: {', '.join(SUPPORTED_TEXT_MODELS)})")
    try:
        hidden, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
        n_layers = int(t["num_hidden_layers"])
        rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedModelError(f"unsupported rope_type {rope_type!r} (only 'default' RoPE)")
        theta = float(rope.get("rope_theta", t.get("rope_theta", 10000.0)))
        n_exp = int(t.get("num_experts", t.get("num_local_experts", 0)) or 0)
        if mt == "qwen3_moe":
            step, only = int(t.get("decoder_sparse_step", 1)), set(t.get("mlp_only_layers") or [])
            moe_layers = tuple(i not in only and n_exp > 0 and (i + 1) % step == 0 for i in range(n_layers))
        else:
            moe_layers = tuple(mt == "mixtral" and n_exp > 0 for _ in range(n_layers))
        moe_inter = int(t.get("moe_intermediate_size") or t["intermediate_size"]) if mt == "qwen3_moe" else int(
            t["intermediate_size"])
        sliding = t.get("sliding_window") if t.get("use_sliding_window", mt in ("mistral", "mixtral")) else None
        return TextConfig(
            model_type=mt, vocab_size=int(t["vocab_size"]), hidden_size=hidden, num_layers=n_layers,
            num_heads=heads, num_kv_heads=int(t.get("num_key_value_heads") or heads),
            head_dim=int(t.get("head_dim") or hidden // heads), intermediate_size=int(t["intermediate_size"]),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            max_position_embeddings=int(t.get("max_position_embeddings", 4096)),
            hidden_act=_check_act(t.get("hidden_act", "silu"), "text"),
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
            attention_bias=bool(t.get("attention_bias", False)), qk_norm=mt in ("qwen3", "qwen3_moe"),
            num_experts=n_exp, top_k=int(t.get("num_experts_per_tok", 0) or 0), moe_intermediate_size=moe_inter,
            norm_topk_prob=True if mt == "mixtral" else bool(t.get("norm_topk_prob", False)),
            moe_layers=moe_layers, sliding_window=int(sliding) if sliding else None,
        )
    except KeyError as e:
        raise CheckpointError(f"text config is missing {e.args[0]!r}") from None


def _parse_qwen_vl_text(t: dict, *, sparse: bool) -> TextConfig:
    """A Qwen3-VL text config: Qwen3(-MoE) layers with interleaved M-RoPE. Its router always renormalises the top-k
    weights and casts them to the model dtype (transformers' ``Qwen3VLMoeTextTopKRouter``)."""
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError(f"unsupported rope_type {rope_type!r} (only 'default' M-RoPE)")
    if not rope.get("mrope_interleaved", True):
        raise UnsupportedModelError("only interleaved M-RoPE (mrope_interleaved: true) is supported")
    section = tuple(int(x) for x in rope.get("mrope_section", (24, 20, 20)))
    base = {**t, "model_type": "qwen3_moe" if sparse else "qwen3", "rope_parameters": {
        "rope_type": "default", "rope_theta": rope.get("rope_theta", t.get("rope_theta", 5e5))}}
    if sparse:
        base["norm_topk_prob"] = True
    else:
        base.pop("num_experts", None), base.pop("num_local_experts", None)
    cfg = parse_text_config(base)
    half = cfg.head_dim // 2
    if len(section) != 3 or sum(section) != half:
        raise UnsupportedModelError(f"mrope_section {list(section)} must have 3 entries summing to head_dim/2 = {half}")
    return dataclasses.replace(cfg, model_type=t["model_type"], mrope_section=section)  # type: ignore[arg-type]


def _parse_qwen35_text(t: dict, *, sparse: bool) -> TextConfig:
    """A Qwen3.5 text config (:mod:`engine.qwen35_config`): hybrid GDN / gated-attention layers, partial M-RoPE."""
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    if not rope.get("mrope_interleaved", True):
        raise UnsupportedModelError("only interleaved M-RoPE (mrope_interleaved: true) is supported")
    if t.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"Qwen3.5 with hidden_act {t.get('hidden_act')!r} (only silu)")
    cfg = parse_text_config(base_text_dict(t, sparse=sparse))
    rotary = int(cfg.head_dim * float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))))
    section = tuple(int(x) for x in rope.get("mrope_section", (11, 11, 10)))
    if rotary % 2 or not 0 < rotary <= cfg.head_dim or len(section) != 3 or 2 * sum(section) != rotary:
        raise UnsupportedModelError(f"mrope_section {list(section)} must have 3 entries summing to the rotary "
                                    f"dim / 2 = {rotary // 2}")
    shared = int(t.get("shared_expert_intermediate_size", 0) or 0) if sparse else 0
    return dataclasses.replace(cfg, model_type=t["model_type"], mrope_section=section, qk_norm=True,  # type: ignore[arg-type]
                               layer_types=layer_types(t, cfg.num_layers), gdn=gdn_config(t),
                               shared_expert_intermediate_size=shared, attn_output_gate=True, rotary_dim=rotary)


def parse_vision_config(v: dict) -> VisionConfig:
    mt = v.get("model_type")
    if mt not in SUPPORTED_VISION_MODELS:
        raise UnsupportedModelError(f"unsupported vision model_type {mt!r} (supported: {', '.join(SUPPORTED_VISION_MODELS)})")
    default_act = "quick_gelu" if mt == "clip_vision_model" else "gelu_pytorch_tanh"
    try:
        return VisionConfig(
            model_type=mt, hidden_size=int(v["hidden_size"]), intermediate_size=int(v["intermediate_size"]),
            num_layers=int(v["num_hidden_layers"]), num_heads=int(v["num_attention_heads"]),
            image_size=int(v["image_size"]), patch_size=int(v["patch_size"]),
            num_channels=int(v.get("num_channels", 3)), layer_norm_eps=float(v.get("layer_norm_eps", 1e-5 if mt == "clip_vision_model" else 1e-6)),
            hidden_act=_check_act(v.get("hidden_act", default_act), "vision"),
        )
    except KeyError as e:
        raise CheckpointError(f"vision config is missing {e.args[0]!r}") from None


def parse_config(raw: dict, generation_config: dict | None = None) -> ModelConfig:
    """Parse a ``config.json`` dict (``model_type`` ``llava``, or a bare supported text model)."""
    mt = raw.get("model_type")
    if mt in QWEN_VL_MODELS or mt in QWEN35_MODELS:
        return _parse_qwen_vl(raw, generation_config or {})
    if mt == "llava":
        text = parse_text_config(raw.get("text_config") or {})
        vision = parse_vision_config(raw.get("vision_config") or {})
    elif mt in SUPPORTED_TEXT_MODELS:
        text, vision = parse_text_config(raw), None
    else:
        raise UnsupportedModelError(f"unsupported model_type {mt!r} (supported: llava, "
                                    f"{', '.join([*QWEN_VL_MODELS, *QWEN35_MODELS])}, "
                                    f"{', '.join(SUPPORTED_TEXT_MODELS)})")
    layers = _as_tuple(raw.get("vision_feature_layer", -2))
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise UnsupportedModelError(f"unsupported vision_feature_select_strategy {strategy!r}")
    if vision is not None:
        for layer in layers:
            if not -(vision.num_layers + 1) <= layer <= vision.num_layers:
                raise CheckpointError(f"vision_feature_layer {layer} out of range for {vision.num_layers} layers")
    gen = generation_config or {}
    eos = _as_tuple(gen.get("eos_token_id")) or _as_tuple((raw.get("text_config") or raw).get("eos_token_id")) or _as_tuple(raw.get("eos_token_id"))
    cfg = ModelConfig(
        text=text, vision=vision,
        image_token_index=raw.get("image_token_index", raw.get("image_token_id")) if vision else None,
        image_seq_length=int(raw.get("image_seq_length", 0) or 0), vision_feature_layers=layers,
        vision_feature_select_strategy=strategy,
        projector_hidden_act=_check_act(raw.get("projector_hidden_act", "gelu"), "projector"),
        projector_bias=bool(raw.get("multimodal_projector_bias", True)), eos_token_ids=eos,
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or (raw.get("text_config") or {}).get("dtype") or "float32"),
    )
    if vision is not None and cfg.image_seq_length and cfg.image_seq_length != cfg.tokens_per_image:
        logger.warning("config image_seq_length %d differs from the %d features the vision tower yields per image; "
                       "using %d", cfg.image_seq_length, cfg.tokens_per_image, cfg.tokens_per_image)
    return cfg


def _parse_qwen_vl(raw: dict, gen: dict) -> ModelConfig:
    mt = raw["model_type"]
    text_type, _ = {**QWEN_VL_MODELS, **QWEN35_MODELS}[mt]
    t = dict(raw.get("text_config") or {})
    if t.get("model_type", text_type) != text_type:
        raise UnsupportedModelError(f"{mt} checkpoint with text model_type {t.get('model_type')!r} (expected {text_type})")
    t["model_type"] = text_type
    # the top-level flag governs the conditional-generation model's lm_head (transformers 5)
    t["tie_word_embeddings"] = raw.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    text = parse_text_config(t)
    # Qwen3.5's tower is Qwen3-VL's without DeepStack
    vision = QwenVisionConfig.from_dict({"deepstack_visual_indexes": [], **(raw.get("vision_config") or {})})
    if vision.out_hidden_size != text.hidden_size:
        raise CheckpointError(f"vision out_hidden_size {vision.out_hidden_size} != text hidden_size {text.hidden_size}")
    if len(vision.deepstack_visual_indexes) > text.num_layers:
        raise CheckpointError("more DeepStack levels than decoder layers")
    ids = {k: raw.get(k) for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    if ids["image_token_id"] is None:
        raise CheckpointError(f"{mt} config has no image_token_id")
    eos = _as_tuple(gen.get("eos_token_id")) or _as_tuple(t.get("eos_token_id")) or _as_tuple(raw.get("eos_token_id"))
    version = str(raw.get("transformers_version") or "")
    return ModelConfig(
        text=text, vision=vision, image_token_index=int(ids["image_token_id"]), image_seq_length=0,
        vision_feature_layers=(), vision_feature_select_strategy="full", projector_hidden_act="gelu",
        projector_bias=True, eos_token_ids=eos,
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or t.get("dtype") or "float32"),
        family="qwen3_vl", vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"], video_token_id=ids["video_token_id"],
        # released checkpoints (written before transformers 5) store fused experts as [E, H, 2I] / [E, I, H]
        expert_layout_hint="hf" if version[:1].isdigit() and int(version.split(".")[0]) >= 5 else "published",
    )


@dataclass
class EngineConfig:
    """Serving knobs. Validated on construction; see the README for defaults."""

    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    vision_cache_size: int = 64
    # decode staging (engine.decode_mirror) reserved at start for max_num_seqs sequences of this many tokens; None:
    # grown on demand (each growth copies it: ~0.1 s at 16 -> 32 sequences of 2048 tokens, a stall of every decode)
    decode_mirror_tokens: int | None = None
    # hybrid models (Qwen3.5): sequences that can hold a GDN state slot at once (running, prefilling or receiving a
    # transfer); None: max_num_seqs. Its memory comes off kv_cache_memory_gb before the KV pool is sized.
    max_num_state_slots: int | None = None
    scheduling_policy: str = "fcfs"  # admission order: "fcfs" or "shortest" (engine.scheduler)
    scheduling_max_wait_s: float = 10.0  # "shortest": a prompt waiting this long goes first
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.max_num_state_slots is not None and self.max_num_state_slots < 1:
            raise ValueError("max_num_state_slots must be >= 1 (or None)")
        if self.decode_mirror_tokens is not None and self.decode_mirror_tokens < 1:
            raise ValueError("decode_mirror_tokens must be >= 1 (or None)")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {list(POLICIES)}, got {self.scheduling_policy!r}")
        if not self.scheduling_max_wait_s > 0:
            raise ValueError("scheduling_max_wait_s must be > 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")

    def torch_dtype(self, model: ModelConfig) -> torch.dtype:
        name = model.torch_dtype if self.dtype == "auto" else self.dtype
        return DTYPES.get(name, torch.float32)
