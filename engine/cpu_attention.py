"""The compiled prefill attention's Python side (``duet_prefill_attention_f32`` in ``cpu_attention.c``): what it
takes and how it is called. :mod:`engine.cpu_kernels` builds the library and re-exports these."""

from __future__ import annotations

import ctypes

import torch

ATTENTION_MAX_HEAD_DIM = 256  # AD_MAX in cpu_attention.c


def prefill_attention_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Can :func:`prefill_attention` take these operands as they are (float32 on CPU, each head's D values
    contiguous and, in q, a token's heads too; head_dim up to :data:`ATTENTION_MAX_HEAD_DIM`, whole query groups)?"""
    d = q.shape[-1]
    return (q.dim() == k.dim() == v.dim() == 3 and 0 < d <= ATTENTION_MAX_HEAD_DIM
            and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0 and k.shape == v.shape and k.shape[2] == d
            and q.stride()[1:] == (d, 1) and k.stride(2) == 1 and v.stride(2) == 1
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (q, k, v)))


def prefill_attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                      causal: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [T, H, D] over k, v [C, KVH, D] (``duet_prefill_attention_f32``; query head h reads KV head
    h // (H // KVH)). Causal: query i sits at position C - T + i and sees keys 0..C - T + i (a prompt chunk after
    C - T cached tokens); else every query sees every key. The operands may be row slices of wider rows, and k and
    v head-major (:func:`prefill_attention_fits`); ``out`` [T, H, D] (each token's heads contiguous) receives the
    result, else a new tensor. Returns it."""
    t, h, d = q.shape
    c, kvh, _ = k.shape
    if not prefill_attention_fits(q, k, v) or (causal and c < t):
        raise ValueError(f"prefill_attention: q {tuple(q.shape)} over k {tuple(k.shape)}, v {tuple(v.shape)} "
                         f"({q.dtype}, {'causal' if causal else 'full'})")
    if out is None:
        out = torch.empty(t, h, d, dtype=torch.float32)
    elif out.shape != q.shape or out.stride()[1:] != (d, 1) or out.dtype != torch.float32:
        raise ValueError(f"prefill_attention: out {tuple(out.shape)}, strides {out.stride()}")
    if t == 0:
        return out
    kt = torch.empty(lib.duet_prefill_attention_scratch(c, kvh, d), dtype=torch.float32)
    lib.duet_prefill_attention_f32(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(),
                                   v.stride(0), v.stride(1), t, c, h, kvh, d, scale, int(causal), kt.data_ptr(),
                                   out.data_ptr(), out.stride(0))
    return out
