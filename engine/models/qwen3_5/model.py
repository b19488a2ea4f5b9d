"""Qwen3.5(-MoE) text decoder: Gated DeltaNet layers interleaved with gated full attention, shared-expert MoE.

Same contract as :class:`engine.text_model.TextModel` (a flat batch of tokens, hidden ``[T, hidden]``), except that
the per-layer cache list holds a :class:`engine.attention.LayerKV` for each full-attention layer and a
:class:`engine.state_cache.LayerState` for each GDN layer; ``AttentionMetadata.state`` says which state slot each
prefill span and decode row uses. A span whose sequence has nothing computed yet starts from zero state; any later
span (the next prefill chunk, or a decode) continues from its slot.

Numerics follow transformers' ``Qwen3_5Moe*`` classes: zero-centred RMSNorm ``x * (1 + w)`` in float32, cast last;
the GDN output norm ``w * norm(x)`` cast, then times ``silu(gate)`` in float32; RoPE on the first ``rotary_dim``
channels of each head only.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, LayerKV, paged_attention
from engine.layers import Linear, apply_rotary
from engine.models.qwen3_5.gdn import causal_conv, causal_conv_step, chunked_delta_rule, prepare_qk, recurrent_step
from engine.moe import DenseMlp, SparseMoe
from engine.state_cache import LayerState
from engine.text_config import TextConfig
from engine.text_model import TextModel


def offset_rms_norm(x: torch.Tensor, w1: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with a zero-centred weight: ``w1 = 1 + w`` in float32 (precomputed at load)."""
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * w1).to(x.dtype)


class GatedAttention(nn.Module):
    """GQA attention whose output is gated per channel by ``sigmoid`` of a second half of ``q_proj``; q/k norms;
    partial rotary. ``qkv_proj`` rows: per query head ``[query D, gate D]``, then K, then V (the loader's q/k/v
    concatenation of the checkpoint's ``q_proj`` / ``k_proj`` / ``v_proj``)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.h, self.kvh, self.d, self.r = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_dim
        self.qkv_proj = Linear(cfg.hidden_size, (2 * self.h + 2 * self.kvh) * self.d, bias=cfg.attention_bias)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm, self.k_norm = nn.Parameter(torch.zeros(self.d)), nn.Parameter(torch.zeros(self.d))
        self.eps, self.scale = cfg.rms_norm_eps, self.d ** -0.5

    def _rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.r == self.d:
            return apply_rotary(x, *rope)
        return torch.cat([apply_rotary(x[..., : self.r], *rope), x[..., self.r:]], dim=-1)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kv: LayerKV) -> torch.Tensor:
        t, hd, kd = x.shape[0], self.h * self.d, self.kvh * self.d
        out = self.qkv_proj(x)
        qg = out[:, : 2 * hd].view(t, self.h, 2 * self.d)
        q, gate = qg[..., : self.d], qg[..., self.d:].reshape(t, hd)
        k = out[:, 2 * hd: 2 * hd + kd].view(t, self.kvh, self.d)
        v = out[:, 2 * hd + kd:].reshape(t, self.kvh, self.d)
        q = self._rotate(offset_rms_norm(q, self._q_w1, self.eps), rope)
        k = self._rotate(offset_rms_norm(k, self._k_w1, self.eps), rope)
        o = paged_attention(q.contiguous(), k.contiguous(), v, kv, meta, self.scale).reshape(t, hd)
        return self.o_proj(o * torch.sigmoid(gate))

    def finalize(self) -> None:
        self._q_w1, self._k_w1 = 1.0 + self.q_norm.float(), 1.0 + self.k_norm.float()


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Linear-attention token mixer (parameter names as transformers' ``Qwen3_5MoeGatedDeltaNet``)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        g = cfg.gdn
        assert g is not None
        self.g = g
        self.in_proj_qkv = Linear(cfg.hidden_size, g.conv_dim, bias=False)
        self.in_proj_z = Linear(cfg.hidden_size, g.value_dim, bias=False)
        self.in_proj_b = Linear(cfg.hidden_size, g.num_v_heads, bias=False)
        self.in_proj_a = Linear(cfg.hidden_size, g.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(g.conv_dim, g.conv_dim, g.conv_kernel, groups=g.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(g.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(g.num_v_heads))
        self.norm = GatedRMSNorm(g.v_head_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(g.value_dim, cfg.hidden_size, bias=False)

    def _split(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g, lead = self.g, y.shape[:-1]
        q, k, v = y.split([g.key_dim, g.key_dim, g.value_dim], dim=-1)
        q, k = prepare_qk(q.reshape(*lead, g.num_k_heads, g.k_head_dim), k.reshape(*lead, g.num_k_heads, g.k_head_dim),
                          g.num_v_heads)
        return q, k, v.reshape(*lead, g.num_v_heads, g.v_head_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                st: LayerState) -> torch.Tensor:
        g, t = self.g, x.shape[0]
        mixed = self.in_proj_qkv(x)
        beta = torch.sigmoid(self.in_proj_b(x))
        decay = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        weight = self.conv1d.weight.squeeze(1)
        core = x.new_empty(t, g.num_v_heads, g.v_head_dim)
        step = meta.state
        assert step is not None, "a hybrid model's step needs AttentionMetadata.state"
        for i, (span, slot) in enumerate(zip(meta.prefills, step.prefill_slots, strict=True)):
            fresh = span.context_len == span.length
            window = torch.zeros_like(st.conv[slot]) if fresh else st.conv[slot]
            state = None if fresh else st.recurrent[slot]
            cuts = step.prefill_snapshots[i] if step.prefill_snapshots else []
            done = 0  # the span runs in pieces that end where a snapshot of the state is kept (a prefix cache's)
            for end, snap in [*cuts, (span.length, None)]:
                if end > done:
                    s, e = span.start + done, span.start + end
                    y, window = causal_conv(mixed[s:e], window, weight)
                    q, k, v = self._split(y)
                    o, state = chunked_delta_rule(q, k, v, decay[s:e], beta[s:e], state)
                    core[s:e] = o.to(core.dtype)
                    done = end
                if snap is not None:
                    st.conv[snap], st.recurrent[snap] = window, state
            st.conv[slot], st.recurrent[slot] = window, state
        p = meta.num_prefill_tokens
        if step.decode_slots is not None and p < t:
            slots = step.decode_slots
            y, windows = causal_conv_step(mixed[p:], st.conv.index_select(0, slots), weight)
            st.conv.index_copy_(0, slots, windows)
            q, k, v = self._split(y)
            o, states = recurrent_step(q, k, v, decay[p:], beta[p:], st.recurrent.index_select(0, slots))
            st.recurrent.index_copy_(0, slots, states)
            core[p:] = o.to(core.dtype)
        z = self.in_proj_z(x).view(t, g.num_v_heads, g.v_head_dim)
        return self.out_proj(self.norm(core, z).reshape(t, g.value_dim))


class SharedExpertMoe(SparseMoe):
    """Routed experts (or the expert-parallel executor) plus a shared expert every token passes through, scaled by
    ``sigmoid(shared_expert_gate(x))``. The shared expert always runs here, on every worker."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__(cfg)
        self.weights_in_model_dtype = True  # the router casts top-k weights to the model dtype
        self.shared_expert = DenseMlp(dataclasses.replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size))
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.is_gdn = cfg.layer_types[layer_idx] == "linear_attention"
        if self.is_gdn:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        if cfg.moe_layers[layer_idx]:
            self.mlp: nn.Module = SharedExpertMoe(cfg) if cfg.shared_expert_intermediate_size else SparseMoe(cfg)
        else:
            self.mlp = DenseMlp(cfg)
        self.input_layernorm = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.eps = cfg.rms_norm_eps

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                cache: LayerKV | LayerState) -> torch.Tensor:
        mixer = self.linear_attn if self.is_gdn else self.self_attn
        x = x + mixer(offset_rms_norm(x, self._in_w1, self.eps), rope, meta, cache)
        return x + self.mlp(offset_rms_norm(x, self._post_w1, self.eps))

    def finalize(self) -> None:
        self._in_w1 = 1.0 + self.input_layernorm.float()
        self._post_w1 = 1.0 + self.post_attention_layernorm.float()
        if not self.is_gdn:
            self.self_attn.finalize()


class HybridTextModel(TextModel):
    """Qwen3.5's decoder; parameter names are the checkpoint's (``layers.N.linear_attn.*`` / ``self_attn.*``)."""

    def __init__(self, cfg: TextConfig) -> None:
        nn.Module.__init__(self)
        self.cfg = cfg
        # weights given: no random init (on the meta device it imports torch._dynamo: a second at start-up)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(offset_rms_norm(hidden, self._norm_w1, self.cfg.rms_norm_eps)).float()

    def finalize(self) -> None:
        self._norm_w1 = 1.0 + self.norm.float()
        for layer in self.layers:
            layer.finalize()
