"""Decoder-only text model (Qwen3-MoE, Mixtral, Qwen3, Llama, Mistral, Qwen3-VL text) over the paged KV pool.

Input is a flat batch of tokens (see :mod:`engine.attention`); hidden states are ``[T, hidden]``.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F
from torch import nn

import engine.cpu_kernels as cpu_kernels
import engine.tuning_cache as tuning_cache
from engine.cpu_linear import choose_tile_rows
from engine.attention import AttentionMetadata, DecodeBatch, LayerKV, choose_prefill_kernel, paged_attention
from engine.layers import Linear, apply_rotary, rms_norm
from engine.moe import DenseMlp, SparseMoe
from engine.text_config import TextConfig


def _f32_kernels(*tensors: torch.Tensor):
    """The compiled kernels when every tensor is contiguous float32 on CPU (their fused element-wise passes), else
    None."""
    if all(cpu_kernels.usable(t) for t in tensors):
        return cpu_kernels.library()
    return None


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
        self.prefill_from = 0  # prompt chunks of this many tokens attend through the compiled kernel (pack_linears)

    def qk_norm_weight(self) -> torch.Tensor:
        """[h + kvh, d]: q_norm for the query heads, k_norm for the key heads."""
        return torch.cat([self.q_norm.expand(self.h, self.d), self.k_norm.expand(self.kvh, self.d)])

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kv: LayerKV) -> torch.Tensor:
        t = x.shape[0]
        qk = self._qk(x).view(t, self.h + self.kvh, self.d)
        v = self._v(x).view(t, self.kvh, self.d)
        lib = _f32_kernels(qk, *rope)
        if lib is not None and rope[0].shape[-1] == self.d:  # norm and rotary in one pass, in place
            cpu_kernels.norm_rope(lib, qk, self._qk_w if self.qk_norm else None, self.eps, *rope)
        else:
            if self.qk_norm:
                qk = rms_norm(qk, self._qk_w, self.eps)
            qk = apply_rotary(qk, *rope)
        o = paged_attention(qk[:, : self.h], qk[:, self.h:], v, kv, meta, self.scale, self.prefill_from)
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
        """CPU kernel choice (:func:`engine.cpu_linear.pack_linears`): the projections' kernels, and from which
        prompt-chunk length the compiled prefill attention runs (measured; in ``auto`` mode only)."""
        qk, v = self._row_blocks()
        self._qk, self._v = make(*qk), make(*v)
        if make.mode == "auto" and self.qkv_proj.weight.dtype == torch.float32:
            self.prefill_from = choose_prefill_kernel(self.h, self.kvh, self.d)
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
        self.one_call = False  # the one-call path may run here (pack_linears) ...
        self.layer_call_upto = 0  # ... on decode steps of up to this many sequences (TextModel.choose_one_call)
        # (the experts' weight it was bound with, the one-call path's arguments or None where it cannot run)
        self._one_call_args: tuple[torch.Tensor | None, dict | None] | None = None

    def pack_linears(self, make) -> list:
        """CPU kernel choice (:func:`engine.cpu_linear.pack_linears`): in ``auto`` mode the layer's decode steps may
        go through :meth:`_decode_step` (up to the batch :meth:`TextModel.choose_one_call` measures); ``packed``
        (every linear through oneDNN) and ``native`` (no hook is called) keep the module path."""
        self.one_call = make.mode == "auto"
        return []

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                kv: LayerKV) -> torch.Tensor:
        dec = meta.decode
        if dec is not None and x.shape[0] <= self.layer_call_upto and not meta.prefills \
                and dec.layer_masks is None:
            y = self._decode_step(x, rope, meta, kv)
            if y is not None:
                return y
        a = self.self_attn(rms_norm(x, self.input_layernorm, self.eps), rope, meta, kv)
        lib = _f32_kernels(x, a, self.post_attention_layernorm)
        if lib is not None:  # the residual add and the second norm in one pass
            x, h = cpu_kernels.add_rms_norm(lib, x, a, self.post_attention_layernorm, self.eps)
        else:
            x = x + a
            h = rms_norm(x, self.post_attention_layernorm, self.eps)
        return x + self.mlp(h)

    def _decode_step(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                     kv: LayerKV) -> torch.Tensor | None:
        """The layer in one compiled call (:func:`engine.cpu_kernels.decode_layer`) for a decode-only step of a few
        sequences in float32 on CPU, where each of the ~20 ops of the module path would cost more in dispatch and
        cold caches than in arithmetic; None where it does not apply (the module path runs)."""
        mlp = self.mlp
        moe = isinstance(mlp, SparseMoe)
        if moe and (mlp.executor is not None or mlp.record_routing or x.shape[0] > mlp.one_call_upto):
            return None
        key = mlp.kernel_experts()[0] if moe else None  # replaced when the experts move (the binding is redone)
        bound = self._one_call_args
        if bound is None or bound[0] is not key:
            bound = self._one_call_args = (key, self._bind_one_call())
        args = bound[1]
        cos, sin = rope
        if args is None or cos.shape[-1] != args["head_dim"]:
            return None
        lib = _f32_kernels(x, cos, sin, kv.mirror_k, kv.mirror_v, kv.k, kv.v)
        if lib is None:
            return None
        dec = meta.decode
        return cpu_kernels.decode_layer(lib, x, cos=cos, sin_signed=sin, mirror=(kv.mirror_k, kv.mirror_v),
                                        slots=dec.slots, pos=dec.write_pos, max_len=dec.max_len,
                                        pool=(kv.k, kv.v, meta.slot_mapping), coded=dec.coded, **args)

    def _bind_one_call(self) -> dict | None:
        """The one-call path's per-layer arguments (weights, shapes), checked once: None where the layer cannot take
        it (not a SwiGLU MLP or routed experts, or a weight the kernels cannot read as it is)."""
        attn, mlp = self.self_attn, self.mlp
        panel = False
        if isinstance(mlp, SparseMoe):
            (gate_up, down, panel), router = mlp.kernel_experts(), mlp.gate.weight
        elif mlp.silu:
            gate_up, down, router = mlp.gate_up_proj.weight, mlp.down_proj.weight, None
        else:
            return None
        qkv, o = attn.qkv_proj, attn.o_proj
        qk_w = attn._qk_w if attn.qk_norm else None
        weights = (qkv.weight, o.weight, gate_up, down, self.input_layernorm, self.post_attention_layernorm, router,
                   qkv.bias, o.bias, qk_w)
        if _f32_kernels(*(t for t in weights if t is not None)) is None:
            return None
        return dict(eps=self.eps, ln1=self.input_layernorm, ln2=self.post_attention_layernorm, wqkv=qkv.weight,
                    bqkv=qkv.bias, heads=attn.h, kv_heads=attn.kvh, head_dim=attn.d, qk_norm=qk_w, scale=attn.scale,
                    wo=o.weight, bo=o.bias, gate_up=gate_up, down=down, router=router,
                    top_k=getattr(mlp, "top_k", 1), norm_topk=getattr(mlp, "norm_topk_prob", False),
                    counts=getattr(mlp, "expert_counts", None), panel=panel)


ONE_CALL_PROBES = (1, 4, 8, 16, 32, 64)  # decode batch sizes the one-call layer is timed at (it stops at a loss)
ONE_CALL_LAYERS = 4  # layers a probe runs (each probe a step through them; every layer of a model has one shape)
# (config shapes, threads) -> TextModel.choose_one_call's answer
_ONE_CALL: dict[tuple, int] = {}


def _one_call_probe(layers: list[DecoderLayer], batch: int, reps: int = 5) -> tuple[float, float]:
    """(module path, one-call path) seconds for a decode step of ``batch`` sequences through ``layers``: best of
    ``reps``, the two paths alternating, on zero KV of 64 positions and random hidden states."""
    a = layers[0].self_attn
    ctx, bs = 64, 16
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, layers[0].input_layernorm.shape[0], generator=g)
    ang = torch.rand(batch, 1, a.d, generator=g)
    rope = (ang.cos(), ang.sin())
    kv = LayerKV(torch.zeros(-(-batch // bs), bs, a.kvh, a.d), torch.zeros(-(-batch // bs), bs, a.kvh, a.d),
                 torch.zeros(batch, a.kvh, ctx, a.d), torch.zeros(batch, a.kvh, ctx, a.d))
    dec = DecodeBatch(torch.arange(batch), torch.full((batch,), ctx - 1), ctx, True, torch.zeros(batch, 1, 1, ctx))
    meta = AttentionMetadata(slot_mapping=torch.arange(batch), prefills=[], num_prefill_tokens=0, decode=dec)
    best = [float("inf"), float("inf")]
    for r in range(reps + 1):  # the first round warms both paths
        for path in (0, 1):
            for layer in layers:
                layer.layer_call_upto = batch if path else 0
            t0 = time.perf_counter()
            for layer in layers:
                layer(x, rope, meta, kv)
            if r:
                best[path] = min(best[path], time.perf_counter() - t0)
    return best[0], best[1]


def _probe_one_call(probe: list[DecoderLayer], cap: int) -> int:
    counts = [m.mlp.expert_counts.clone() for m in probe if isinstance(m.mlp, SparseMoe)]
    upto = 0
    for batch in (b for b in ONE_CALL_PROBES if b <= cap):
        modules, one = _one_call_probe(probe, batch)
        if one >= modules:
            break
        upto = batch
    for m, c in zip((m for m in probe if isinstance(m.mlp, SparseMoe)), counts, strict=True):
        m.mlp.expert_counts.copy_(c)  # the probes' routing is not traffic
    return upto


class TextModel(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # weights given: no random init (on the meta device it imports torch._dynamo: a second at start-up)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
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

    @torch.inference_mode()
    def choose_one_call(self) -> int:
        """After :func:`engine.cpu_linear.pack_linears`: the largest of :data:`ONE_CALL_PROBES` decode batch sizes
        at which a decode step through the first :data:`ONE_CALL_LAYERS` layers ran faster in one call per layer than
        through the modules (at it and every smaller probe; up to what the MoE one-call path takes), timed once per
        shape and thread count in a process; every layer that may take the path gets it (0: never)."""
        layers = [m for m in self.layers if isinstance(m, DecoderLayer) and m.one_call]
        if not layers or cpu_kernels.library() is None or self.norm.dtype != torch.float32:
            return 0
        choose_tile_rows(layers[0].self_attn.qkv_proj.weight)  # the projections' kernel by rows, before the probes
        cap = min((m.mlp.one_call_upto for m in layers if isinstance(m.mlp, SparseMoe)), default=ONE_CALL_PROBES[-1])
        probe = layers[:ONE_CALL_LAYERS]
        key = (tuple(tuple(p.shape) for m in probe for p in m.parameters()), cap, torch.get_num_threads())
        upto = tuning_cache.remembered(_ONE_CALL, "one_call", key, lambda: _probe_one_call(probe, cap), like=0)
        for m in layers:
            m.layer_call_upto = upto
        return upto

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
