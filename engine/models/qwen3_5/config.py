"""Qwen3.5(-MoE) text configuration: the hybrid layer pattern and the Gated DeltaNet dimensions.

A Qwen3.5 text config (``qwen3_5_moe_text`` / ``qwen3_5_text``) is a Qwen3(-MoE) config plus:

* ``layer_types``: ``"linear_attention"`` (a Gated DeltaNet layer: causal conv + gated delta rule, per-sequence
  state, no KV) or ``"full_attention"`` (gated attention over the paged KV pool) per layer; absent, every
  ``full_attention_interval``-th layer (default 4) is full attention;
* ``linear_*``: the GDN head counts and sizes, and the conv kernel width (:class:`GdnConfig`);
* the attention output gate (``q_proj`` yields a gate per query channel), partial rotary M-RoPE
  (``partial_rotary_factor`` of each head rotates, 0.25 by default), zero-centred RMSNorm weights (``1 + w``);
* MoE layers: every layer sparse, plus a shared expert of ``shared_expert_intermediate_size`` behind a sigmoid gate.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import CheckpointError, UnsupportedModelError

QWEN35_MODELS = {"qwen3_5_moe": ("qwen3_5_moe_text", True), "qwen3_5": ("qwen3_5_text", False)}
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class GdnConfig:
    """Gated DeltaNet sizes. Per sequence and layer the state is a conv window ``[conv_dim, conv_kernel - 1]`` (model
    dtype) and a recurrent matrix ``[num_v_heads, k_head_dim, v_head_dim]`` (float32, as the reference keeps it)."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if min(self.num_k_heads, self.num_v_heads, self.k_head_dim, self.v_head_dim, self.conv_kernel) < 1:
            raise CheckpointError("linear attention sizes must be positive")
        if self.num_v_heads % self.num_k_heads:
            raise CheckpointError(f"linear_num_value_heads {self.num_v_heads} is not a multiple of "
                                  f"linear_num_key_heads {self.num_k_heads}")
        if self.conv_kernel < 2:
            raise UnsupportedModelError("linear_conv_kernel_dim must be >= 2")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the causal conv: q, k and v together."""
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, dtype_bytes: int) -> int:
        """One sequence's state in one GDN layer: conv window (model dtype) + recurrent matrix (float32)."""
        conv = self.conv_dim * (self.conv_kernel - 1) * dtype_bytes
        return conv + self.num_v_heads * self.k_head_dim * self.v_head_dim * 4


def layer_types(t: dict, n_layers: int) -> tuple[str, ...]:
    types = t.get("layer_types")
    if types is None:
        every = int(t.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
    types = tuple(str(x) for x in types)
    if len(types) != n_layers or any(x not in LAYER_TYPES for x in types):
        raise UnsupportedModelError(f"layer_types must name {n_layers} layers, each one of {LAYER_TYPES}")
    return types


def gdn_config(t: dict) -> GdnConfig:
    try:
        return GdnConfig(num_k_heads=int(t.get("linear_num_key_heads", 16)),
                         num_v_heads=int(t.get("linear_num_value_heads", 32)),
                         k_head_dim=int(t.get("linear_key_head_dim", 128)),
                         v_head_dim=int(t.get("linear_value_head_dim", 128)),
                         conv_kernel=int(t.get("linear_conv_kernel_dim", 4)))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"bad linear attention config value: {e}") from None


def base_text_dict(t: dict, *, sparse: bool) -> dict:
    """The Qwen3(-MoE) text config the rest of a Qwen3.5 config is parsed as: every layer sparse (MoE), the router
    renormalising its top-k weights, 1-D RoPE settings (M-RoPE is applied on top)."""
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    base = {**t, "model_type": "qwen3_moe" if sparse else "qwen3", "decoder_sparse_step": 1, "mlp_only_layers": [],
            "rope_parameters": {"rope_type": rope.get("rope_type", "default"),
                                "rope_theta": rope.get("rope_theta", t.get("rope_theta", 1e7))}}
    if sparse:
        base["norm_topk_prob"] = True
        base.setdefault("intermediate_size", t.get("moe_intermediate_size", 512))  # unused: no dense layer
    else:
        base.pop("num_experts", None), base.pop("num_local_experts", None)
    return base
