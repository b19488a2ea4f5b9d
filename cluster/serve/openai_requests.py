"""OpenAI request bodies -> :class:`~cluster.serve.schema.GenerateInput` (pure; every problem is an
:class:`~engine.errors.InvalidRequestError` naming the field).

Chat ``content`` may be a string or a list of ``text`` and ``image_url`` parts; each image part becomes an
``<image>`` placeholder at its place, and its URL must be a base64 ``data:`` URL; a ``video_url`` (or ``video``) part is
refused with :class:`~engine.errors.UnsupportedInputError` (video is not served yet). Duet extensions beside OpenAI's
fields (vLLM's names): ``top_k``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ``repetition_penalty``.

No field that would change the output is ever ignored: a body field outside :data:`CHAT_FIELDS` /
:data:`COMPLETION_FIELDS` is a 400 naming it (those OpenAI defines that Duet does not serve say so:
:data:`NOT_SERVED`). Fields that change nothing about the tokens (``user``, ``metadata``, ``store``, ...) are
accepted.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from cluster.serve.schema import GenerateInput, ImageInput, SamplingOptions
from cluster.serve.structured import response_format_spec
from cluster.serve.tool_calls import message_tool_fields, tools_from_body
from engine.errors import InvalidRequestError, UnsupportedInputError
from engine.sampling_params import MAX_LOGPROBS, MAX_N


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


_SAMPLING_FIELDS = {"model", "stream", "stream_options", "temperature", "top_p", "top_k", "max_tokens",
                    "max_completion_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "seed", "n",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
                    "user", "metadata", "store", "service_tier"}  # the last four change no token
CHAT_FIELDS = _SAMPLING_FIELDS | {"messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                                  "response_format"}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "echo", "response_format"}
NOT_SERVED = {"logit_bias": "logit_bias is not supported", "best_of": "best_of is not supported (use n)",
              "suffix": "suffix (insertion) is not supported", "functions": "functions is not supported",
              "function_call": "function_call is not supported", "audio": "audio output is not supported",
              "modalities": "only text output is supported", "prediction": "predicted outputs are not supported",
              "web_search_options": "web search is not supported",
              "reasoning_effort": "reasoning_effort is not supported"}


def check_fields(body: dict, allowed: set[str]) -> None:
    """400 for a field that is not served, naming it (the first, in sorted order)."""
    for name in sorted(set(body) - allowed):
        if body[name] is None:
            continue  # null is "not given" for every OpenAI field
        raise InvalidRequestError(NOT_SERVED.get(name, f"unknown field '{name}'"))
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise InvalidRequestError("'stream_options' must be an object")
        if not body.get("stream"):
            raise InvalidRequestError("'stream_options' is only allowed with stream: true")
        for key in sorted(set(opts) - {"include_usage"}):
            raise InvalidRequestError(f"unknown field 'stream_options.{key}'")
        if not isinstance(opts.get("include_usage", False), bool):
            raise InvalidRequestError("'stream_options.include_usage' must be a boolean")


def _float(body: dict, name: str, default: float) -> float:
    v = _field(body, name, (int, float), None)
    return default if v is None else float(v)


def _chat_logprobs(body: dict) -> int | None:
    """Chat: ``logprobs: true`` (the sampled token's) and ``top_logprobs`` (0..20 alternatives, needs logprobs)."""
    want = _field(body, "logprobs", bool, False)
    top = _field(body, "top_logprobs", int, None)
    if top is not None and not want:
        raise InvalidRequestError("'top_logprobs' needs 'logprobs': true")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequestError(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}")
    return (top or 0) if want else None


def _completion_logprobs(body: dict) -> int | None:
    """Completions: ``logprobs`` is the number of alternatives (0..20) beside the sampled token's."""
    k = _field(body, "logprobs", int, None)
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise InvalidRequestError(f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {k}")
    return k


def sampling_from_body(body: dict, logprobs: int | None = None) -> SamplingOptions:
    n = _field(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"'n' must be in [1, {MAX_N}], got {n}")
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
        ignore_eos=_field(body, "ignore_eos", bool, False), seed=_field(body, "seed", int, None),
        presence_penalty=_float(body, "presence_penalty", 0.0), frequency_penalty=_float(body, "frequency_penalty", 0.0),
        repetition_penalty=_float(body, "repetition_penalty", 1.0), logprobs=logprobs, n=n,
        structured_outputs=response_format_spec(body.get("response_format")))


def stream_flags(body: dict) -> tuple[bool, bool]:
    """``(stream, stream_options.include_usage)``, each a JSON boolean (or absent)."""
    opts = _field(body, "stream_options", dict, {})
    return _field(body, "stream", bool, False), _field(opts, "include_usage", bool, False)


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
        out.append({"role": m.get("role"), "content": text, **message_tool_fields(m, i)})
    return out, images


def completion_from_body(body: dict) -> GenerateInput:
    check_fields(body, COMPLETION_FIELDS)
    logprobs = _completion_logprobs(body)
    echo = _field(body, "echo", bool, False)
    prompt = body.get("prompt")
    inp = GenerateInput(raw_prompt=True, sampling=sampling_from_body(body, logprobs),
                        model=_field(body, "model", str, ""))
    if echo and logprobs is not None:
        inp.sampling.prompt_logprobs = logprobs  # echo's prompt tokens come back with their logprobs too
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
    check_fields(body, CHAT_FIELDS)
    messages, images = chat_from_body(body)
    return GenerateInput(messages=messages, images=images, sampling=sampling_from_body(body, _chat_logprobs(body)),
                         model=_field(body, "model", str, ""), tools=tools_from_body(body))
