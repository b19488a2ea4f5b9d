"""Paged attention over the KV block pool.

The pool holds, per layer, ``k`` and ``v`` tensors of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A step's tokens arrive flattened: first every prefill chunk (one span per sequence), then one token per decoding
sequence. Prefill chunks with earlier context read it from the pool; decoding sequences read their contiguous mirror
rows (:mod:`engine.decode_mirror`). :class:`AttentionMetadata` is built once per step by the model runner and shared by all layers, so a
layer's Python work is O(prefill spans + 1), never O(tokens) or O(blocks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import engine.cpu_kernels as cpu_kernels
import engine.tuning_cache as tuning_cache
from engine.coded_kv import CodedRows, attend_torch
from engine.state_cache import StateStep


@dataclass
class PrefillSpan:
    """One sequence's chunk of prompt tokens in this step.

    ``start``/``length`` index the flat token batch; ``context_len`` counts keys visible to the chunk's last token
    (cached prefix + earlier chunks + this chunk). ``block_table`` is given only when ``context_len > length``
    (the chunk must read earlier keys from the pool).
    """

    start: int
    length: int
    context_len: int
    block_table: torch.Tensor | None
    mask: torch.Tensor | None  # [length, context_len] bool, only with a block table
    capture: int | None = None  # seq_id: keep this chunk's last queries in ``AttentionMetadata.captured``


@dataclass
class DecodeBatch:
    """The decoding sequences of a step, in mirror-slot order (see :mod:`engine.decode_mirror`)."""

    slots: torch.Tensor  # [B] long: each sequence's mirror row
    write_pos: torch.Tensor  # [B] long: position of the token computed this step (= context length - 1)
    max_len: int  # longest context in the batch, this step's token included
    dense: bool  # slots are exactly 0..B-1, so the batch is a view of the mirror
    mask: torch.Tensor | None  # [B, 1, 1, max_len] additive: 0 within each context, -inf after; None: built on use
    layer_masks: list[torch.Tensor] | None = None  # per layer ``mask`` plus dropped-token bias (decode_mirror)
    coded: CodedRows | None = None  # rows' coded visual pages (engine.coded_kv), attended after the mirror's keys

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``mask``, built on first use (a step whose layers all run the compiled one-call path reads none)."""
        if self.mask is None:
            self.mask = decode_mask(self.write_pos + 1, self.max_len, dtype)
        return self.mask


def decode_mask(lens: torch.Tensor, max_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, 1, max_len] additive mask, 0 at positions below each sequence's length ``lens`` [B], -inf beyond."""
    b = lens.shape[0]
    visible = (torch.arange(max_len, device=lens.device).unsqueeze(0) < lens.unsqueeze(1)).view(b, 1, 1, max_len)
    # additive float mask, built once per step (a bool mask would be converted by every layer's SDPA)
    return torch.zeros(visible.shape, dtype=dtype, device=lens.device).masked_fill_(~visible, float("-inf"))


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: flat pool slot (block * block_size + offset) each new key is written to
    prefills: list[PrefillSpan]
    num_prefill_tokens: int
    decode: DecodeBatch | None
    on_layer: Callable[[int], None] | None = None  # called after each decoder layer (KV export for disaggregation)
    query_window: int = 0  # how many of a capturing span's last queries to keep
    captured: dict[int, torch.Tensor] | None = None  # seq_id -> [<=query_window, H, D] queries of the current layer
    state: StateStep | None = None  # hybrid models: the state slot of each prefill span and decode row


def causal_mask_with_prefix(length: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Mask [length, context_len]: query i (absolute position context_len-length+i) sees keys 0..that position."""
    q_pos = torch.arange(context_len - length, context_len, device=device).unsqueeze(1)
    return torch.arange(context_len, device=device).unsqueeze(0) <= q_pos


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, meta: AttentionMetadata,
                    scale: float, prefill_from: int = 0) -> torch.Tensor:
    """Store the step's new keys/values in the pool (and the decode mirror), then attend.

    q: [T, H, D]; k, v: [T, KVH, D]. Returns [T, H, D]. ``prefill_from`` > 0: prompt chunks of at least that many
    tokens attend through the compiled kernel (:func:`choose_prefill_kernel`), the rest through SDPA.
    """
    k_cache, v_cache = kv.k, kv.v
    nb, bs, kvh, d = k_cache.shape
    dec = meta.decode
    lib = _decode_kernel(q, k, v, kv, dec)
    if lib is not None and not meta.prefills:  # a decode-only step: one call writes the pool and mirror, and attends
        return cpu_kernels.decode_attention(lib, q, k, v, kv.mirror_k, kv.mirror_v, dec.slots, dec.write_pos,
                                            dec.max_len, scale, pool=(k_cache, v_cache, meta.slot_mapping),
                                            coded=dec.coded, pages=(k_cache, v_cache))
    k_cache.view(nb * bs, kvh, d).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(nb * bs, kvh, d).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    for span in meta.prefills:
        s, e = span.start, span.start + span.length
        if span.block_table is None:
            ks, vs = k[s:e], v[s:e]
        else:
            ks = k_cache[span.block_table].view(-1, kvh, d)[: span.context_len]
            vs = v_cache[span.block_table].view(-1, kvh, d)[: span.context_len]
        if 0 < prefill_from <= span.length and cpu_kernels.prefill_attention_fits(q, ks, vs):
            cpu_kernels.prefill_attention(cpu_kernels.library(), q[s:e], ks, vs, scale, out=out[s:e])
        else:
            causal = {"is_causal": True} if span.block_table is None else {"attn_mask": span.mask}
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1).unsqueeze(0), ks.transpose(0, 1).unsqueeze(0),
                                               vs.transpose(0, 1).unsqueeze(0), scale=scale, enable_gqa=True, **causal)
            out[s:e] = o.squeeze(0).transpose(0, 1)
        if span.capture is not None and meta.captured is not None:
            meta.captured[span.capture] = q[max(s, e - meta.query_window):e].clone()
    if dec is not None:
        p = meta.num_prefill_tokens
        if lib is not None:
            out[p:] = cpu_kernels.decode_attention(lib, q[p:], k[p:], v[p:], kv.mirror_k, kv.mirror_v, dec.slots,
                                                   dec.write_pos, dec.max_len, scale, coded=dec.coded,
                                                   pages=(k_cache, v_cache))
            return out
        kv.mirror_k[dec.slots, :, dec.write_pos] = k[p:]
        kv.mirror_v[dec.slots, :, dec.write_pos] = v[p:]
        b = dec.slots.shape[0]
        if dec.dense:
            kd, vd = kv.mirror_k[:b, :, : dec.max_len], kv.mirror_v[:b, :, : dec.max_len]
        else:
            kd, vd = kv.mirror_k[dec.slots, :, : dec.max_len], kv.mirror_v[dec.slots, :, : dec.max_len]
        mask = dec.additive_mask(q.dtype) if dec.layer_masks is None else dec.layer_masks[kv.index]
        # one query per sequence: a KV head's query heads attend as that head's rows (no GQA expansion of K/V)
        qg = q[p:].view(b, kvh, q.shape[1] // kvh, d)
        if dec.coded is None:
            o = F.scaled_dot_product_attention(qg, kd, vd, attn_mask=mask, scale=scale)
        else:
            o = attend_torch(qg, kd, vd, mask, dec.coded, k_cache, v_cache, kv.index, scale)
        out[p:] = o.view(b, q.shape[1], d)
    return out


def _decode_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, dec: DecodeBatch | None):
    """The compiled kernels where the step's decode rows can go through ``decode_attention`` (float32 on CPU, no
    per-layer bias for dropped tokens, the layouts it reads), else None (scaled_dot_product_attention)."""
    if dec is None or dec.layer_masks is not None or q.dtype != torch.float32 or q.device.type != "cpu":
        return None
    d = q.shape[-1]
    if q.stride()[1:] != (d, 1) or k.stride()[1:] != (d, 1) or v.stride()[1:] != (d, 1) \
            or not (kv.mirror_k.is_contiguous() and kv.mirror_v.is_contiguous() and kv.k.is_contiguous()
                    and kv.v.is_contiguous() and kv.mirror_k.dtype == torch.float32 and kv.k.dtype == torch.float32):
        return None
    return cpu_kernels.library()


@dataclass
class LayerKV:
    """One layer's KV storage: the paged pool ``[num_blocks, block_size, KVH, D]`` and the decode mirror
    ``[slots, KVH, capacity, D]``."""

    k: torch.Tensor
    v: torch.Tensor
    mirror_k: torch.Tensor
    mirror_v: torch.Tensor
    index: int = 0  # layer number


PREFILL_PROBES = (16, 128, 512)  # prompt-chunk lengths the compiled prefill kernel is timed at against SDPA
PREFILL_REPS = 7  # timed runs of each path at a probe, the best taken
_PREFILL_FROM: dict[tuple[int, int, int, bool], int] = {}  # (heads, kv heads, head_dim, causal) -> the answer


def choose_prefill_kernel(heads: int, kv_heads: int, head_dim: int, causal: bool = True) -> int:
    """The shortest prompt chunk from which :func:`paged_attention` runs a chunk's causal attention through the
    compiled kernel (:func:`engine.cpu_kernels.prefill_attention`; 0: never): the smallest of
    :data:`PREFILL_PROBES` at which it ran faster than SDPA by 5%, at it and at every longer probe (best of
    :data:`PREFILL_REPS`, the two alternating, random float32 operands). ``causal=False``: the same for full
    attention over as many keys as queries (a vision tower's frame). Timed once per shape in a process, on one
    thread: both split the same (head, query block) work over threads, so one thread ranks them as several do (AMD
    EPYC: 2.5 / 3.0x at 128 / 512 causal tokens on one thread, 2.9 / 3.3x on two), and a thread of a team that
    another process preempts stalls the whole team -- timed on two threads while the other worker of a 2-core host
    loaded, the choice flipped between loads (the vision kernel never taken in one, where quiet runs had it 1.7x
    faster); on one thread the same contention left it unchanged."""
    key = (heads, kv_heads, head_dim, causal)
    return tuning_cache.remembered(_PREFILL_FROM, "prefill_attention", key,
                                   lambda: _probe_prefill_kernel(heads, kv_heads, head_dim, causal), like=0)


def _probe_prefill_kernel(heads: int, kv_heads: int, head_dim: int, causal: bool) -> int:
    lib = cpu_kernels.library()
    g = torch.Generator().manual_seed(0)
    start = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if lib is not None and heads % kv_heads == 0 and head_dim <= cpu_kernels.ATTENTION_MAX_HEAD_DIM:
            for n in reversed(PREFILL_PROBES):
                q = torch.randn(n, heads, head_dim, generator=g)
                k, v = torch.randn(2, n, kv_heads, head_dim, generator=g).unbind(0)
                qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
                best = [float("inf")] * 2
                for r in range(PREFILL_REPS + 1):  # the first round warms both
                    for path in (0, 1):
                        t0 = time.perf_counter()
                        if path:
                            cpu_kernels.prefill_attention(lib, q, k, v, head_dim ** -0.5, causal=causal)
                        else:
                            F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=head_dim ** -0.5,
                                                           enable_gqa=True)
                        if r:
                            best[path] = min(best[path], time.perf_counter() - t0)
                if best[1] >= 0.95 * best[0]:
                    break
                start = n
    finally:
        torch.set_num_threads(threads)
    return start
