"""Control-plane messages between the front-end and the worker actors: msgpack maps with a version field.

Ray carries them as ``bytes``; nothing crossing a process boundary is pickled by Duet. Images travel as PNG bytes,
sampling parameters as a plain map, errors as ``{"error": {"type": ClassName, "message": str}}`` and are re-raised
as the same typed exception on the receiving side.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import msgpack
from PIL import Image

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


def image_to_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def prompt_to_wire(token_ids: list[int], images: list[Image.Image]) -> dict:
    return {"prompt_token_ids": list(token_ids), "images": [image_to_bytes(i) for i in images]}


def prompt_from_wire(d: dict) -> dict:
    """The engine's prompt dict (images decoded by the engine's ``load_image`` from their bytes)."""
    prompt: dict = {"prompt_token_ids": list(d["prompt_token_ids"])}
    if d.get("images"):
        prompt["multi_modal_data"] = {"image": list(d["images"])}
    return prompt
