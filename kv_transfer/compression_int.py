"""The per-method kernels of the ``modal`` codec (:mod:`kv_transfer.compression`), on CPU tensors.

Each section's K or V arrives as a float tensor ``x [n, kvh, c]`` (its tokens, its kept channels); its bytes are
written straight into the layer payload (no per-entry buffers joined afterwards). Grouped statistics are whole-array
reductions over at most two views (the full groups as ``[groups, group, cols]`` and a partial last group), so the
work per entry is a handful of vectorised passes whatever the group count: no Python loop over groups or tokens.

int (KIVI-style): keys per channel over groups of ``group`` consecutive tokens (statistics ``[token_groups, kvh *
c]``), values per token over groups of ``group`` consecutive entries of the token's flattened ``[kvh * c]`` vector
(statistics stored ``[channel_groups, n]``). The stored min is rounded down and the scale up, codes are
``floor((x - min) / scale + 0.5)`` (no clamp needed: ``x - min`` is never negative and the scale's slack keeps the
top code at ``levels``), so ``|x - x_hat| <= stored_scale / 2`` plus float32 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

SCALE_DTYPES = {"float16": torch.float16, "float32": torch.float32}
FP8_MAX = 448.0
# float16 scales / mins while every value of the entry is below this (mins and scales then stay finite)
FLOAT16_RANGE = 60000.0
# float32 rounding slack of (hi - mn) / levels, so the stored scale never falls below the exact one
_SCALE_UP = 1 + 2.0 ** -21
_F16_NEG_INF, _F32_POS_INF, _F32_TINY = np.float16(-np.inf), np.float32(np.inf), np.finfo(np.float32).tiny


def codes_nbytes(count: int, bits: int) -> int:
    return count if bits == 8 else -(-count // 2)


@dataclass(frozen=True)
class Encoding:
    """How one section's K or V is encoded (its codec_meta entry, less channels / offset / length)."""

    kind: str
    bits: int | None
    group: int | None
    scale_dtype: str | None
    keys: bool  # int: keys are quantized per channel over token groups, values per token over channel groups

    def nbytes(self, n: int, kvh: int, c: int, itemsize: int) -> int:
        if n == 0:
            return 0
        if self.kind == "raw":
            return n * kvh * c * itemsize
        if self.kind == "fp8":
            return 4 * kvh + n * kvh * c
        rows, cols = (n, kvh * c) if self.keys else (kvh * c, n)
        groups = -(-rows // self.group)
        return 2 * groups * cols * SCALE_DTYPES[self.scale_dtype].itemsize + codes_nbytes(n * kvh * c, self.bits)

    def decode(self, seg: torch.Tensor, n: int, kvh: int, c: int, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, kvh, c]`` from ``seg`` (exactly :meth:`nbytes` long): raw in ``dtype``, others float32. ``out``:
        a float32 ``[n, kvh * c]`` tensor to write int values into (else one is allocated)."""
        if self.kind == "raw":
            return view_as(seg, dtype).view(n, kvh, c)
        if self.kind == "fp8":
            scale = view_as(seg[:4 * kvh], torch.float32)
            return seg[4 * kvh:].view(torch.float8_e4m3fn).float().view(n, kvh, c).mul_(scale[:, None])
        return decode_int(seg, n, kvh * c, self.bits, self.group, self.keys, SCALE_DTYPES[self.scale_dtype],
                          out).view(n, kvh, c)


def view_as(seg: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 bytes viewed as ``dtype`` (copied first when misaligned)."""
    return (seg.clone() if seg.storage_offset() % dtype.itemsize else seg).view(dtype)


# -- grouping -----------------------------------------------------------------------------------------------------
def _pieces(m: torch.Tensor, keys: bool, group: int) -> list[tuple[torch.Tensor, slice]]:
    """``m [n, flat]`` as at most two grouped views and the statistics rows each covers: keys ``[g, group, flat]``
    (token groups; statistics row ``i`` per group), values ``[n, g, group]`` (channel groups)."""
    n, flat = m.shape
    size = n if keys else flat
    full, tail = divmod(size, group)
    out = []
    if full:
        body = m[:full * group].view(full, group, flat) if keys else m[:, :full * group].view(n, full, group)
        out.append((body, slice(0, full)))
    if tail:
        rest = m[full * group:].view(1, tail, flat) if keys else m[:, full * group:].view(n, 1, tail)
        out.append((rest, slice(full, full + 1)))
    return out


def _stat_view(stat: torch.Tensor, keys: bool, rows: slice) -> torch.Tensor:
    """Statistics ``[groups, cols]`` (keys) / ``[n, groups]`` (values), contiguous, of ``rows`` (statistics rows,
    resp. columns) broadcast against a piece of :func:`_pieces`."""
    return stat[rows].unsqueeze(1) if keys else stat[:, rows].unsqueeze(2)


# -- int ----------------------------------------------------------------------------------------------------------
@dataclass
class IntStats:
    """An int entry's stored scales and mins (float16 or float32), in compute orientation: keys ``[token_groups,
    flat]``, values ``[n, channel_groups]`` (the wire stores values' transposed)."""

    scale: np.ndarray
    mn: np.ndarray

    @property
    def dtype_name(self) -> str:
        return "float16" if self.scale.dtype == np.float16 else "float32"


def int_params(x: torch.Tensor, bits: int, group: int, keys: bool) -> IntStats:
    """Stored scales and mins of ``x [n, flat]`` float32: float16 when every value fits, else float32; the min
    rounded down and the scale up."""
    dim = 1 if keys else 2
    pieces = _pieces(x, keys, group)
    lo = [p.amin(dim) for p, _ in pieces]  # not aminmax: 5-10x slower than the pair (torch 2.13 CPU)
    hi = [p.amax(dim) for p, _ in pieces]
    lo_n, hi_n = (t[0].numpy() if len(t) == 1 else torch.cat(t, 0 if keys else 1).numpy() for t in (lo, hi))
    return _scale_and_min(lo_n, hi_n, (1 << bits) - 1)


def _scale_and_min(lo: np.ndarray, hi: np.ndarray, levels: int) -> IntStats:
    if lo.min() > -FLOAT16_RANGE and hi.max() < FLOAT16_RANGE:
        mn = lo.astype(np.float16)
        down = mn.astype(np.float32) > lo
        if down.any():  # round down where float16's nearest is above the min
            mn[down] = np.nextafter(mn[down], _F16_NEG_INF)
        s = hi - mn.astype(np.float32)
        # round up: * (1 + 2^-10) covers float16's half-ulp, + 2^-24 its subnormals (never a zero scale)
        s *= _SCALE_UP / levels * (1 + 2.0 ** -10)
        s += 2.0 ** -24
        return IntStats(s.astype(np.float16), mn)
    s = (hi - lo) * np.float32(_SCALE_UP / levels)  # lo is exact in float32: no rounding of the min
    # at least float32's smallest normal: a finite reciprocal for constant groups
    return IntStats(np.maximum(np.nextafter(s, _F32_POS_INF), _F32_TINY), lo)


def _wire(stat: np.ndarray, keys: bool) -> np.ndarray:
    return stat if keys else np.ascontiguousarray(stat.T)


def encode_int_into(x: torch.Tensor, st: IntStats, bits: int, group: int, keys: bool, out: torch.Tensor) -> None:
    """The entry ``scales | mins | codes`` of ``x [n, flat]`` float32 (statistics from :func:`int_params`) into
    ``out`` (uint8, exactly its length): codes row-major ``[n, flat]``, int4 two per byte low nibble first."""
    n, flat = x.shape
    half = st.scale.nbytes
    raw = out.numpy()
    raw[:half] = _wire(st.scale, keys).view(np.uint8).ravel()
    raw[half:2 * half] = _wire(st.mn, keys).view(np.uint8).ravel()
    out = out[2 * half:]
    s32 = st.scale.astype(np.float32)
    # codes = trunc((x - (min - scale / 2)) / scale): round half up, never below 0 nor above levels
    low, inv = torch.from_numpy(st.mn.astype(np.float32) - s32 * 0.5), torch.from_numpy(np.reciprocal(s32))
    count = n * flat
    buf = torch.empty(count + (bits == 4 and count % 2))
    q = buf[:count].view(n, flat)
    for (piece, rows), (dst, _) in zip(_pieces(x, keys, group), _pieces(q, keys, group), strict=True):
        torch.sub(piece, _stat_view(low, keys, rows), out=dst).mul_(_stat_view(inv, keys, rows))
    if bits == 8:
        out.view(n, flat).copy_(q)
        return
    buf[count:] = 0.0  # the pad nibble of an odd count
    pairs = buf.view(-1, 2).to(torch.uint8)
    torch.bitwise_or(pairs[:, 0], pairs[:, 1].bitwise_left_shift(4), out=out)


def decode_int(seg: torch.Tensor, n: int, flat: int, bits: int, group: int, keys: bool, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Values ``[n, flat]`` float32 of an int entry (``seg``: its bytes), written into ``out`` when given."""
    rows, cols = (n, flat) if keys else (flat, n)
    groups = -(-rows // group)
    half = groups * cols * dtype.itemsize
    scale = view_as(seg[:half], dtype).view(groups, cols).float()
    mn = view_as(seg[half:2 * half], dtype).view(groups, cols).float()
    if not keys:
        scale, mn = scale.t().contiguous(), mn.t().contiguous()
    codes = seg[2 * half:]
    if bits == 4:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=1).view(-1)[:n * flat]
    out = torch.empty(n, flat) if out is None else out
    out.copy_(codes.view(n, flat))
    for dst, srows in _pieces(out, keys, group):
        dst.mul_(_stat_view(scale, keys, srows)).add_(_stat_view(mn, keys, srows))
    return out


# -- fp8 ----------------------------------------------------------------------------------------------------------
def fp8_scale(x: torch.Tensor) -> np.ndarray:
    """float32 ``[kvh]`` scales of ``x [n, kvh, c]``: ``amax / 448`` per KV head (1 where the head is all zero)."""
    amax = torch.maximum(x.amax(dim=(0, 2)), x.amin(dim=(0, 2)).neg_()).numpy()
    return np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1)).astype(np.float32)


def encode_fp8_into(x: torch.Tensor, scale: np.ndarray, out: torch.Tensor) -> None:
    """The entry ``scales | codes`` (e4m3 codes of ``x [n, kvh, c]`` float32 / ``scale``) into ``out`` (uint8)."""
    out.numpy()[:scale.nbytes] = scale.view(np.uint8)
    q = torch.div(x, torch.from_numpy(scale)[:, None]).clamp_(-FP8_MAX, FP8_MAX)
    out[scale.nbytes:].view(torch.float8_e4m3fn).view(x.shape).copy_(q)


def keep_count(ratio: float, n: int) -> int:
    return max(1, math.ceil(ratio * n - 1e-9))  # 1e-9: 0.7 * 10 must keep 7, not 8
