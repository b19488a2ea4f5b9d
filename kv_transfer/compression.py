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

The codec computes on the CPU (KV on another device is copied to host memory first; the payload, and on the
receiver the decoded K and V, go back to that device). A layer costs a few vectorised passes over its bytes plus a
fixed few tens of microseconds: the sections' token positions are derived once per distinct visual mask (cached),
and every entry writes straight into the one payload buffer.

The receiver gets full-size K and V with zeros for pruned channels, dropped tokens and padding, plus the dropped
positions (``sink(layer, k, v, dropped=...)``, see :data:`kv_transfer.base.Sink`).

Worked example: the ``default`` policy (text raw, visual int8 group 64) on 36 visual tokens, 2 KV heads, head_dim
32: K = 2 * 1 group * 64 channels * 2 B (float16 scales + mins) + 36 * 64 codes = 2560 B; V = 2 * 36 tokens * 1
group * 2 B + 2304 = 2448 B; plus a 5-byte token mask: 5013 B for what float32 sends in 18432 B (3.68x).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from kv_transfer.codec import Codec, CodecContext, get_codec, register_codec  # noqa: F401 - CodecContext: API
from kv_transfer.errors import ProtocolError
from kv_transfer.layout import KVLayout
from kv_transfer.compression_int import (  # noqa: F401 - FP8_MAX and SCALE_DTYPES are part of this module's API
    FP8_MAX,
    SCALE_DTYPES,
    Encoding,
    encode_fp8_into,
    encode_int_into,
    fp8_scale,
    int_params,
    keep_count,
)
from kv_transfer.compression_wire import META_VERSION, Rows, decode, pack_bits, remember, unpack_bits  # noqa: F401
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

CHECKSUM_CHUNK = 64 << 10  # bytes per crc32 of a modal payload
_CPU = torch.device("cpu")


def codec_for(policy: CompressionPolicy | None) -> Codec:
    """The codec a sender should use for ``policy``: the identity codec for None, else a :class:`ModalCodec`."""
    return get_codec("identity") if policy is None else ModalCodec(policy)


def max_layer_payload(layout: KVLayout, num_blocks: int) -> int:
    """The most bytes one layer frame's payload takes under this package's codecs, so that a receiver can bound
    what it buffers for a header before the frame is verified. Identity sends the raw bytes; ``modal`` sends per
    value at most the raw bytes (``raw``) or one code byte plus a float32 scale and min (``int``, groups of one),
    and per entry (text / visual x K / V) one float32 scale per KV head (``fp8``).

    Worked example: float16, 1 block of 4 tokens, 2 KV heads, head_dim 8: 2 x 64 values x 9 B + 4 x 2 x 4 B =
    1184 B, where the raw layer is 256 B."""
    values = 2 * math.prod(layout.block_shape(num_blocks))
    per_value = max(layout.layer_nbytes(num_blocks) // values, 1 + 2 * SCALE_DTYPES["float32"].itemsize)
    return values * per_value + 4 * layout.num_kv_heads * SCALE_DTYPES["float32"].itemsize


def _kept_channels(x: torch.Tensor, keep: float, score: torch.Tensor | None) -> torch.Tensor | None:
    """Sorted ``[kvh, c]`` indices of each head's best channels (``score``, else the L2 norm over tokens), or None
    when every channel is kept."""
    d = x.shape[2]
    c = keep_count(keep, d)
    if c == d:
        return None
    s = score.to(_CPU, torch.float32) if score is not None else x.float().norm(dim=0)
    return s.topk(c, dim=1).indices.sort(dim=1).values


# -- one entry (a section's K or V) -------------------------------------------------------------------------------
_EMPTY_SCALE_DTYPE = {"raw": None, "fp8": "float32", "int": "float16"}


class _Entry:
    """A section's K or V, prepared (channels chosen, statistics taken) so its byte length is known before the
    payload is allocated; :meth:`write` then fills its slice."""

    def __init__(self, src: torch.Tensor, rows: Rows, method: Method, keys: bool, keep: float,
                 score: torch.Tensor | None) -> None:
        """``src``: the layer's K or V ``[num_tokens, kvh, d]`` (pool dtype, CPU); ``rows``: the section's."""
        self.method, self.keys, self.rows = method, keys, rows
        self.channels: list[bytes] | None = None
        self.source: torch.Tensor | None = None
        n, (_, kvh, d) = rows.count, src.shape
        x = chans = None
        if n and keep_count(keep, d) < d:
            x = rows.take(src)
            chans = _kept_channels(x, keep, score)
            x = x.gather(2, chans[None].expand(n, -1, -1))
            mask = np.zeros((kvh, d), dtype=bool)
            mask[np.arange(kvh)[:, None], chans.numpy()] = True
            self.channels = [row.tobytes() for row in np.packbits(mask, axis=1, bitorder="little")]
        self.c = d if chans is None else chans.shape[1]
        scale_dtype = _EMPTY_SCALE_DTYPE[method.kind]
        if method.kind == "raw":
            if x is None:
                self.source = src.reshape(src.shape[0], -1).view(torch.uint8)
        elif n:
            x = rows.take(src) if x is None else x
            self.xf = x.float().reshape(n, -1)
            if method.kind == "fp8":
                self.scale = fp8_scale(self.xf.view(n, kvh, self.c))
            else:
                self.stats = int_params(self.xf, method.bits, method.group, keys)
                scale_dtype = self.stats.dtype_name
        self.x, self.kvh = x, kvh
        self.enc = Encoding(method.kind, method.bits, method.group, scale_dtype, keys)
        self.length = self.enc.nbytes(n, kvh, self.c, src.element_size())

    def write(self, out: torch.Tensor) -> None:
        """Fill ``out`` (uint8, exactly :attr:`length` bytes of the payload)."""
        n = self.rows.count
        if not n:
            return
        kind = self.method.kind
        if kind == "raw":
            if self.source is not None:  # unpruned: the pool's rows straight into the payload
                self.rows.take(self.source, out=out.view(n, -1))
            else:
                out.view(n, -1).copy_(self.x.reshape(n, -1).view(torch.uint8))
        elif kind == "fp8":
            encode_fp8_into(self.xf.view(n, self.kvh, self.c), self.scale, out)
        else:
            encode_int_into(self.xf, self.stats, self.method.bits, self.method.group, self.keys, out)

    def meta(self, offset: int) -> dict[str, Any]:
        m = self.method
        return {"kind": m.kind, "bits": m.bits, "group": m.group, "scale_dtype": self.enc.scale_dtype,
                "channels": self.channels, "offset": offset, "length": self.length}


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
        self._sections: dict[bytes, tuple[Rows, Rows]] = {}  # visual mask bytes -> (text, visual) rows

    def encode(self, k: torch.Tensor, v: torch.Tensor,
               ctx: CodecContext | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        nb, bs, kvh, d = k.shape
        if ctx is None:
            ctx = CodecContext(nb * bs, torch.zeros(nb * bs, dtype=torch.bool))
        ctx.check(tuple(k.shape))
        n = ctx.num_tokens
        ks, vs = k.to(_CPU).reshape(-1, kvh, d)[:n], v.to(_CPU).reshape(-1, kvh, d)[:n]
        text, visual, n_visual = self._rows(ks, ctx)
        entries: list[_Entry] = []
        for method, rows in ((self.policy.text, text), (self.policy.visual, visual)):
            entries.append(_Entry(ks, rows, method, True, method.keep_k, ctx.k_channel_score))
            entries.append(_Entry(vs, rows, method, False, method.keep_v, ctx.v_channel_score))
        payload = torch.empty(sum(e.length for e in entries), dtype=torch.uint8)
        sections: dict[str, Any] = {}
        stats: dict[str, Any] = {}
        offset = 0
        for i, (name, rows) in enumerate((("text", text), ("visual", visual))):
            sec, nbytes = {"tokens": rows.mask}, len(rows.mask)
            for which, e in zip(("k", "v"), entries[2 * i:2 * i + 2], strict=True):
                e.write(payload[offset:offset + e.length])
                sec[which] = e.meta(offset)
                offset += e.length
                nbytes += e.length + sum(len(b) for b in e.channels or ())
            sections[name] = sec
            stats[name] = {"tokens": rows.count, "dropped": n_visual - rows.count if name == "visual" else 0,
                           "bytes": nbytes}
        meta = {"v": META_VERSION, "policy": self._policy_dict, "num_tokens": n, "sections": sections,
                "stats": stats, "checksum_chunk": CHECKSUM_CHUNK}
        return (payload if k.device == _CPU else payload.to(k.device)), meta

    def _rows(self, ks: torch.Tensor, ctx: CodecContext) -> tuple[Rows, Rows, int]:
        """The text and visual (kept) rows of this layer and the count of visual tokens. Without token dropping
        they depend on the visual mask alone and are derived once per distinct mask."""
        visual = ctx.visual.to(_CPU).numpy()
        if self.policy.keep_visual_tokens >= 1:
            key = visual.tobytes()
            hit = self._sections.get(key)
            if hit is None:
                hit = remember(self._sections, key, (Rows.of(~visual), Rows.of(visual)))
            return hit[0], hit[1], hit[1].count
        n_visual = int(visual.sum())
        kept = visual.copy()
        if n_visual:
            pos = torch.from_numpy(np.flatnonzero(visual))
            if ctx.token_score is not None:
                score = ctx.token_score.to(_CPU, torch.float32)[pos]
            else:
                score = ks.index_select(0, pos).float().flatten(1).norm(dim=1)
            kept[:] = False
            kept[pos[score.topk(keep_count(self.policy.keep_visual_tokens, n_visual)).indices].numpy()] = True
        return Rows.of(~visual), Rows.of(kept), n_visual

    def decode(self, payload: torch.Tensor, header: dict[str, Any],
               layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Full ``[num_blocks, block_size, kvh, d]`` K and V in the layout's dtype (zeros for pruned channels,
        dropped tokens and padding) and the sorted dropped positions (or None). Raises only :class:`ProtocolError`."""
        try:
            k, v, dropped = decode(payload.to(_CPU), header, layout)
        except ProtocolError:
            raise
        except Exception as e:  # a header that passed validation must still never crash the transport thread
            raise ProtocolError(f"modal codec could not decode a layer frame: {e!r}") from e
        if payload.device == _CPU:
            return k, v, dropped
        dev = payload.device
        return k.to(dev), v.to(dev), None if dropped is None else dropped.to(dev)


register_codec(ModalCodec(DEFAULT))
