"""Modality-aware KV compression on the wire: the per-request context and the ``modal`` codec (the policies it
follows: :mod:`kv_transfer.compression_policy`).

A layer's valid tokens (``CodecContext.num_tokens``; the padding of the last block never travels) split into a
TEXT and a VISUAL section by ``CodecContext.visual``. Per section, K and V are encoded separately:

1. visual tokens only: FastV-style dropping keeps the ``ceil(keep_visual_tokens * n)`` best-scored (at least 1);
2. ThinK-style channel pruning keeps the ``ceil(keep * head_dim)`` best-scored channels of every KV head;
3. the section's :class:`Method`: ``raw`` (pool dtype bytes), ``fp8`` (e4m3 codes, one float32 scale per KV head,
   ``amax / 448``) or ``int`` (KIVI-style asymmetric ``min + code * scale``, 8 or 4 bits, int4 packed two per byte
   low nibble first). Keys are quantized per channel over groups of ``group`` consecutive tokens; values per token
   over groups of ``group`` consecutive entries of the token's flattened ``[kv_heads * kept_channels]`` vector.
   The stored scale is rounded up and the stored min down, and codes come from the stored values, so
   ``|x - x_hat| <= stored_scale / 2`` (plus float rounding). Scales/mins are float16 when all fit, else float32.

Payload, per section (text, visual) and tensor (K, V): ``int``: ``scales | mins | codes`` (keys: scales
``[token_groups, kv_heads * kept]``; values: ``[channel_groups, tokens]``); ``fp8``: ``scales[kv_heads] | codes``;
``raw``: ``codes``. Codes are ``[tokens, kv_heads, kept_channels]`` row-major. Bitmasks are LSB first (bit ``i``
of byte ``j`` is item ``8j + i``). ``codec_meta`` holds everything a decoder needs; it never guesses, and every
malformed field raises :class:`ProtocolError`::

    {"v": 1, "policy": policy.to_dict(), "num_tokens": T, "checksum_chunk": N,
     "sections": {"text" | "visual": {"tokens": bitmask[T] of the positions sent,
                                      "k" | "v": {"kind", "bits", "group", "scale_dtype",
                                                  "channels": [bitmask[head_dim]] * kv_heads | None,
                                                  "offset", "length"}}},
     "stats": {"text" | "visual": {"tokens": sent, "dropped": n, "bytes": codes + scales + masks}}}

The receiver gets full-size K and V with zeros for pruned channels, dropped tokens and padding, plus the dropped
positions (``sink(layer, k, v, dropped=...)``, see :data:`kv_transfer.base.Sink`).

Worked example: the ``default`` policy (text raw, visual int8 group 64) on 36 visual tokens, 2 KV heads, head_dim
32: K = 2 * 1 group * 64 channels * 2 B (float16 scales + mins) + 36 * 64 codes = 2560 B; V = 2 * 36 tokens * 1
group * 2 B + 2304 = 2448 B; plus a 5-byte token mask: 5013 B for what float32 sends in 18432 B (3.68x).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from kv_transfer.base import KVLayout, ProtocolError
from kv_transfer.codec import Codec, get_codec, register_codec, tensor_bytes
from kv_transfer.compression_policy import (  # noqa: F401 - the policies are part of this module's API
    AGGRESSIVE,
    DEFAULT,
    INT_BITS,
    METHODS,
    POLICIES,
    POLICY_VERSION,
    SECTIONS,
    CompressionPolicy,
    InvalidPolicy,
    Method,
    check_method,
    is_int,
    needs_scores,
    resolve_policy,
)

META_VERSION = 1
CHECKSUM_CHUNK = 64 << 10  # bytes per crc32 of a modal payload
SCALE_DTYPES = {"float16": torch.float16, "float32": torch.float32}
FP8_MAX = 448.0


def codec_for(policy: CompressionPolicy | None) -> Codec:
    """The codec a sender should use for ``policy``: the identity codec for None, else a :class:`ModalCodec`."""
    return get_codec("identity") if policy is None else ModalCodec(policy)


@dataclass(eq=False)
class CodecContext:
    """What the codec needs to know about one request's layer. Positions are ``block * block_size + offset``.

    * ``num_tokens``: valid tokens; positions from here to the end of the last block are padding (not sent).
    * ``visual``: bool ``[num_tokens]``, True for image tokens.
    * ``k_channel_score`` / ``v_channel_score``: float ``[num_kv_heads, head_dim]``, higher = more important
      (default: the per-channel L2 norm of K resp. V over the section's tokens).
    * ``token_score``: float ``[num_tokens]``, higher = keep (default: the L2 norm of K over heads and channels).
    """

    num_tokens: int
    visual: torch.Tensor
    k_channel_score: torch.Tensor | None = None
    v_channel_score: torch.Tensor | None = None
    token_score: torch.Tensor | None = None

    def check(self, shape: tuple[int, ...]) -> None:
        """Raise ``ValueError`` unless this context fits K/V of ``shape`` = ``[num_blocks, block_size, kvh, d]``."""
        nb, bs, kvh, d = shape
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) \
                or not 0 <= self.num_tokens <= nb * bs:
            raise ValueError(f"CodecContext.num_tokens must be an int in [0, {nb * bs}], got {self.num_tokens!r}")
        if not isinstance(self.visual, torch.Tensor) or self.visual.dtype != torch.bool \
                or tuple(self.visual.shape) != (self.num_tokens,):
            raise ValueError(f"CodecContext.visual must be a bool tensor [{self.num_tokens}]")
        for name, want in (("k_channel_score", (kvh, d)), ("v_channel_score", (kvh, d)),
                           ("token_score", (self.num_tokens,))):
            t = getattr(self, name)
            if t is not None and (not isinstance(t, torch.Tensor) or not t.is_floating_point()
                                  or tuple(t.shape) != want):
                raise ValueError(f"CodecContext.{name} must be None or a float tensor {list(want)}")

    def detached(self) -> CodecContext:
        """A copy owning its tensors, so the caller may reuse its own at once."""
        own = {f: getattr(self, f).detach().clone() for f in ("visual", "k_channel_score", "v_channel_score",
                                                               "token_score") if getattr(self, f) is not None}
        return replace(self, **own)


# -- bit masks and dtype helpers ----------------------------------------------------------------------------------
def pack_bits(mask: torch.Tensor) -> bytes:
    """bool ``[n]`` -> ``ceil(n / 8)`` bytes, LSB first."""
    m = mask.detach().to("cpu", torch.uint8).flatten()
    padded = torch.zeros(-(-m.numel() // 8) * 8, dtype=torch.uint8)
    padded[:m.numel()] = m
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8).numpy().tobytes()


def unpack_bits(data: Any, n: int, what: str) -> torch.Tensor:
    """Inverse of :func:`pack_bits` (CPU bool ``[n]``); :class:`ProtocolError` for a wrong length or stray bits."""
    if not isinstance(data, (bytes, bytearray)) or len(data) != -(-n // 8):
        got = len(data) if isinstance(data, (bytes, bytearray)) else type(data).__name__
        raise ProtocolError(f"codec_meta {what}: bitmask must be {-(-n // 8)} bytes for {n} items, got {got}")
    if n == 0:
        return torch.zeros(0, dtype=torch.bool)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bits = ((raw[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten().bool()
    if bits[n:].any():
        raise ProtocolError(f"codec_meta {what}: bitmask has bits set past item {n}")
    return bits[:n]


def _view(seg: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 bytes viewed as ``dtype`` (copied first when misaligned)."""
    return (seg.clone() if seg.storage_offset() % dtype.itemsize else seg).view(dtype)


def _round_to(x: torch.Tensor, dtype: torch.dtype, *, up: bool) -> torch.Tensor:
    """float64 ``x`` rounded to ``dtype`` toward +inf (``up``) or -inf."""
    y = x.to(dtype)
    off = y.double() < x if up else y.double() > x
    return torch.where(off, torch.nextafter(y, torch.full_like(y, math.inf if up else -math.inf)), y)


def _keep_count(ratio: float, n: int) -> int:
    return max(1, math.ceil(ratio * n - 1e-9))  # 1e-9: 0.7 * 10 must keep 7, not 8


def _codes_nbytes(count: int, bits: int) -> int:
    return count if bits == 8 else -(-count // 2)


# -- per-method kernels: x is [n, kvh, c] (a section's tokens, kept channels) -------------------------------------
@dataclass(frozen=True)
class _Encoding:
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
        return 2 * groups * cols * SCALE_DTYPES[self.scale_dtype].itemsize + _codes_nbytes(n * kvh * c, self.bits)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, str | None]:
        """uint8 bytes of ``x`` and the scale dtype used."""
        if self.kind == "raw":
            return tensor_bytes(x), None
        if self.kind == "fp8":
            return _encode_fp8(x), "float32"
        return _encode_int(x, self.bits, self.group, self.keys)

    def decode(self, seg: torch.Tensor, n: int, kvh: int, c: int, dtype: torch.dtype) -> torch.Tensor:
        """``[n, kvh, c]`` from ``seg`` (exactly :meth:`nbytes` long): raw in ``dtype``, others float32."""
        if self.kind == "raw":
            return _view(seg, dtype).view(n, kvh, c)
        if self.kind == "fp8":
            scale = _view(seg[:4 * kvh], torch.float32)
            return seg[4 * kvh:].view(torch.float8_e4m3fn).float().view(n, kvh, c) * scale[:, None]
        return _decode_int(seg, n, kvh, c, self)


def _encode_fp8(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    amax = xf.abs().amax(dim=(0, 2))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (xf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat([tensor_bytes(scale), tensor_bytes(codes)])


def _scale_and_min(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored min and scale of groups with range ``[lo, hi]``: float16 when every value fits, else float32; the
    min rounded down and the scale up, so every value of a group lies within ``min + [0, levels] * scale``."""
    lo, hi = lo.double(), hi.double()
    for dtype in (torch.float16, torch.float32):
        mn = _round_to(lo, dtype, up=False)
        scale = _round_to((hi - mn.double()) / levels, dtype, up=True)
        if dtype == torch.float32 or bool(torch.isfinite(mn).all() and torch.isfinite(scale).all()):
            break
    return scale, mn


def _quantize(grouped: torch.Tensor, dim: int, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize float32 ``grouped`` over its group axis ``dim``: (scale, min) in their storage dtype with ``dim``
    reduced, and uint8 codes of ``grouped``'s shape computed from the stored values."""
    scale, mn = _scale_and_min(grouped.amin(dim), grouped.amax(dim), levels)
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(dim)  # scale 0: the group is constant, codes 0
    q = (grouped - mn.float().unsqueeze(dim)).div_(safe).round_().clamp_(0, levels)
    return scale, mn, q.to(torch.uint8)


def _pad_to(m: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``m`` extended along ``dim`` to ``size`` by repeating its last slice (a partial group's padding)."""
    extra = size - m.shape[dim]
    if extra == 0:
        return m
    last = m.narrow(dim, m.shape[dim] - 1, 1)
    return torch.cat([m, last.expand(*[extra if d == dim else -1 for d in range(m.dim())])], dim=dim)


def _encode_int(x: torch.Tensor, bits: int, group: int, keys: bool) -> tuple[torch.Tensor, str]:
    """Keys: per channel over groups of ``group`` tokens (scales ``[token_groups, kvh * c]``); values: per token over
    groups of ``group`` entries of its flattened ``[kvh * c]`` vector (scales ``[channel_groups, n]``). Codes are
    ``[n, kvh * c]`` row-major."""
    m = x.float().reshape(x.shape[0], -1)
    n, flat = m.shape
    levels = (1 << bits) - 1
    if keys:
        groups = -(-n // group)
        scale, mn, q = _quantize(_pad_to(m, 0, groups * group).view(groups, group, flat), 1, levels)
        codes = q.view(groups * group, flat)[:n]
    else:
        groups = -(-flat // group)
        scale, mn, q = _quantize(_pad_to(m, 1, groups * group).view(n, groups, group), 2, levels)
        codes = q.view(n, groups * group)[:, :flat]
        scale, mn = scale.t(), mn.t()
    codes = codes.contiguous().flatten()
    if bits == 4:
        if codes.numel() % 2:
            codes = torch.cat([codes, codes.new_zeros(1)])
        pairs = codes.view(-1, 2)
        codes = pairs[:, 0] | (pairs[:, 1] << 4)
    name = "float16" if scale.dtype == torch.float16 else "float32"
    return torch.cat([tensor_bytes(scale), tensor_bytes(mn), codes]), name


def _decode_int(seg: torch.Tensor, n: int, kvh: int, c: int, enc: _Encoding) -> torch.Tensor:
    flat = kvh * c
    rows, cols = (n, flat) if enc.keys else (flat, n)
    groups = -(-rows // enc.group)
    dtype = SCALE_DTYPES[enc.scale_dtype]
    half = groups * cols * dtype.itemsize
    scale = _view(seg[:half], dtype).float().view(groups, cols)
    mn = _view(seg[half:2 * half], dtype).float().view(groups, cols)
    codes = seg[2 * half:]
    if enc.bits == 4:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=1).flatten()[:n * flat]
    q = codes.view(n, flat).float()
    if enc.keys:  # token groups: [groups, group, flat] against [groups, 1, flat]
        out = _pad_to(q, 0, groups * enc.group).view(groups, enc.group, flat)
        out = (out * scale.unsqueeze(1)).add_(mn.unsqueeze(1)).view(groups * enc.group, flat)[:n]
    else:  # channel groups of each token: [n, groups, group] against [n, groups, 1]
        out = _pad_to(q, 1, groups * enc.group).view(n, groups, enc.group)
        out = (out * scale.t().unsqueeze(2)).add_(mn.t().unsqueeze(2)).view(n, groups * enc.group)[:, :flat]
    return out.reshape(n, kvh, c)


def _kept_channels(x: torch.Tensor, keep: float, score: torch.Tensor | None) -> torch.Tensor | None:
    """Sorted ``[kvh, c]`` indices of each head's best channels (``score``, else the L2 norm over tokens), or None
    when every channel is kept."""
    d = x.shape[2]
    c = _keep_count(keep, d)
    if c == d:
        return None
    s = score.to(x.device, torch.float32) if score is not None else x.float().norm(dim=0)
    return s.topk(c, dim=1).indices.sort(dim=1).values


# -- the codec ----------------------------------------------------------------------------------------------------
class ModalCodec:
    """Codec ``"modal"``: per-modality compression by ``policy`` (see the module docstring).

    Senders build one per policy (``manager.sender(lease, codec=ModalCodec(policy))``); the instance registered
    under ``"modal"`` (policy ``default``, used for ``Manager(codec="modal")``) decodes any policy from the header.
    ``encode(k, v, ctx)`` without a context treats every position as a valid text token.
    """

    name = "modal"

    def __init__(self, policy: CompressionPolicy) -> None:
        if not isinstance(policy, CompressionPolicy):
            raise TypeError(f"ModalCodec needs a CompressionPolicy, got {type(policy).__name__}")
        self.policy = policy

    def encode(self, k: torch.Tensor, v: torch.Tensor,
               ctx: CodecContext | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        nb, bs, kvh, d = k.shape
        if ctx is None:
            ctx = CodecContext(nb * bs, torch.zeros(nb * bs, dtype=torch.bool))
        ctx.check(tuple(k.shape))
        ks, vs = k.reshape(-1, kvh, d)[:ctx.num_tokens], v.reshape(-1, kvh, d)[:ctx.num_tokens]
        visual = ctx.visual.cpu()
        kept = self._kept_visual(ks, visual, ctx)
        blobs: list[torch.Tensor] = []
        sections: dict[str, Any] = {}
        stats: dict[str, Any] = {}
        offset = 0
        for name, method, mask in (("text", self.policy.text, ~visual), ("visual", self.policy.visual, kept)):
            pos = mask.nonzero().flatten().to(k.device)
            sec, nbytes = {"tokens": pack_bits(mask)}, 0
            for which, x, keep, score in (("k", ks, method.keep_k, ctx.k_channel_score),
                                          ("v", vs, method.keep_v, ctx.v_channel_score)):
                blob, sec[which] = _encode_entry(x.index_select(0, pos), method, which == "k", keep, score, offset)
                blobs.append(blob)
                offset += blob.numel()
                nbytes += blob.numel() + sum(len(b) for b in sec[which]["channels"] or ())
            sections[name] = sec
            dropped = int(visual.sum()) - pos.numel() if name == "visual" else 0
            stats[name] = {"tokens": pos.numel(), "dropped": dropped, "bytes": nbytes + len(sec["tokens"])}
        payload = torch.cat(blobs)
        meta = {"v": META_VERSION, "policy": self.policy.to_dict(), "num_tokens": ctx.num_tokens,
                "sections": sections, "stats": stats, "checksum_chunk": CHECKSUM_CHUNK}
        return payload, meta

    def _kept_visual(self, ks: torch.Tensor, visual: torch.Tensor, ctx: CodecContext) -> torch.Tensor:
        """CPU bool mask of the visual tokens that travel (FastV: the best ``keep_visual_tokens`` share, >= 1)."""
        n_visual = int(visual.sum())
        if self.policy.keep_visual_tokens >= 1 or n_visual == 0:
            return visual.clone()
        pos = visual.nonzero().flatten()
        dev_pos = pos.to(ks.device)
        if ctx.token_score is not None:
            score = ctx.token_score.to(ks.device)[dev_pos].float()
        else:
            score = ks.index_select(0, dev_pos).float().flatten(1).norm(dim=1)
        best = score.topk(_keep_count(self.policy.keep_visual_tokens, n_visual)).indices.cpu()
        kept = torch.zeros_like(visual)
        kept[pos[best]] = True
        return kept

    def decode(self, payload: torch.Tensor, header: dict[str, Any],
               layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Full ``[num_blocks, block_size, kvh, d]`` K and V in the layout's dtype (zeros for pruned channels,
        dropped tokens and padding) and the sorted dropped positions (or None). Raises only :class:`ProtocolError`."""
        try:
            return _decode(payload, header, layout)
        except ProtocolError:
            raise
        except Exception as e:  # a header that passed validation must still never crash the transport thread
            raise ProtocolError(f"modal codec could not decode a layer frame: {e!r}") from e


_EMPTY_SCALE_DTYPE = {"raw": None, "fp8": "float32", "int": "float16"}


def _encode_entry(x: torch.Tensor, method: Method, keys: bool, keep: float, score: torch.Tensor | None,
                  offset: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """One section's K or V: its bytes and its codec_meta entry."""
    n, kvh, d = x.shape
    chans = _kept_channels(x, keep, score) if n else None
    channels = None
    if chans is not None:
        x = x.gather(2, chans[None].expand(n, -1, -1))
        mask = torch.zeros(kvh, d, dtype=torch.bool, device=chans.device).scatter_(1, chans, True)
        channels = [pack_bits(row) for row in mask.cpu()]
    enc = _Encoding(method.kind, method.bits, method.group, None, keys)
    if n:
        blob, scale_dtype = enc.encode(x)
    else:  # nothing to scale; the header still names a valid dtype for the kind
        blob, scale_dtype = x.new_zeros(0, dtype=torch.uint8), _EMPTY_SCALE_DTYPE[method.kind]
    assert blob.numel() == replace(enc, scale_dtype=scale_dtype).nbytes(n, kvh, x.shape[2], x.element_size())
    return blob, {"kind": method.kind, "bits": method.bits, "group": method.group, "scale_dtype": scale_dtype,
                  "channels": channels, "offset": offset, "length": blob.numel()}


def _decode(payload: torch.Tensor, header: dict[str, Any],
            layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    meta = header["codec_meta"]
    if not isinstance(meta, dict) or meta.get("v") != META_VERSION:
        got = meta.get("v") if isinstance(meta, dict) else type(meta).__name__
        raise ProtocolError(f"modal codec_meta version {got!r} is not supported (expected {META_VERSION})")
    try:
        CompressionPolicy.from_dict(meta.get("policy"))
    except InvalidPolicy as e:
        raise ProtocolError(f"codec_meta policy: {e}") from None
    num_blocks, kvh, d = header["num_blocks"], layout.num_kv_heads, layout.head_dim
    capacity = num_blocks * layout.block_size
    n_tok = meta.get("num_tokens")
    if not is_int(n_tok) or not 0 <= n_tok <= capacity:
        raise ProtocolError(f"codec_meta num_tokens {n_tok!r} is outside [0, {capacity}] (the lease's capacity)")
    sections = meta.get("sections")
    if not isinstance(sections, dict) or sorted(sections) != sorted(SECTIONS):
        raise ProtocolError(f"codec_meta sections must be a map with keys {list(SECTIONS)}")
    pruned = any(isinstance(sec, dict) and isinstance(sec.get(w), dict) and sec[w].get("channels") is not None
                 for sec in sections.values() for w in ("k", "v"))
    alloc = torch.zeros if pruned else torch.empty  # unpruned: every row is written or zeroed below
    out = {w: alloc(capacity, kvh, d, dtype=layout.torch_dtype, device=payload.device) for w in ("k", "v")}
    covered, used = torch.zeros(n_tok, dtype=torch.bool), 0
    for name in SECTIONS:
        sec = sections[name]
        if not isinstance(sec, dict):
            raise ProtocolError(f"codec_meta {name} must be a map")
        mask = unpack_bits(sec.get("tokens"), n_tok, f"{name}.tokens")
        if (mask & covered).any():
            raise ProtocolError(f"codec_meta {name}.tokens overlaps another section")
        covered |= mask
        pos = mask.nonzero().flatten().to(payload.device)
        for which in ("k", "v"):
            used += _decode_entry(sec.get(which), f"{name}.{which}", payload, pos, out[which], which == "k")
    if used != payload.numel():
        raise ProtocolError(f"codec_meta entries cover {used} bytes; the payload has {payload.numel()}")
    dropped = (~covered).nonzero().flatten().to(payload.device)
    if not pruned:
        for t in out.values():
            t[n_tok:].zero_()
            t.index_fill_(0, dropped, 0)
    shape = layout.block_shape(num_blocks)
    return out["k"].view(shape), out["v"].view(shape), dropped if dropped.numel() else None


def _decode_entry(entry: Any, where: str, payload: torch.Tensor, pos: torch.Tensor, out: torch.Tensor,
                  keys: bool) -> int:
    """Validate one entry, decode it into ``out [capacity, kvh, d]`` at rows ``pos``; returns its byte length."""
    if not isinstance(entry, dict):
        raise ProtocolError(f"codec_meta {where} must be a map")
    kind, scale_dtype = entry.get("kind"), entry.get("scale_dtype")
    try:
        check_method(kind, entry.get("bits"), entry.get("group"), 1.0, 1.0, where)
    except InvalidPolicy as e:
        raise ProtocolError(f"codec_meta {e}") from None
    allowed = {"raw": [None], "fp8": ["float32"], "int": list(SCALE_DTYPES)}[kind]
    if scale_dtype not in allowed:
        raise ProtocolError(f"codec_meta {where}.scale_dtype must be one of {allowed} for kind {kind!r}, "
                            f"got {scale_dtype!r}")
    _, kvh, d = out.shape
    chans = _parse_channels(entry.get("channels"), kvh, d, where)
    c = d if chans is None else chans.shape[1]
    enc = _Encoding(kind, entry.get("bits"), entry.get("group"), scale_dtype, keys)
    n, length = pos.numel(), enc.nbytes(pos.numel(), kvh, c, out.element_size())
    off, ln = entry.get("offset"), entry.get("length")
    if not (is_int(off) and is_int(ln)) or off < 0 or ln != length or off + ln > payload.numel():
        raise ProtocolError(f"codec_meta {where}: offset {off!r} + length {ln!r} (expected length {length}) does not "
                            f"fit the {payload.numel()}-byte payload")
    if n:
        x = enc.decode(payload[off:off + ln], n, kvh, c, out.dtype).to(out.dtype)
        if chans is None:
            out.index_copy_(0, pos, x)
        else:
            heads = torch.arange(kvh, device=out.device)[:, None]
            out[pos[:, None, None], heads, chans.to(out.device)] = x
    return ln


def _parse_channels(data: Any, kvh: int, d: int, where: str) -> torch.Tensor | None:
    """Sorted ``[kvh, c]`` kept-channel indices from per-head bitmasks (None: all channels)."""
    if data is None:
        return None
    if not isinstance(data, (list, tuple)) or len(data) != kvh:
        raise ProtocolError(f"codec_meta {where}.channels must be None or {kvh} per-head bitmasks")
    mask = torch.stack([unpack_bits(b, d, f"{where}.channels[{h}]") for h, b in enumerate(data)])
    counts = mask.sum(1)
    if int(counts.min()) < 1 or bool((counts != counts[0]).any()):
        raise ProtocolError(f"codec_meta {where}.channels must keep the same number (>= 1) of channels in every "
                            f"head, got {counts.tolist()}")
    return mask.nonzero()[:, 1].view(kvh, -1)


register_codec(ModalCodec(DEFAULT))
