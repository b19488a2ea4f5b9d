"""The text decoder's configuration (:class:`TextConfig`) and the parser of the plain decoder families.

:func:`parse_decoder_config` reads a Hugging Face text ``config.json`` of one of :data:`DECODER_MODELS` (Qwen3-MoE,
Mixtral, Qwen3, Llama, Mistral): the decoder :class:`engine.text_model.TextModel` runs. The families under
:mod:`engine.models` that wrap such a decoder (Qwen3-VL's M-RoPE text model, Qwen3.5's hybrid) parse their text
configs as one of these first and then add their own fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import CheckpointError, UnsupportedModelError
from engine.models.qwen3_5.config import GdnConfig

DECODER_MODELS = ("qwen3_moe", "mixtral", "qwen3", "llama", "mistral")
SUPPORTED_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "gelu_new", "quick_gelu", "silu", "relu")


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
    # Qwen3.5 hybrids (engine.models.qwen3_5.config): per-layer "linear_attention" / "full_attention" (empty: all full)
    layer_types: tuple[str, ...] = ()
    gdn: GdnConfig | None = None
    shared_expert_intermediate_size: int = 0  # > 0: every MoE block adds a gated shared expert
    attn_output_gate: bool = False  # q_proj also yields a sigmoid gate on the attention output
    rotary_dim: int = 0  # channels of each head that RoPE rotates (partial rotary); 0: head_dim
    # the router casts its top-k weights back to the model dtype (Qwen3-MoE and Qwen3-VL-MoE, as transformers does)
    router_weights_in_model_dtype: bool = False

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


def as_tuple(x: int | list[int] | None) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, list | tuple) else (int(x),)


def check_act(name: str, what: str) -> str:
    if name not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(f"unsupported {what} activation {name!r} (supported: {SUPPORTED_ACTIVATIONS})")
    return name


def parse_decoder_config(t: dict) -> TextConfig:
    """A text config whose ``model_type`` is one of :data:`DECODER_MODELS`."""
    mt = t.get("model_type")
    if mt not in DECODER_MODELS:
        raise UnsupportedModelError(f"unsupported text model_type {mt!r} (supported: {', '.join(DECODER_MODELS)})")
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
            hidden_act=check_act(t.get("hidden_act", "silu"), "text"),
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
            attention_bias=bool(t.get("attention_bias", False)), qk_norm=mt in ("qwen3", "qwen3_moe"),
            num_experts=n_exp, top_k=int(t.get("num_experts_per_tok", 0) or 0), moe_intermediate_size=moe_inter,
            norm_topk_prob=True if mt == "mixtral" else bool(t.get("norm_topk_prob", False)),
            moe_layers=moe_layers, sliding_window=int(sliding) if sliding else None,
            router_weights_in_model_dtype=mt == "qwen3_moe",
        )
    except KeyError as e:
        raise CheckpointError(f"text config is missing {e.args[0]!r}") from None
