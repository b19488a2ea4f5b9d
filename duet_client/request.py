"""Building ``GenerateRequest`` messages: images from bytes, file paths or PIL images; sampling options; OpenAI-style
``response_format``, ``tools`` and chat turns with tool calls (api_version 3)."""

from __future__ import annotations

import io
import json
import mimetypes
import os
from collections.abc import Sequence
from typing import Any

from duet_client._proto.duet.v1 import duet_pb2 as pb
from duet_client.types import ToolCall

API_VERSION = 3  # of duet.v1 this client speaks (2: penalties, logprobs, n; 3: response_format, tools)
# What a request that uses no version-3 field says, so that it is served by a version-2 server too.
BASE_VERSION = 2

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
                  prompt_logprobs: int | None = None, n: int = 1, response_format: dict | None = None,
                  tools: Sequence[dict] | None = None, tool_choice: str | dict | None = None,
                  parallel_tool_calls: bool | None = None) -> pb.GenerateRequest:
    """The request for ``prompt`` (text, or token ids with image placeholders expanded) or chat ``messages``
    (``[{"role": ..., "content": ...}]``, each ``<image>`` in a content marks where the next image goes; an
    assistant turn may carry OpenAI's ``tool_calls``, a ``tool`` turn ``tool_call_id`` and ``name``).
    ``logprobs``: None for none, k for each token's logprob and the k most likely tokens'; ``prompt_logprobs``: the
    same for the prompt's tokens after the first; ``n``: choices. ``response_format``, ``tools`` (``[{"type":
    "function", "function": {"name", "description", "parameters", "strict"}}]``), ``tool_choice`` (``"none"``,
    ``"auto"``, ``"required"``, a tool's name or ``{"type": "function", "function": {"name": ...}}``) and
    ``parallel_tool_calls`` as OpenAI's chat API takes them (the server checks them as its HTTP API does)."""
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
    req = pb.GenerateRequest(request_id=request_id, model=model, sampling=sampling, raw_prompt=raw_prompt,
                             images=[to_image(i) for i in images], tools=[to_tool(t) for t in tools or ()],
                             tool_choice=tool_choice_name(tool_choice))
    if response_format is not None:
        req.response_format.CopyFrom(to_response_format(response_format))
    if parallel_tool_calls is not None:
        req.parallel_tool_calls = parallel_tool_calls
    if messages is not None:
        req.chat.messages.extend(to_chat_message(m) for m in messages)
    elif isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.ids.extend(int(t) for t in prompt)
    uses_v3 = (req.HasField("response_format") or req.tools or req.tool_choice or req.HasField("parallel_tool_calls")
               or any(m.tool_calls or m.tool_call_id or m.name for m in req.chat.messages))
    req.api_version = API_VERSION if uses_v3 else BASE_VERSION
    return req


def _json_text(value: Any) -> str:
    """A JSON Schema as the JSON text the message carries (text passes as it is; None: empty)."""
    return "" if value is None else value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _only(d: dict, allowed: set[str], where: str) -> None:
    """No key of ``d`` goes unsent: one the message cannot carry is an error, not dropped."""
    extra = sorted(set(d) - allowed)
    if extra:
        raise ValueError(f"{where} has {extra[0]!r}, which duet.v1 does not carry (it takes {sorted(allowed)})")


def to_response_format(fmt: dict) -> pb.ResponseFormat:
    """OpenAI's ``{"type": ..., "json_schema": {"name", "schema", "strict"}}`` as a ``ResponseFormat`` message
    (``json_schema.description`` is dropped: it changes no token, and the HTTP API ignores it too)."""
    if isinstance(fmt, pb.ResponseFormat):
        return fmt
    if not isinstance(fmt, dict):
        raise TypeError(f"response_format must be a dict, got {type(fmt).__name__}")
    _only(fmt, {"type", "json_schema"}, "response_format")
    js = fmt.get("json_schema") or {}
    _only(js, {"name", "schema", "strict", "description"}, "response_format.json_schema")
    out = pb.ResponseFormat(type=fmt.get("type") or "", schema=_json_text(js.get("schema")), name=js.get("name") or "")
    if js.get("strict") is not None:
        out.strict = js["strict"]
    return out


def to_tool(tool: dict) -> pb.Tool:
    """OpenAI's ``{"type": "function", "function": {"name", "description", "parameters", "strict"}}`` as a
    ``Tool`` message."""
    if isinstance(tool, pb.Tool):
        return tool
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ValueError(f'a tool must be {{"type": "function", "function": {{"name": ...}}}}, got {tool!r}')
    _only(tool, {"type", "function"}, "a tool")
    fn = tool["function"]
    _only(fn, {"name", "description", "parameters", "strict"}, "a tool's function")
    out = pb.Tool(name=fn.get("name") or "", description=fn.get("description") or "",
                  parameters=_json_text(fn.get("parameters")))
    if fn.get("strict") is not None:
        out.strict = fn["strict"]
    return out


def tool_choice_name(choice: str | dict | None) -> str:
    """``tool_choice`` as the message's string: none / auto / required, or the named tool."""
    if choice is None or isinstance(choice, str):
        return choice or ""
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError('tool_choice must be none, auto, required, a tool\'s name or {"type": "function", '
                         f'"function": {{"name": ...}}}}, got {choice!r}')
    return fn["name"]


def to_chat_message(m: dict) -> pb.ChatMessage:
    """An OpenAI-style chat turn (text content; ``tool_calls`` of an assistant turn, OpenAI's dicts or the
    :class:`~duet_client.types.ToolCall` objects a completion returned; a tool turn's ``tool_call_id`` and ``name``)
    as a ``ChatMessage``."""
    calls = [pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) if isinstance(c, ToolCall) else
             pb.ToolCall(id=c.get("id") or "", name=c["function"]["name"],
                         arguments=_json_text(c["function"].get("arguments")) or "{}")
             for c in m.get("tool_calls") or ()]
    return pb.ChatMessage(role=m["role"], content=m.get("content") or "", tool_calls=calls,
                          tool_call_id=m.get("tool_call_id") or "", name=m.get("name") or "")
