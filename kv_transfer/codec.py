"""Block codec: turns one layer's K and V into a payload plus per-block checksums, and back.

A layer frame's payload is ``codec.encode(k, v)``'s bytes. The codec lays them out as *planes* (for identity:
all of K, then all of V); every plane splits into ``num_blocks`` equal parts, and a block's crc32 runs over its
part of every plane in order. So a compressing codec only has to keep its per-block output equal-sized per plane
(codes, scales, ...) and list the plane sizes in ``codec_meta["planes"]`` for checksums to stay per block.

Checksums are computed over what travels (after encoding), on the sender's transport thread; the receiver checks
them before decoding and never decodes a failed frame. No pickle: tensors travel as raw bytes in their own dtype.
"""

from __future__ import annotations

import zlib
from typing import Any, Protocol, runtime_checkable

import torch

from kv_transfer.base import DTYPES, ChecksumMismatch, KVLayout, ProtocolError


@runtime_checkable
class Codec(Protocol):
    """Encodes one layer's K and V (``[num_blocks, block_size, kv_heads, head_dim]`` each, same dtype).

    ``encode`` returns a contiguous uint8 tensor (on the input's device) and a msgpack-able ``codec_meta`` with at
    least ``"planes": [nbytes, ...]``; ``decode`` inverts it given the frame header (which carries ``codec_meta``,
    ``dtype`` and ``shape``). Both are pure: no state between calls.
    """

    name: str

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]: ...

    def decode(self, payload: torch.Tensor, header: dict[str, Any], layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]: ...


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (made contiguous) as a flat uint8 tensor; works for bf16 (no numpy involved)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


class IdentityCodec:
    """Raw bytes of the pool dtype: payload = K bytes then V bytes."""

    name = "identity"

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        kb, vb = tensor_bytes(k), tensor_bytes(v)
        return torch.cat([kb, vb]), {"planes": [kb.numel(), vb.numel()]}

    def decode(self, payload: torch.Tensor, header: dict[str, Any], layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
        kn, vn = header["codec_meta"]["planes"]
        dtype = DTYPES[header["dtype"]]
        shape = tuple(header["shape"][1:])
        k = payload[:kn].view(dtype).view(shape)
        v = payload[kn:kn + vn].view(dtype).view(shape)
        return k, v


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
    if sum(planes) != payload.numel() or any(p % num_blocks for p in planes):
        raise ProtocolError(f"planes {planes} do not split {payload.numel()} bytes into {num_blocks} blocks")
    mv = memoryview(payload.cpu().numpy())
    sums = []
    for b in range(num_blocks):
        crc, off = 0, 0
        for p in planes:
            step = p // num_blocks
            crc = zlib.crc32(mv[off + b * step: off + (b + 1) * step], crc)
            off += p
        sums.append(crc)
    return sums


def encode_layer(request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor,
                 codec: Codec) -> tuple[dict[str, Any], torch.Tensor]:
    """A layer frame: ``(header, payload)``; the header lacks only ``"v"``/``"kind"``/``"to"`` (see frames.py)."""
    num_blocks = k.shape[0]
    payload, codec_meta = codec.encode(k, v)
    dtype = next(name for name, dt in DTYPES.items() if dt == k.dtype)
    header = {
        "request_id": request_id, "layer": layer, "first_block": 0, "num_blocks": num_blocks, "dtype": dtype,
        "shape": [2, *k.shape], "codec": codec.name, "codec_meta": codec_meta,
        "checksums": block_checksums(payload, codec_meta["planes"], num_blocks), "nbytes": payload.numel(),
    }
    return header, payload


def decode_layer(header: dict[str, Any], payload: torch.Tensor | None,
                 layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a layer frame against ``layout`` and its checksums, then decode it to ``(k, v)``.

    Raises :class:`ChecksumMismatch` naming the failed blocks, or :class:`ProtocolError` for a malformed frame.
    """
    try:
        num_blocks, nbytes, checksums = header["num_blocks"], header["nbytes"], header["checksums"]
        planes = header["codec_meta"]["planes"]
        codec = get_codec(header["codec"])
    except (KeyError, TypeError) as e:
        raise ProtocolError(f"malformed layer frame header: missing {e}") from e
    if header.get("dtype") != layout.dtype or header.get("shape") != [2, *layout.block_shape(num_blocks)]:
        raise ProtocolError(f"frame dtype/shape {header.get('dtype')}/{header.get('shape')} do not match the layout")
    size = 0 if payload is None else payload.numel()
    if size != nbytes or len(checksums) != num_blocks:
        raise ProtocolError(f"frame carries {size} bytes and {len(checksums)} checksums; header says {nbytes} "
                            f"bytes and {num_blocks} blocks")
    got = block_checksums(payload, planes, num_blocks)
    bad = [b for b in range(num_blocks) if got[b] != checksums[b]]
    if bad:
        raise ChecksumMismatch(f"request {header['request_id']!r} layer {header['layer']}: crc32 mismatch in "
                               f"block(s) {bad}")
    return codec.decode(payload, header, layout)
