"""The receiving side of the ``modal`` codec (:mod:`kv_transfer.compression`): every ``codec_meta`` field is
validated before a byte is read (a malformed one raises :class:`~kv_transfer.base.ProtocolError`, and nothing else
changes), then each entry decodes straight into full-size K and V. Also the token bitmasks and :class:`Rows` (a
section's positions as a few contiguous runs) both sides share.

Validation results that depend only on the header's small fields (a policy, a method, a token or channel bitmask)
are remembered per distinct value, so a stream of frames from one request pays for them once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from kv_transfer.errors import ProtocolError
from kv_transfer.layout import KVLayout
from kv_transfer.compression_int import SCALE_DTYPES, Encoding
from kv_transfer.compression_policy import SECTIONS, CompressionPolicy, InvalidPolicy, check_method, is_int

META_VERSION = 1
_CACHE_MAX = 256  # distinct visual masks (sender) / token masks (receiver) whose row plans are kept


# -- bit masks and token rows -------------------------------------------------------------------------------------
def pack_bits(mask: torch.Tensor) -> bytes:
    """bool ``[n]`` -> ``ceil(n / 8)`` bytes, LSB first."""
    return np.packbits(mask.detach().to("cpu", torch.bool).flatten().numpy(), bitorder="little").tobytes()


def unpack_bits(data: Any, n: int, what: str) -> torch.Tensor:
    """Inverse of :func:`pack_bits` (CPU bool ``[n]``); :class:`ProtocolError` for a wrong length or stray bits."""
    if not isinstance(data, (bytes, bytearray)) or len(data) != -(-n // 8):
        got = len(data) if isinstance(data, (bytes, bytearray)) else type(data).__name__
        raise ProtocolError(f"codec_meta {what}: bitmask must be {-(-n // 8)} bytes for {n} items, got {got}")
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    if bits[n:].any():
        raise ProtocolError(f"codec_meta {what}: bitmask has bits set past item {n}")
    return torch.from_numpy(bits[:n].view(np.bool_))


MAX_RUNS = 8  # a section of up to this many contiguous runs of positions is copied run by run, not gathered


@dataclass(frozen=True)
class Rows:
    """The sorted positions of a section's tokens: ``pos`` (CPU LongTensor), ``runs`` (``[(start, end), ...]``)
    when they form at most :data:`MAX_RUNS` contiguous ranges (copied as slices), and the packed ``mask``."""

    pos: torch.Tensor
    runs: list[tuple[int, int]] | None
    mask: bytes

    @classmethod
    def of(cls, mask: np.ndarray) -> Rows:
        pos = np.flatnonzero(mask)
        runs: list[tuple[int, int]] | None = []
        if len(pos):
            breaks = np.flatnonzero(np.diff(pos) != 1)
            starts, ends = np.r_[pos[0], pos[breaks + 1]], np.r_[pos[breaks] + 1, pos[-1] + 1]
            runs = list(zip(starts.tolist(), ends.tolist(), strict=True)) if len(starts) <= MAX_RUNS else None
        return cls(torch.from_numpy(pos), runs, np.packbits(mask, bitorder="little").tobytes())

    @property
    def count(self) -> int:
        return self.pos.numel()

    def take(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``x`` (a view for one run), into ``out`` when given."""
        if self.runs is None:
            return torch.index_select(x, 0, self.pos, out=out) if out is not None else x.index_select(0, self.pos)
        if len(self.runs) == 1 and out is None:
            a, b = self.runs[0]
            return x[a:b]
        parts = [x[a:b] for a, b in self.runs]
        return torch.cat(parts, out=out) if out is not None else torch.cat(parts)

    def put(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """``out[positions] = x``."""
        if self.runs is None:
            out.index_copy_(0, self.pos, x)
            return
        i = 0
        for a, b in self.runs:
            out[a:b].copy_(x[i:i + b - a])
            i += b - a


def remember(cache: dict, key: Any, value: Any) -> Any:
    if len(cache) >= _CACHE_MAX:
        cache.clear()
    cache[key] = value
    return value


# -- decoding --------------------------------------------------------------------------------------------------------
def decode(payload: torch.Tensor, header: dict[str, Any],
            layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    meta = header["codec_meta"]
    if not isinstance(meta, dict) or meta.get("v") != META_VERSION:
        got = meta.get("v") if isinstance(meta, dict) else type(meta).__name__
        raise ProtocolError(f"modal codec_meta version {got!r} is not supported (expected {META_VERSION})")
    _check_policy(meta.get("policy"))
    num_blocks, kvh, d = header["num_blocks"], layout.num_kv_heads, layout.head_dim
    capacity = num_blocks * layout.block_size
    n_tok = meta.get("num_tokens")
    if not is_int(n_tok) or not 0 <= n_tok <= capacity:
        raise ProtocolError(f"codec_meta num_tokens {n_tok!r} is outside [0, {capacity}] (the lease's capacity)")
    sections = meta.get("sections")
    if not isinstance(sections, dict) or sorted(sections) != sorted(SECTIONS):
        raise ProtocolError(f"codec_meta sections must be a map with keys {list(SECTIONS)}")
    for name in SECTIONS:
        if not isinstance(sections[name], dict):
            raise ProtocolError(f"codec_meta {name} must be a map")
    rows, dropped = _section_rows(tuple(sections[name].get("tokens") for name in SECTIONS), n_tok)
    entries = [(sections[name].get(w), f"{name}.{w}", r, w == "k") for name, r in zip(SECTIONS, rows, strict=True)
               for w in ("k", "v")]
    pruned = any(isinstance(e, dict) and e.get("channels") is not None for e, *_ in entries)
    # unpruned: every covered row is written, padding and dropped rows zeroed below
    out = (torch.zeros if pruned else torch.empty)(2, capacity, kvh, d, dtype=layout.torch_dtype)
    used = sum(_decode_entry(e, where, payload, r, out[0 if keys else 1], keys) for e, where, r, keys in entries)
    if used != payload.numel():
        raise ProtocolError(f"codec_meta entries cover {used} bytes; the payload has {payload.numel()}")
    if not pruned:
        out[:, n_tok:].zero_()
        if dropped is not None:
            out.index_fill_(1, dropped, 0)
    shape = layout.block_shape(num_blocks)
    return out[0].view(shape), out[1].view(shape), dropped


_TOKEN_ROWS: dict[tuple, tuple[tuple[Rows, ...], torch.Tensor | None]] = {}  # validated token masks -> rows


def _section_rows(masks: tuple[Any, ...], n_tok: int) -> tuple[tuple[Rows, ...], torch.Tensor | None]:
    """Each section's rows from its token bitmask, and the positions no section covers (None: all covered).
    Raises :class:`ProtocolError` for a malformed or overlapping mask (a distinct valid set is parsed once)."""
    key = (n_tok, *masks)
    hit = _TOKEN_ROWS.get(key) if all(isinstance(m, bytes) for m in masks) else None
    if hit is not None:
        return hit
    covered = np.zeros(n_tok, dtype=bool)
    rows = []
    for name, data in zip(SECTIONS, masks, strict=True):
        mask = unpack_bits(data, n_tok, f"{name}.tokens").numpy()
        if (mask & covered).any():
            raise ProtocolError(f"codec_meta {name}.tokens overlaps another section")
        covered |= mask
        rows.append(Rows.of(mask))
    lost = np.flatnonzero(~covered)
    value = (tuple(rows), torch.from_numpy(lost) if len(lost) else None)
    return remember(_TOKEN_ROWS, key, value) if all(isinstance(m, bytes) for m in masks) else value


_VALID_POLICIES: dict[bytes, None] = {}  # msgpack bytes of policy dicts already validated (senders send few)


def _check_policy(spec: Any) -> None:
    """Raise :class:`ProtocolError` unless ``spec`` is a valid policy dict (each distinct spec validated once)."""
    try:
        key = msgpack.packb(spec, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        key = None
    if key is not None and key in _VALID_POLICIES:
        return
    try:
        CompressionPolicy.from_dict(spec)
    except InvalidPolicy as e:
        raise ProtocolError(f"codec_meta policy: {e}") from None
    if key is not None:
        remember(_VALID_POLICIES, key, None)


_VALID_METHODS: dict[tuple, None] = {}  # (kind, bits, group, scale_dtype) already validated
_SCALE_DTYPES_FOR = {"raw": [None], "fp8": ["float32"], "int": list(SCALE_DTYPES)}


def _check_entry_method(kind: Any, bits: Any, group: Any, scale_dtype: Any, where: str) -> None:
    key = (kind, bits, group, scale_dtype)
    try:
        if key in _VALID_METHODS and all(type(x) in (str, int, type(None)) for x in key):
            return
    except TypeError:  # an unhashable field: validated (and refused) below
        pass
    try:
        check_method(kind, bits, group, 1.0, 1.0, where)
    except InvalidPolicy as e:
        raise ProtocolError(f"codec_meta {e}") from None
    allowed = _SCALE_DTYPES_FOR[kind]
    if scale_dtype not in allowed:
        raise ProtocolError(f"codec_meta {where}.scale_dtype must be one of {allowed} for kind {kind!r}, "
                            f"got {scale_dtype!r}")
    remember(_VALID_METHODS, key, None)


def _decode_entry(entry: Any, where: str, payload: torch.Tensor, rows: Rows, out: torch.Tensor,
                  keys: bool) -> int:
    """Validate one entry, decode it into ``out [capacity, kvh, d]`` at ``rows``; returns its byte length."""
    if not isinstance(entry, dict):
        raise ProtocolError(f"codec_meta {where} must be a map")
    kind, bits, group, scale_dtype = entry.get("kind"), entry.get("bits"), entry.get("group"), entry.get("scale_dtype")
    _check_entry_method(kind, bits, group, scale_dtype, where)
    _, kvh, d = out.shape
    chans = _parse_channels(entry.get("channels"), kvh, d, where)
    c = d if chans is None else chans.shape[1]
    enc = Encoding(kind, bits, group, scale_dtype, keys)
    n, length = rows.count, enc.nbytes(rows.count, kvh, c, out.element_size())
    off, ln = entry.get("offset"), entry.get("length")
    if not (is_int(off) and is_int(ln)) or off < 0 or ln != length or off + ln > payload.numel():
        raise ProtocolError(f"codec_meta {where}: offset {off!r} + length {ln!r} (expected length {length}) does not "
                            f"fit the {payload.numel()}-byte payload")
    if not n:
        return ln
    seg = payload[off:off + ln]
    if chans is not None:
        x = enc.decode(seg, n, kvh, c, out.dtype).to(out.dtype)
        out[rows.pos[:, None, None], torch.arange(kvh)[:, None], chans] = x
    elif kind == "raw":  # bytes straight into the rows
        rows.put(out.view(out.shape[0], -1).view(torch.uint8), seg.view(n, -1))
    elif kind == "int" and out.dtype == torch.float32 and rows.runs is not None and len(rows.runs) == 1:
        a, b = rows.runs[0]
        enc.decode(seg, n, kvh, c, out.dtype, out=out[a:b].view(n, -1))
    else:
        rows.put(out, enc.decode(seg, n, kvh, c, out.dtype).to(out.dtype))
    return ln


_CHANNELS: dict[tuple, torch.Tensor] = {}  # validated per-head channel masks -> indices


def _parse_channels(data: Any, kvh: int, d: int, where: str) -> torch.Tensor | None:
    """Sorted ``[kvh, c]`` kept-channel indices from per-head bitmasks (None: all channels)."""
    if data is None:
        return None
    if not isinstance(data, (list, tuple)) or len(data) != kvh:
        raise ProtocolError(f"codec_meta {where}.channels must be None or {kvh} per-head bitmasks")
    key = (d, *data) if all(isinstance(b, bytes) for b in data) else None
    if key is not None and key in _CHANNELS:
        return _CHANNELS[key]
    mask = torch.stack([unpack_bits(b, d, f"{where}.channels[{h}]") for h, b in enumerate(data)])
    counts = mask.sum(1)
    if int(counts.min()) < 1 or bool((counts != counts[0]).any()):
        raise ProtocolError(f"codec_meta {where}.channels must keep the same number (>= 1) of channels in every "
                            f"head, got {counts.tolist()}")
    chans = mask.nonzero()[:, 1].view(kvh, -1)
    return chans if key is None else remember(_CHANNELS, key, chans)


