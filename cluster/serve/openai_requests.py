"""OpenAI request bodies -> :class:`~cluster.serve.schema.GenerateInput` (pure; every problem is an
:class:`~engine.errors.InvalidRequestError` naming the field).

Chat ``content`` may be a string or a list of ``text`` and ``image_url`` parts; each image part becomes an
``<image>`` placeholder at its place, and its URL must be a base64 ``data:`` URL; a ``video_url`` (or ``video``) part is
refused with :class:`~engine.errors.UnsupportedInputError` (video is not served yet). Duet extensions beside OpenAI's
fields: ``top_k``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from cluster.serve.schema import GenerateInput, ImageInput, SamplingOptions
from engine.errors import InvalidRequestError, UnsupportedInputError


def _field(body: dict, name: str, types: type | tuple[type, ...], default: Any = None) -> Any:
    """``body[name]`` if it has one of ``types`` (a JSON ``true`` is not an int here), ``default`` if absent/null."""
    v = body.get(name)
    if v is None:
        return default
    allowed = types if isinstance(types, tuple) else (types,)
    if not isinstance(v, allowed) or (isinstance(v, bool) and bool not in allowed):
        raise InvalidRequestError(f"'{name}' has the wrong type ({type(v).__name__})")
    return v


def _int_list(body: dict, name: str) -> list[int]:
    v = _field(body, name, list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise InvalidRequestError(f"'{name}' must be a list of integers")
    return v


def sampling_from_body(body: dict) -> SamplingOptions:
    n = _field(body, "n", int, 1)
    if n != 1:
        raise InvalidRequestError("only n=1 is supported")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise InvalidRequestError("logprobs are not supported")
    if body.get("tools"):
        raise InvalidRequestError("tools are not supported")
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise InvalidRequestError("'stop' must be a string or a list of strings")
    max_tokens = _field(body, "max_completion_tokens", int, None)
    max_tokens = _field(body, "max_tokens", int, None) if max_tokens is None else max_tokens
    temperature = _field(body, "temperature", (int, float), None)
    top_p = _field(body, "top_p", (int, float), None)
    return SamplingOptions(
        temperature=None if temperature is None else float(temperature),
        top_p=None if top_p is None else float(top_p), top_k=_field(body, "top_k", int, None),
        max_tokens=max_tokens, min_tokens=_field(body, "min_tokens", int, 0),
        stop_token_ids=_int_list(body, "stop_token_ids"), stop=stop,
        ignore_eos=_field(body, "ignore_eos", bool, False), seed=_field(body, "seed", int, None))


def decode_data_url(url: str, where: str) -> ImageInput:
    """``data:image/png;base64,...`` -> the image bytes and MIME type."""
    if not url.startswith("data:"):
        raise InvalidRequestError(f"{where}: only base64 data: URLs are supported (the server fetches nothing)")
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise InvalidRequestError(f"{where}: expected data:<mime>;base64,<data>")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{where}: the base64 data does not decode") from None
    return ImageInput(data=data, mime_type=header[: -len(";base64")])


def chat_from_body(body: dict) -> tuple[list[dict], list[ImageInput]]:
    """OpenAI messages -> ``[{"role", "content"}]`` with ``<image>`` placeholders, and the images in order."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("'messages' must be a non-empty list")
    out, images = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object")
        content = m.get("content")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list):
            pieces = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    pieces.append(part["text"])
                elif kind == "image_url":
                    image_url = part.get("image_url")
                    url = image_url.get("url") if isinstance(image_url, dict) else image_url
                    if not isinstance(url, str):
                        raise InvalidRequestError(f"messages[{i}].content[{j}].image_url needs a url")
                    images.append(decode_data_url(url, f"messages[{i}].content[{j}]"))
                    pieces.append("<image>")
                elif kind in ("video_url", "video"):
                    raise UnsupportedInputError(f"messages[{i}].content[{j}]: video inputs are not supported yet "
                                                "(images only)")
                else:
                    raise InvalidRequestError(f"messages[{i}].content[{j}]: unsupported part type {kind!r} "
                                              "(text and image_url are supported)")
            text = "".join(pieces)
        elif content is None:
            text = ""
        else:
            raise InvalidRequestError(f"messages[{i}].content must be a string or a list of parts")
        out.append({"role": m.get("role"), "content": text})
    return out, images


def completion_from_body(body: dict) -> GenerateInput:
    if body.get("echo"):
        raise InvalidRequestError("echo is not supported")
    prompt = body.get("prompt")
    inp = GenerateInput(raw_prompt=True, sampling=sampling_from_body(body), model=_field(body, "model", str, ""))
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        inp.prompt = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        inp.prompt_token_ids = prompt
    else:
        raise InvalidRequestError("'prompt' must be a string or a list of token ids (one prompt per request)")
    return inp


def chat_input(body: dict) -> GenerateInput:
    """A ``/v1/chat/completions`` body as a request (messages rendered with the chat template by the service)."""
    messages, images = chat_from_body(body)
    return GenerateInput(messages=messages, images=images, sampling=sampling_from_body(body),
                         model=_field(body, "model", str, ""))
