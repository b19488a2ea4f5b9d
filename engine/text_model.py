"""Decoder-only text model (Qwen3-MoE, Mixtral, Qwen3, Llama, Mistral, Qwen3-VL text) over the paged KV pool.

Input is a flat batch of tokens (see :mod:`engine.attention`); hidden states are ``[T, hidden]``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, LayerKV, paged_attention
from engine.layers import Linear, apply_rotary, rms_norm
from engine.moe import DenseMlp, SparseMoe
from engine.text_config import TextConfig



class Attention(nn.Module):
    """GQA self-attention. One GEMM yields q and k together (so the q/k norms and RoPE run once over all their
    heads), a second yields v; both outputs are contiguous."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.d, bias=cfg.attention_bias)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, bias=cfg.attention_bias)
        self.eps = cfg.rms_norm_eps
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(self.d))
            self.k_norm = nn.Parameter(torch.ones(self.d))
        self.scale = self.d ** -0.5

    def qk_norm_weight(self) -> torch.Tensor:
        """[h + kvh, d]: q_norm for the query heads, k_norm for the key heads."""
        return torch.cat([self.q_norm.expand(self.h, self.d), self.k_norm.expand(self.kvh, self.d)])

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kv: LayerKV) -> torch.Tensor:
        t = x.shape[0]
        qk = self._qk(x).view(t, self.h + self.kvh, self.d)
        v = self._v(x).view(t, self.kvh, self.d)
        if self.qk_norm:
            qk = rms_norm(qk, self._qk_w, self.eps)
        qk = apply_rotary(qk, *rope)
        o = paged_attention(qk[:, : self.h], qk[:, self.h:], v, kv, meta, self.scale)
        return self.o_proj(o.reshape(t, self.h * self.d))

    def finalize(self) -> None:
        """Precompute derived weights after loading: the q/k norm weights, and the q+k and v row blocks of the fused
        projection as F.linear calls (:meth:`pack_linears` may swap in packed kernels)."""
        if self.qk_norm:
            self._qk_w = self.qk_norm_weight().contiguous()
        qk, v = self._row_blocks()
        self._qk = functools.partial(F.linear, weight=qk[0], bias=qk[1])
        self._v = functools.partial(F.linear, weight=v[0], bias=v[1])

    def pack_linears(self, make) -> list:
        qk, v = self._row_blocks()
        self._qk, self._v = make(*qk), make(*v)
        return [self._qk, self._v]

    def _row_blocks(self) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        """((weight, bias) of the q+k rows, of the v rows) of the fused projection (views, no copies)."""
        nqk, w, b = (self.h + self.kvh) * self.d, self.qkv_proj.weight, self.qkv_proj.bias
        return (w[:nqk], None if b is None else b[:nqk]), (w[nqk:], None if b is None else b[nqk:])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp: nn.Module = SparseMoe(cfg) if cfg.moe_layers[layer_idx] else DenseMlp(cfg)
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.eps = cfg.rms_norm_eps

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kv: LayerKV) -> torch.Tensor:
        x = x + self.self_attn(rms_norm(x, self.input_layernorm, self.eps), rope, meta, kv)
        return x + self.mlp(rms_norm(x, self.post_attention_layernorm, self.eps))


class TextModel(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, embeds: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kv_cache: list[LayerKV], deepstack: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``deepstack`` = (token rows [M], features [L, M, H]): level i is added to those rows after layer i."""
        x = embeds
        for i, (layer, kv) in enumerate(zip(self.layers, kv_cache, strict=True)):
            x = layer(x, rope, meta, kv)
            if deepstack is not None and i < deepstack[1].shape[0]:
                x = x.index_add(0, deepstack[0], deepstack[1][i])
            if meta.on_layer is not None:
                meta.on_layer(i)
        return x

    def finalize(self) -> None:
        """Precompute derived weights after loading."""
        for layer in self.layers:
            layer.self_attn.finalize()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the selected rows, returned in float32."""
        return self.lm_head(rms_norm(hidden, self.norm, self.cfg.rms_norm_eps)).float()

    def moe_counts(self) -> torch.Tensor:
        """[num_layers, num_experts] tokens routed to each expert since the last reset (0 rows for dense layers)."""
        e = max(self.cfg.num_experts, 1)
        rows = [m.mlp.expert_counts if isinstance(m.mlp, SparseMoe) else torch.zeros(e, dtype=torch.int64,
                device=self.norm.device) for m in self.layers]
        return torch.stack(rows)

    def reset_moe_counts(self) -> None:
        for m in self.layers:
            if isinstance(m.mlp, SparseMoe):
                m.mlp.expert_counts.zero_()
