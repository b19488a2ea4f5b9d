"""Control-plane messages between the front-end and the worker actors: msgpack maps with a version field.

Ray carries them as ``bytes``; nothing crossing a process boundary is pickled by Duet. Prompts travel processed
(:mod:`cluster.prompt_wire`: token ids, image hashes, pixels only to the prefill worker), sampling parameters as a
plain map, errors as ``{"error": {"type": ClassName, "message": str}}`` and are re-raised
as the same typed exception on the receiving side.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from engine import SamplingParams, errors

VERSION = 1


class MessageError(errors.DuetError):
    """A message could not be decoded (wrong version or shape)."""


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


def error_reply(e: BaseException) -> bytes:
    return pack(error={"type": type(e).__name__, "message": str(e)})


def error_from_dict(d: dict) -> errors.DuetError:
    cls = getattr(errors, d.get("type", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.DuetError)):
        cls = errors.DuetError
    return cls(d.get("message", "remote error"))


def params_to_dict(p: SamplingParams) -> dict:
    return dataclasses.asdict(p)


def params_from_dict(d: dict) -> SamplingParams:
    return SamplingParams(**d)
