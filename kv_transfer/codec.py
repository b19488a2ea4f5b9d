"""Block codec: turns one layer's K and V into a payload plus checksums, and back.

A layer frame's payload is ``codec.encode(k, v, ctx)``'s bytes. Checksums come in one of two shapes, declared by
``codec_meta``:

* ``"planes": [nbytes, ...]`` (identity): the payload is *planes* (all of K, then all of V); every plane splits
  into ``num_blocks`` equal parts, and a block's crc32 runs over its part of every plane in order.
* ``"checksum_chunk": N`` (payloads that are not block-aligned, e.g. :mod:`kv_transfer.compression`): one crc32
  per ``N`` bytes of the payload, the last chunk partial.

Checksums are computed over what travels (after encoding, on the device the payload travels from), on the
sender's transport thread; the receiver checks them before decoding and never decodes a failed frame. The crc32 is
ISA-L's (``isal``: the polynomial and values of zlib's, at tens of GB/s a core where zlib runs at ~2), so
frames from any version verify alike. No pickle: tensors travel as raw bytes in their own dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch
from isal.isal_zlib import crc32

from kv_transfer.errors import ChecksumMismatch, ProtocolError, TransferError
from kv_transfer.layout import DTYPES, KVLayout


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


@runtime_checkable
class Codec(Protocol):
    """Encodes one layer's K and V (``[num_blocks, block_size, kv_heads, head_dim]`` each, same dtype).

    ``encode`` returns a contiguous uint8 tensor (on the input's device) and a msgpack-able ``codec_meta`` with
    ``"planes"`` or ``"checksum_chunk"`` (module docstring); ``ctx`` (request context: valid tokens, modality,
    scores) may be None and a codec may ignore it. ``decode`` inverts it given the frame header (which carries
    ``codec_meta``, ``dtype`` and ``shape``): full ``k, v`` in the layout's dtype plus the sorted positions of tokens
    the sender dropped (``LongTensor``) or None. Both are pure: no state between calls.
    """

    name: str

    def encode(self, k: torch.Tensor, v: torch.Tensor,
               ctx: CodecContext | None = None) -> tuple[torch.Tensor, dict[str, Any]]: ...

    def decode(self, payload: torch.Tensor, header: dict[str, Any],
               layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (made contiguous) as a flat uint8 tensor; works for bf16 (no numpy involved)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


class IdentityCodec:
    """Raw bytes of the pool dtype: payload = K bytes then V bytes (every position, padding included)."""

    name = "identity"

    def encode(self, k: torch.Tensor, v: torch.Tensor,
               ctx: CodecContext | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        kb, vb = tensor_bytes(k), tensor_bytes(v)
        return torch.cat([kb, vb]), {"planes": [kb.numel(), vb.numel()]}

    def decode(self, payload: torch.Tensor, header: dict[str, Any],
               layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor, None]:
        kn, vn = header["codec_meta"]["planes"]
        dtype = DTYPES[header["dtype"]]
        shape = tuple(header["shape"][1:])
        k = payload[:kn].view(dtype).view(shape)
        v = payload[kn:kn + vn].view(dtype).view(shape)
        return k, v, None


_CODECS: dict[str, Codec] = {}


def register_codec(codec: Codec) -> None:
    """Make ``codec`` available by ``codec.name`` to senders and receivers of this process."""
    assert isinstance(codec, Codec), codec
    _CODECS[codec.name] = codec


def get_codec(name: str) -> Codec:
    """The registered codec called ``name``; raises :class:`ProtocolError` when unknown."""
    try:
        return _CODECS[name]
    except KeyError:
        raise ProtocolError(f"unknown codec {name!r} (known: {sorted(_CODECS)})") from None


register_codec(IdentityCodec())


def block_checksums(payload: torch.Tensor, planes: list[int], num_blocks: int) -> list[int]:
    """crc32 per block over its share of every plane (see module docstring). ``payload`` is uint8, any device."""
    if not isinstance(planes, list) or not all(isinstance(p, int) and p >= 0 for p in planes):
        raise ProtocolError(f"codec_meta planes must be a list of byte counts, got {planes!r}")
    if sum(planes) != payload.numel() or any(p % num_blocks for p in planes):
        raise ProtocolError(f"planes {planes} do not split {payload.numel()} bytes into {num_blocks} blocks")
    mv = memoryview(payload.cpu().numpy())
    sums = []
    for b in range(num_blocks):
        crc, off = 0, 0
        for p in planes:
            step = p // num_blocks
            crc = crc32(mv[off + b * step: off + (b + 1) * step], crc)
            off += p
        sums.append(crc)
    return sums


def chunk_checksums(payload: torch.Tensor, chunk: int) -> list[int]:
    """crc32 per ``chunk`` bytes of ``payload`` (uint8, any device), the last chunk partial."""
    mv = memoryview(payload.cpu().numpy())
    return [crc32(mv[off:off + chunk]) for off in range(0, len(mv), chunk)]


def _checksum_unit(codec_meta: dict[str, Any], nbytes: int, num_blocks: int) -> tuple[str, int]:
    """What ``codec_meta`` says one checksum covers (``"block"`` or ``"chunk"``) and how many there must be."""
    chunk = codec_meta.get("checksum_chunk")
    if chunk is None:
        return "block", num_blocks
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ProtocolError(f"codec_meta checksum_chunk must be a positive int, got {chunk!r}")
    return "chunk", -(-nbytes // chunk)


def payload_checksums(payload: torch.Tensor, codec_meta: dict[str, Any], num_blocks: int) -> list[int]:
    """The checksums ``codec_meta`` declares (module docstring): per chunk, or per block over the planes."""
    if _checksum_unit(codec_meta, payload.numel(), num_blocks)[0] == "chunk":
        return chunk_checksums(payload, codec_meta["checksum_chunk"])
    return block_checksums(payload, codec_meta.get("planes"), num_blocks)


_DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}


def encode_layer(request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor, codec: Codec,
                 ctx: CodecContext | None = None, *,
                 payload_device: torch.device | None = None) -> tuple[dict[str, Any], torch.Tensor]:
    """A layer frame: ``(header, payload)``; the header lacks only ``"v"``/``"kind"``/``"to"`` (see frames.py).

    Encodes on ``k``'s device; only the finished payload moves to ``payload_device`` (None: it stays), and the
    checksums run over the payload there.
    """
    num_blocks = k.shape[0]
    payload, codec_meta = codec.encode(k, v, ctx)
    if payload_device is not None and payload.device != payload_device:
        payload = payload.to(payload_device)
    dtype = _DTYPE_NAMES[k.dtype]
    header = {
        "request_id": request_id, "layer": layer, "first_block": 0, "num_blocks": num_blocks, "dtype": dtype,
        "shape": [2, *k.shape], "codec": codec.name, "codec_meta": codec_meta,
        "checksums": payload_checksums(payload, codec_meta, num_blocks), "nbytes": payload.numel(),
    }
    return header, payload


def decode_layer(header: dict[str, Any], payload: torch.Tensor | None, layout: KVLayout, *,
                 device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Verify a layer frame against ``layout`` and its checksums, then decode it to ``(k, v, dropped)``.

    ``device``: where to decode (the KV pool's device); the still-compressed payload moves there after the checksums.

    ``dropped``: sorted positions (``LongTensor``) of tokens the sender did not send, or None. Raises
    :class:`ChecksumMismatch` naming the failed blocks (or chunks), or :class:`ProtocolError` for a malformed frame
    (a codec failing on a checksum-clean frame is one too).
    """
    try:
        num_blocks, nbytes, checksums = header["num_blocks"], header["nbytes"], header["checksums"]
        codec_meta = header["codec_meta"]
        codec = get_codec(header["codec"])
    except (KeyError, TypeError) as e:
        raise ProtocolError(f"malformed layer frame header: missing {e}") from e
    if not isinstance(codec_meta, dict) or not isinstance(checksums, list):
        raise ProtocolError("malformed layer frame header: codec_meta must be a map and checksums a list")
    if header.get("dtype") != layout.dtype or header.get("shape") != [2, *layout.block_shape(num_blocks)]:
        raise ProtocolError(f"frame dtype/shape {header.get('dtype')}/{header.get('shape')} do not match the layout")
    size = 0 if payload is None else payload.numel()
    unit, count = _checksum_unit(codec_meta, size, num_blocks)
    if size != nbytes or len(checksums) != count:
        raise ProtocolError(f"frame carries {size} bytes and {len(checksums)} checksums; header says {nbytes} "
                            f"bytes and {count} {unit}s")
    if payload is None:
        payload = torch.empty(0, dtype=torch.uint8)
    got = payload_checksums(payload, codec_meta, num_blocks)
    bad = [i for i in range(count) if got[i] != checksums[i]]
    if bad:
        raise ChecksumMismatch(f"request {header['request_id']!r} layer {header['layer']}: crc32 mismatch in "
                               f"{unit}(s) {bad}")
    if device is not None and payload.device != device:
        payload = payload.to(device, non_blocking=False)
    try:
        return codec.decode(payload, header, layout)
    except TransferError:
        raise
    except Exception as e:  # a header that passed the checks above must still never crash the transport thread
        raise ProtocolError(f"codec {codec.name!r} could not decode layer {header.get('layer')!r}: {e!r}") from e
