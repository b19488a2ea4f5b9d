"""Control-plane messages between the front-end and the worker actors: msgpack maps with a version field.

Ray carries them as ``bytes``; nothing crossing a process boundary is pickled by Duet. Prompts travel processed
(:mod:`node_common.prompt_wire`: token ids, image hashes, pixels only to the prefill worker), sampling parameters as a
plain map, errors as ``{"error": {"code": str, "type": ClassName, "message": str}}`` and are re-raised as the same
typed exception on the receiving side: the code is the class's entry in :data:`engine.errors.REGISTRY` (every
``DuetError`` subclass with a ``code``; this module registers ``kv_transfer``'s errors, which may not import the
engine). An error of an unregistered class travels as its nearest registered base class.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from engine import SamplingParams, errors
from kv_transfer import base as kv_base
from kv_transfer.frames import FrameRejected
from kv_transfer.handoff import HandoffMismatch

VERSION = 1

# kv_transfer's error tree (it may not import engine.errors): every transfer failure may succeed on another pair
for _cls, _code in ((kv_base.TransferError, "transfer"), (kv_base.TransferTimeout, "transfer_timeout"),
                    (kv_base.TransferAborted, "transfer_aborted"), (kv_base.ChecksumMismatch, "checksum_mismatch"),
                    (kv_base.MissingLayer, "missing_layer"), (kv_base.PeerUnavailable, "peer_unavailable"),
                    (kv_base.ProtocolError, "protocol"), (FrameRejected, "frame_rejected"),
                    (kv_base.Unauthenticated, "unauthenticated"), (kv_base.FrameReplayed, "frame_replayed"),
                    (kv_base.LeaseMismatch, "lease_mismatch"),
                    (HandoffMismatch, "handoff_mismatch")):
    errors.register(_cls, _code, retryable=True)

# what a worker's method turns into an error reply (anything else is a bug and surfaces as Ray's own error)
REPLY_ERRORS = (errors.DuetError, kv_base.TransferError, ValueError, KeyError)


class MessageError(errors.DuetError):
    """A message could not be decoded (wrong version or shape)."""

    code = "message"


def pack(**fields: Any) -> bytes:
    return msgpack.packb({"v": VERSION, **fields}, use_bin_type=True)


def unpack(data: bytes) -> dict:
    try:
        msg = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.ExtraData) as e:
        raise MessageError(f"undecodable message: {e}") from None
    if not isinstance(msg, dict) or msg.get("v") != VERSION:
        raise MessageError(f"unsupported message version {msg.get('v') if isinstance(msg, dict) else None!r}")
    if "error" in msg:
        raise error_from_dict(msg["error"])
    return msg


def error_code(e: BaseException) -> str:
    """The registry code of ``e``'s class, or of its nearest registered base (``"duet"`` when none is)."""
    for cls in type(e).__mro__:
        code = cls.__dict__.get("code")
        if isinstance(code, str) and errors.REGISTRY.get(code) is cls:
            return code
    return errors.DuetError.code


def error_reply(e: BaseException) -> bytes:
    return pack(error={"code": error_code(e), "type": type(e).__name__, "message": str(e)})


def error_from_dict(d: dict) -> BaseException:
    """The typed exception an :func:`error_reply` carried (plain :class:`~engine.errors.DuetError` for a code this
    process does not know)."""
    return errors.error_for_code(d.get("code"))(d.get("message", "remote error"))


def params_to_dict(p: SamplingParams) -> dict:
    return dataclasses.asdict(p)


def params_from_dict(d: dict) -> SamplingParams:
    return SamplingParams(**d)
