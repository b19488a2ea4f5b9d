"""Frame headers: msgpack maps with a version field ``"v"``; a frame is a header plus an optional uint8 payload.

Per-request frames carry ``"request_id"`` and ``"to"`` (which side they are for):

=========  ==========  ===================================================================
kind       to          meaning
=========  ==========  ===================================================================
open       receiver    a sender exists for this request (binds the link on the decode side)
layer      receiver    one layer's KV: codec header fields (codec.py) + payload
state      receiver    one state frame (hybrid models): state_frames.py header fields + raw payload
finish     receiver    all layers were sent; ``"meta"``: the sender's finish dict
abort      either      ``"error"`` (TransferError class name) and ``"reason"``
done       sender      the receiver reached SUCCESS
=========  ==========  ===================================================================

Link frames (no request): ``ping`` (keepalive on an idle link), ``bye`` (orderly close of a link).
With data-plane auth on, request frames also carry ``"lease"``, ``"seq"`` and ``"mac"``, and link frames ``"seq"`` and
``"mac"`` under their sending side's link key (:mod:`kv_transfer.auth`).
A header with another ``"v"`` is rejected with :class:`ProtocolError` (carrying the request id when readable).
"""

from __future__ import annotations

from typing import Any

import msgpack

from kv_transfer.errors import ProtocolError, TransferError

FRAME_VERSION = 1
TO_RECEIVER, TO_SENDER = "receiver", "sender"
LINK_KINDS = frozenset({"ping", "bye"})


class FrameRejected(ProtocolError):
    """A header that could not be accepted; ``request_id``/``to`` say whose transfer it was, when readable."""

    def __init__(self, message: str, *, request_id: str | None = None, to: str | None = None) -> None:
        super().__init__(message)
        self.request_id, self.to = request_id, to


def pack(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def unpack(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Parse and version-check a header. Raises :class:`FrameRejected`."""
    return check(parse(data))


def parse(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The header map, not yet version-checked (a receiver verifies its MAC first). Raises :class:`FrameRejected`."""
    try:
        header = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise FrameRejected(f"frame header is not msgpack: {e}") from e
    if not isinstance(header, dict):
        raise FrameRejected(f"frame header is a {type(header).__name__}, not a map")
    return header


def check(header: dict[str, Any]) -> dict[str, Any]:
    """``header`` when its version is this one and it has a kind; else :class:`FrameRejected`."""
    if header.get("v") != FRAME_VERSION:
        rid, to = header.get("request_id"), header.get("to")
        raise FrameRejected(f"frame version {header.get('v')!r} is not supported (expected {FRAME_VERSION})",
                            request_id=rid if isinstance(rid, str) else None, to=to if isinstance(to, str) else None)
    if "kind" not in header:
        raise FrameRejected("frame header has no 'kind'")
    return header


def check_meta(meta: dict[str, Any]) -> None:
    """Raise ``TypeError`` unless ``meta`` is a msgpack-able dict (checked when ``finish`` is called)."""
    if not isinstance(meta, dict):
        raise TypeError(f"finish meta must be a dict, got {type(meta).__name__}")
    try:
        msgpack.packb(meta, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"finish meta is not msgpack-able: {e}") from e


def _request(kind: str, request_id: str, to: str, **fields: Any) -> dict[str, Any]:
    return {"v": FRAME_VERSION, "kind": kind, "to": to, "request_id": request_id, **fields}


def open_frame(request_id: str) -> dict[str, Any]:
    return _request("open", request_id, TO_RECEIVER)


def layer_frame(codec_header: dict[str, Any]) -> dict[str, Any]:
    return {"v": FRAME_VERSION, "kind": "layer", "to": TO_RECEIVER, **codec_header}


def state_frame(fields: dict[str, Any]) -> dict[str, Any]:
    return {"v": FRAME_VERSION, "kind": "state", "to": TO_RECEIVER, **fields}


def finish_frame(request_id: str, meta: dict[str, Any]) -> dict[str, Any]:
    return _request("finish", request_id, TO_RECEIVER, meta=meta)


def abort_frame(request_id: str, to: str, error: TransferError) -> dict[str, Any]:
    return _request("abort", request_id, to, error=type(error).__name__, reason=str(error))


def done_frame(request_id: str) -> dict[str, Any]:
    return _request("done", request_id, TO_SENDER)


def link_frame(kind: str) -> dict[str, Any]:
    assert kind in LINK_KINDS, kind
    return {"v": FRAME_VERSION, "kind": kind}
