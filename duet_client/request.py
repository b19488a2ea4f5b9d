"""Building ``GenerateRequest`` messages: images from bytes, file paths or PIL images; sampling options."""

from __future__ import annotations

import io
import mimetypes
import os
from collections.abc import Sequence
from typing import Any

from duet_client._proto.duet.v1 import duet_pb2 as pb

API_VERSION = 2  # of duet.v1 this client speaks (2: penalties, logprobs, n)

_MAGIC = [
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
]

ImageLike = Any  # bytes | str | os.PathLike | PIL.Image.Image


def sniff_mime(data: bytes) -> str:
    """The image MIME type from the leading bytes ("" when unknown: the server sniffs it again)."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((mime for magic, mime in _MAGIC if data.startswith(magic)), "")


def to_image(img: ImageLike) -> pb.Image:
    """An ``Image`` message from encoded bytes, a file path, or a PIL image (sent as PNG; PIL is optional)."""
    if isinstance(img, pb.Image):
        return img
    if isinstance(img, bytes | bytearray | memoryview):
        data = bytes(img)
        return pb.Image(data=data, mime_type=sniff_mime(data))
    if isinstance(img, str | os.PathLike):
        with open(img, "rb") as f:
            data = f.read()
        return pb.Image(data=data, mime_type=sniff_mime(data) or (mimetypes.guess_type(os.fspath(img))[0] or ""))
    if type(img).__module__.startswith("PIL."):
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        return pb.Image(data=buf.getvalue(), mime_type="image/png")
    raise TypeError(f"an image must be bytes, a file path or a PIL image, got {type(img).__name__}")


def build_request(prompt: str | Sequence[int] | None = None, *, messages: Sequence[dict] | None = None,
                  images: Sequence[ImageLike] = (), max_tokens: int | None = None, temperature: float | None = None,
                  top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                  stop: str | Sequence[str] | None = None, stop_token_ids: Sequence[int] = (), min_tokens: int = 0,
                  ignore_eos: bool = False, raw_prompt: bool = False, model: str = "", request_id: str = "",
                  presence_penalty: float | None = None, frequency_penalty: float | None = None,
                  repetition_penalty: float | None = None, logprobs: int | None = None,
                  prompt_logprobs: int | None = None, n: int = 1
                  ) -> pb.GenerateRequest:
    """The request for ``prompt`` (text, or token ids with image placeholders expanded) or chat ``messages``
    (``[{"role": ..., "content": ...}]``, each ``<image>`` in a content marks where the next image goes).
    ``logprobs``: None for none, k for each token's logprob and the k most likely tokens'; ``prompt_logprobs``: the
    same for the prompt's tokens after the first; ``n``: choices."""
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt or messages")
    sampling = pb.SamplingParams(min_tokens=min_tokens, stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                                 stop=[stop] if isinstance(stop, str) else list(stop or ()), n=0 if n == 1 else n)
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k),
                        ("max_tokens", max_tokens), ("seed", seed), ("presence_penalty", presence_penalty),
                        ("frequency_penalty", frequency_penalty), ("repetition_penalty", repetition_penalty),
                        ("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None:
            setattr(sampling, name, value)
    req = pb.GenerateRequest(api_version=API_VERSION, request_id=request_id, model=model, sampling=sampling,
                             raw_prompt=raw_prompt, images=[to_image(i) for i in images])
    if messages is not None:
        req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    elif isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.ids.extend(int(t) for t in prompt)
    return req
