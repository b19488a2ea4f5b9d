"""Visual KV kept coded (uint8) in the pool, for as long as the request lives.

A decode engine with ``visual_kv_cache="int8"`` stores a received prompt's *coded blocks* -- whole prompt blocks of
image tokens -- not as plain pool blocks but as **pages**: each page is one pool block's memory (per layer, its K
and V halves) lent out of the pool (:meth:`engine.block_manager.BlockManager.lend_pages`, the elastic region) and
holding up to :func:`page_capacity` tokens (float32 blocks of 16 tokens: 56, so an image costs 2/7 of its plain
blocks). The block table keeps ``-1`` at coded blocks; text blocks, and blocks that mix text and image tokens, stay
plain. Layout of one page, per layer (``G`` = capacity, ``n <= G`` tokens used):

* K half: ``min [KVH, D]``, ``scale [KVH, D]`` float32 -- per channel over the page's tokens (KIVI-style keys: a
  channel's outliers stay in that channel) -- then codes ``uint8 [KVH, G, D]``;
* V half: ``min [KVH, G]``, ``scale [KVH, G]`` float32 -- per token and head -- then codes ``[KVH, G, D]``;

a value is ``min + scale * code``, ``|x - x_hat| <= scale / 2``. Decode attention reads them without a float copy:
``q . k_t = q . min + (q * scale) . code_t`` (``duet_decode_attention_f32``'s coded pass, one softmax with the
plain keys; keys carry their rotary position already, so their order is free) -- the decode mirror
(:mod:`engine.decode_mirror`) then holds a coded sequence's plain positions only, in order, and a coded token is
held once. Without the compiled kernels (another device or dtype, dropped tokens) :func:`attend_torch` dequantizes
the batch's pages per layer (a fallback: correct, not fast).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

STAT_BYTES = 8  # float32 min and scale per statistic
MAX_HEAD_DIM = 256  # PAGE_MAX_D in cpu_kernels.c: wider heads keep their image KV plain
MODES = ("plain", "int8")


def page_capacity(block_size: int, head_dim: int, itemsize: int) -> int:
    """Tokens one page holds: a K half needs ``8 D`` bytes of statistics plus ``D`` a token, a V half ``D + 8`` a
    token, in one KV head's share of a plain block (``block_size * D * itemsize`` bytes).

    >>> page_capacity(16, 64, 4), page_capacity(16, 128, 4), page_capacity(16, 128, 2)
    (56, 56, 24)
    """
    if head_dim > MAX_HEAD_DIM:
        return 0
    block = block_size * head_dim * itemsize
    return max(0, min(block // head_dim - STAT_BYTES, block // (head_dim + STAT_BYTES)))


def coded_blocks(mm_positions: np.ndarray | None, num_prompt_tokens: int, block_size: int) -> np.ndarray:
    """Indices of the prompt blocks whose every position is an image token (sorted ``mm_positions``)."""
    if mm_positions is None or not len(mm_positions):
        return np.zeros(0, dtype=np.int64)
    full = num_prompt_tokens // block_size
    counts = np.bincount(np.asarray(mm_positions) // block_size, minlength=full)[:full]
    return np.flatnonzero(counts == block_size).astype(np.int64)


@dataclass
class CodedKV:
    """One received prompt's coded blocks: ``blocks`` (block-table indices, ascending), the lent pool blocks
    ``pages`` holding their tokens in order, ``counts`` tokens each. Shared by an ``n > 1`` request's choices
    (``refs``); the pages go back to the pool when the last one frees it. ``dropped``: KV layer -> coded token
    indices the sender dropped in that layer (they get no attention)."""

    blocks: np.ndarray
    pages: list[int]
    counts: list[int]
    block_size: int
    refs: int = 1
    dropped: dict[int, np.ndarray] = field(default_factory=dict)

    @cached_property
    def num_tokens(self) -> int:
        """Tokens the pages hold (its coded blocks' positions; read every decode step, counted once)."""
        return sum(self.counts)

    def split(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Prompt ``positions`` as (coded token indices, mirror indices of the plain rest): a plain position's
        mirror index is the position less the coded tokens before it."""
        positions = np.asarray(positions, dtype=np.int64)
        blk = positions // self.block_size
        where = np.searchsorted(self.blocks, blk)
        coded = (where < len(self.blocks)) & (self.blocks[np.minimum(where, len(self.blocks) - 1)] == blk)
        return where[coded] * self.block_size + positions[coded] % self.block_size, \
            positions[~coded] - where[~coded] * self.block_size


def page_count(num_tokens: int, capacity: int) -> int:
    return -(-num_tokens // capacity)


def _bytes(pool: torch.Tensor) -> torch.Tensor:
    """A pool tensor ``[num_blocks, ...]`` as ``uint8 [num_blocks, block bytes]`` (the same memory)."""
    return pool.view(pool.shape[0], -1).view(torch.uint8)


def _stats(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    mn, mx = x.amin(dim), x.amax(dim)
    scale = (mx - mn) / 255.0
    return mn, torch.where(scale > 0, scale, torch.ones_like(scale))


def write_pages(pool_k: torch.Tensor, pool_v: torch.Tensor, pages: list[int], capacity: int, k: torch.Tensor,
                v: torch.Tensor) -> None:
    """Code ``k``, ``v`` ``[n, KVH, D]`` (any float dtype) into ``pages`` of one layer's pool, ``capacity`` tokens a
    page in order (the last page may hold fewer)."""
    n, kvh, d = k.shape
    p, g = len(pages), capacity
    assert p == page_count(n, g), f"{n} tokens need {page_count(n, g)} pages, got {p}"
    pad = p * g - n
    # the last page's unused rows repeat its last token: a repeat changes no min or max
    xk, xv = (torch.cat([t.float(), t[-1:].float().expand(pad, kvh, d)]) if pad else t.float() for t in (k, v))
    xk, xv = xk.view(p, g, kvh, d), xv.view(p, g, kvh, d)
    kmn, ksc = _stats(xk, 1)  # [p, kvh, d]
    vmn, vsc = _stats(xv, 3)  # [p, g, kvh]
    kc = ((xk - kmn[:, None]) / ksc[:, None]).round_().clamp_(0, 255).to(torch.uint8).transpose(1, 2)
    vc = ((xv - vmn[..., None]) / vsc[..., None]).round_().clamp_(0, 255).to(torch.uint8).transpose(1, 2)
    kb, vb = _bytes(pool_k), _bytes(pool_v)
    buf_k = torch.zeros(p, kb.shape[1], dtype=torch.uint8)
    buf_v = torch.zeros(p, vb.shape[1], dtype=torch.uint8)
    sk, sv = kvh * d * 4, kvh * g * 4
    buf_k[:, :sk] = kmn.reshape(p, -1).view(torch.uint8)
    buf_k[:, sk:2 * sk] = ksc.reshape(p, -1).view(torch.uint8)
    buf_k[:, 2 * sk:2 * sk + kvh * g * d] = kc.reshape(p, -1)
    buf_v[:, :sv] = vmn.transpose(1, 2).reshape(p, -1).view(torch.uint8)
    buf_v[:, sv:2 * sv] = vsc.transpose(1, 2).reshape(p, -1).view(torch.uint8)
    buf_v[:, 2 * sv:2 * sv + kvh * g * d] = vc.reshape(p, -1)
    idx = torch.tensor(pages, dtype=torch.long, device=pool_k.device)
    kb.index_copy_(0, idx, buf_k.to(pool_k.device))
    vb.index_copy_(0, idx, buf_v.to(pool_v.device))


def _dequantize(pool_k: torch.Tensor, pool_v: torch.Tensor, idx: torch.Tensor, capacity: int, kvh: int,
                d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages ``idx`` (a long tensor on the pool's device) dequantized whole: float32 ``[P, G, KVH, D]`` each."""
    p, g = idx.shape[0], capacity
    kb, vb = _bytes(pool_k).index_select(0, idx), _bytes(pool_v).index_select(0, idx)
    sk, sv, nc = kvh * d * 4, kvh * g * 4, kvh * g * d
    kmn = kb[:, :sk].contiguous().view(torch.float32).view(p, 1, kvh, d)
    ksc = kb[:, sk:2 * sk].contiguous().view(torch.float32).view(p, 1, kvh, d)
    kc = kb[:, 2 * sk:2 * sk + nc].view(p, kvh, g, d).transpose(1, 2).float()
    vmn = vb[:, :sv].contiguous().view(torch.float32).view(p, kvh, g).transpose(1, 2)[..., None]
    vsc = vb[:, sv:2 * sv].contiguous().view(torch.float32).view(p, kvh, g).transpose(1, 2)[..., None]
    vc = vb[:, 2 * sv:2 * sv + nc].view(p, kvh, g, d).transpose(1, 2).float()
    return kc.mul_(ksc).add_(kmn), vc.mul_(vsc).add_(vmn)


def _token_index(counts: list[int], capacity: int) -> np.ndarray:
    """Flat ``page * capacity + slot`` of each stored token, in order."""
    return np.concatenate([np.arange(i * capacity, i * capacity + c) for i, c in enumerate(counts)]) \
        if counts else np.zeros(0, dtype=np.int64)


def read_pages(pool_k: torch.Tensor, pool_v: torch.Tensor, pages: list[int], counts: list[int], capacity: int,
               kvh: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages' values, float32 ``[sum(counts), KVH, D]`` each (K, V)."""
    if not pages:
        return torch.zeros(0, kvh, d, device=pool_k.device), torch.zeros(0, kvh, d, device=pool_k.device)
    k, v = _dequantize(pool_k, pool_v, torch.tensor(pages, dtype=torch.long, device=pool_k.device), capacity, kvh, d)
    keep = torch.from_numpy(_token_index(counts, capacity)).to(pool_k.device)
    return k.flatten(0, 1).index_select(0, keep), v.flatten(0, 1).index_select(0, keep)


@dataclass
class CodedRows:
    """A decode step's coded pages, per row (rows in the batch's order): row ``b``'s pages are
    ``blk[off[b]:off[b + 1]]`` with ``n`` tokens each (int64 tensors the kernels read); ``max_keys``: the most keys
    a row attends over (plain and coded), the kernels' score scratch."""

    off: torch.Tensor
    blk: torch.Tensor
    n: torch.Tensor
    capacity: int
    max_keys: int
    rows: list[CodedKV | None]
    _gather: tuple | None = None

    def gather(self, device: torch.device, dtype: torch.dtype) -> tuple:
        """Indices that place the step's coded tokens (every layer alike; made on first use): the pages as a long
        tensor, each token's flat ``page * capacity + slot`` in them, its row and its column in the row's coded keys,
        the most coded keys of a row, and the additive mask ``[B, 1, 1, most]`` (0 where a row has a token)."""
        if self._gather is None:
            src, row, col = [], [], []
            most = max(c.num_tokens for c in self.rows if c is not None)
            mask = torch.full((len(self.rows), 1, 1, most), float("-inf"), dtype=dtype, device=device)
            for i, (c, first) in enumerate(zip(self.rows, self.off.tolist(), strict=False)):
                if c is not None:  # its pages start at ``first`` in ``blk``
                    src.append(first * self.capacity + _token_index(c.counts, self.capacity))
                    row.append(np.full(c.num_tokens, i))
                    col.append(np.arange(c.num_tokens))
                    mask[i, ..., :c.num_tokens] = 0
            as_t = lambda parts: torch.from_numpy(np.concatenate(parts)).to(device)  # noqa: E731
            self._gather = (self.blk.to(device), as_t(src), as_t(row), as_t(col), most, mask)
        return self._gather


def coded_rows(coded: list[CodedKV | None], plain_lens: np.ndarray, capacity: int) -> CodedRows | None:
    """The step's :class:`CodedRows` (None when no row has coded pages; ``plain_lens``: each row's mirror keys)."""
    if all(c is None for c in coded):
        return None
    off, blk, n = [0], [], []
    for c in coded:
        if c is not None:
            blk += c.pages
            n += c.counts
        off.append(len(blk))
    most = max(lens + (c.num_tokens if c else 0) for lens, c in zip(plain_lens.tolist(), coded, strict=True))
    as_t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return CodedRows(as_t(off), as_t(blk), as_t(n), capacity, most, coded)


def attend_torch(q: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, mask: torch.Tensor, rows: CodedRows,
                 pool_k: torch.Tensor, pool_v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """Decode attention of ``q [B, KVH, G, D]`` over the mirror's plain keys ``kd``, ``vd [B, KVH, L, D]`` (additive
    ``mask [B, 1, 1, L]``) and each row's coded pages, dequantized here: every page of the batch in one pass, placed
    by indices built once a step (:meth:`CodedRows.gather`). Returns ``[B, KVH, G, D]``."""
    b, kvh, _, d = kd.shape
    pages, src, row, col, most, cmask = rows.gather(kd.device, mask.dtype)
    k, v = _dequantize(pool_k, pool_v, pages, rows.capacity, kvh, d)
    kc = torch.zeros(b, most, kvh, d, dtype=kd.dtype, device=kd.device)
    vc = torch.zeros_like(kc)
    kc[row, col] = k.flatten(0, 1).index_select(0, src).to(kd.dtype)
    vc[row, col] = v.flatten(0, 1).index_select(0, src).to(vd.dtype)
    if any(c is not None and layer in c.dropped for c in rows.rows):
        cmask = cmask.clone()
        for i, c in enumerate(rows.rows):
            if c is not None and layer in c.dropped:
                cmask[i, ..., torch.from_numpy(c.dropped[layer]).to(mask.device)] = float("-inf")
    return F.scaled_dot_product_attention(q, torch.cat([kd, kc.transpose(1, 2)], 2),
                                          torch.cat([vd, vc.transpose(1, 2)], 2),
                                          attn_mask=torch.cat([mask, cmask], 3), scale=scale)


def plain_table(seq) -> list[int]:
    """``seq``'s plain blocks in order (its block table less coded blocks' ``-1``): the mirror's positions."""
    return seq.block_table if seq.coded is None else [b for b in seq.block_table if b >= 0]


def gather_coded(pool_k: torch.Tensor, pool_v: torch.Tensor, table: torch.Tensor, coded: CodedKV,
                 capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A coded sequence's blocks of one layer as plain ``[len(table), block_size, KVH, D]`` tensors (K, V), its
    coded blocks dequantized."""
    _, bs, kvh, d = pool_k.shape
    k, v = pool_k.index_select(0, table.clamp(min=0)), pool_v.index_select(0, table.clamp(min=0))
    ck, cv = read_pages(pool_k, pool_v, coded.pages, coded.counts, capacity, kvh, d)
    idx = torch.from_numpy(coded.blocks).to(table.device)
    k[idx], v[idx] = ck.view(-1, bs, kvh, d).to(k.dtype), cv.view(-1, bs, kvh, d).to(v.dtype)
    return k, v
