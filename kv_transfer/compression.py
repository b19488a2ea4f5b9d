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

import msgpack
import numpy as np
import torch
import torch.nn.functional as F

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


def _view(seg: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 bytes viewed as ``dtype`` (copied first when misaligned)."""
    return (seg.clone() if seg.storage_offset() % dtype.itemsize else seg).view(dtype)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (no dispatch when it is there already: these run per section, per layer)."""
    return t if t.device == device else t.to(device)


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


# float16 scales / mins while every value of the entry is below this (mins and scales then stay finite)
FLOAT16_RANGE = 60000.0
# float32 rounding slack of (hi - mn) / levels, so the stored scale never falls below the exact one
_SCALE_UP = 1 + 2.0 ** -21


def _scale_and_min(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored scale and min of groups with range ``[lo, hi]`` (float32): float16 when every value fits, else
    float32; the min rounded down and the scale up, so every value of a group lies within ``min + [0, levels] *
    scale``. A handful of elementwise ops over the ``[groups, cols]`` statistics, whatever the group count."""
    if float(lo.amin()) > -FLOAT16_RANGE and float(hi.amax()) < FLOAT16_RANGE:
        mn = lo.to(torch.float16)
        mn = torch.where(mn.float() > lo, torch.nextafter(mn, _NEG_INF.get(lo.device)), mn)  # round down
        s = (hi - mn.float()).mul_(_SCALE_UP / levels)
        # round up: * (1 + 2^-10) covers float16's half-ulp, + 2^-24 its subnormals (never a zero scale)
        return s.mul_(1 + 2.0 ** -10).add_(2.0 ** -24).to(torch.float16), mn
    s = (hi - lo).mul_(_SCALE_UP / levels)  # lo is exact in float32: no rounding of the min
    return torch.nextafter(s, _POS_INF.get(lo.device)), lo


class _Inf:
    """0-dim ±inf per device, for ``torch.nextafter`` (no allocation per call)."""

    def __init__(self, value: float) -> None:
        self.value, self.by_device = value, {}

    def get(self, device: torch.device) -> torch.Tensor:
        t = self.by_device.get(device)
        if t is None:
            t = self.by_device[device] = torch.tensor(self.value, device=device)
        return t


_NEG_INF, _POS_INF = _Inf(-math.inf), _Inf(math.inf)


def _grouped(m: torch.Tensor, keys: bool, group: int) -> tuple[torch.Tensor, int]:
    """``m [n, flat]`` as ``[groups, group, flat]`` (keys: token groups) or ``[n, groups, group]`` (values:
    channel groups), a partial last group padded by repeating its last row / column (min and max unchanged); and
    the group axis."""
    dim = 0 if keys else 1
    size = m.shape[dim]
    groups = -(-size // group)
    extra = groups * group - size
    if extra:
        last = m.narrow(dim, size - 1, 1)
        m = torch.cat([m, last.expand((extra, -1) if keys else (-1, extra))], dim=dim)
    return (m.view(groups, group, -1) if keys else m.view(m.shape[0], groups, group)), dim + 1


def _encode_int(x: torch.Tensor, bits: int, group: int, keys: bool) -> tuple[torch.Tensor, str]:
    """Keys: per channel over groups of ``group`` tokens (scales ``[token_groups, kvh * c]``); values: per token over
    groups of ``group`` entries of its flattened ``[kvh * c]`` vector (scales ``[channel_groups, n]``). Codes are
    ``[n, kvh * c]`` row-major. One pass of whole-tensor ops: no Python loop over groups or tokens."""
    n = x.shape[0]
    m = x.reshape(n, -1).float()
    flat = m.shape[1]
    levels = (1 << bits) - 1
    g, dim = _grouped(m, keys, group)
    lo, hi = g.amin(dim), g.amax(dim)  # not aminmax: 5x slower than the pair on small layers (torch 2.13 CPU)
    scale, mn = _scale_and_min(lo, hi, levels)
    inv = torch.reciprocal(scale.float()).unsqueeze(dim)  # not in place: float() of float32 scales is no copy
    q = (g - mn.float().unsqueeze(dim)).mul_(inv).round_().clamp_(0, levels).to(torch.uint8)
    codes = q.view(-1, flat)[:n] if keys else q.view(n, -1)[:, :flat]
    if not keys:
        scale, mn = scale.t(), mn.t()
    codes = codes.reshape(-1)
    if bits == 4:
        if codes.numel() % 2:
            codes = torch.cat([codes, codes.new_zeros(1)])
        codes = codes[0::2] | (codes[1::2] << 4)
    name = "float16" if scale.dtype == torch.float16 else "float32"
    return torch.cat([tensor_bytes(scale), tensor_bytes(mn), codes]), name


def _decode_int(seg: torch.Tensor, n: int, kvh: int, c: int, enc: _Encoding) -> torch.Tensor:
    flat = kvh * c
    rows, cols = (n, flat) if enc.keys else (flat, n)
    groups = -(-rows // enc.group)
    dtype = SCALE_DTYPES[enc.scale_dtype]
    half = groups * cols * dtype.itemsize
    scale = _view(seg[:half], dtype).view(groups, cols)
    mn = _view(seg[half:2 * half], dtype).view(groups, cols)
    codes = seg[2 * half:]
    if enc.bits == 4:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=1).view(-1)[:n * flat]
    # grouped views against broadcast statistics: no full-size copies of the scales and mins
    q = codes.view(n, flat).float()
    if enc.keys:  # token groups: [groups, group, flat] against [groups, 1, flat]
        pad = groups * enc.group - n
        q = F.pad(q, (0, 0, 0, pad)) if pad else q
        out = torch.addcmul(mn.float().unsqueeze(1), q.view(groups, enc.group, flat), scale.float().unsqueeze(1))
        out = out.reshape(groups * enc.group, flat)[:n]
    else:  # channel groups of each token: [n, groups, group] against [n, groups, 1]
        pad = groups * enc.group - flat
        q = F.pad(q, (0, pad)) if pad else q
        out = torch.addcmul(mn.float().t().unsqueeze(2), q.view(n, groups, enc.group), scale.float().t().unsqueeze(2))
        out = out.reshape(n, groups * enc.group)[:, :flat]
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
        self._policy_dict = policy.to_dict()  # dataclass asdict costs tens of µs: built once, shared read-only

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
            pos = _on(mask.nonzero().flatten(), k.device)
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
        meta = {"v": META_VERSION, "policy": self._policy_dict, "num_tokens": ctx.num_tokens,
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
    _check_policy(meta.get("policy"))
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
        pos = _on(mask.nonzero().flatten(), payload.device)
        for which in ("k", "v"):
            used += _decode_entry(sec.get(which), f"{name}.{which}", payload, pos, out[which], which == "k")
    if used != payload.numel():
        raise ProtocolError(f"codec_meta entries cover {used} bytes; the payload has {payload.numel()}")
    dropped = _on((~covered).nonzero().flatten(), payload.device)
    if not pruned:
        for t in out.values():
            t[n_tok:].zero_()
            t.index_fill_(0, dropped, 0)
    shape = layout.block_shape(num_blocks)
    return out["k"].view(shape), out["v"].view(shape), dropped if dropped.numel() else None


_VALID_POLICIES: dict[str, None] = {}  # msgpack bytes of policy dicts already validated (senders send few)


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
    if key is not None and len(_VALID_POLICIES) < 256:
        _VALID_POLICIES[key] = None


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
