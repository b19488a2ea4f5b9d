"""``duet.v1`` ``GenerateRequest`` -> :class:`~cluster.serve.schema.GenerateInput` (pure; every problem is an
:class:`~engine.errors.InvalidRequestError` naming the field, which the service answers with INVALID_ARGUMENT).

The api_version 3 fields (``response_format``, ``tools``, ``tool_choice``, ``parallel_tool_calls``, a chat turn's
``tool_calls`` / ``tool_call_id`` / ``name``) are rebuilt as the OpenAI body the HTTP API takes and handed to the
same validators (:func:`~cluster.serve.structured.response_format_spec`,
:func:`~cluster.serve.tool_calls.tools_from_body`, :func:`~cluster.serve.tool_calls.message_tool_fields`), so both
APIs build the same request and refuse the same mistakes with the same words. A request that sets one of them must
say api_version 3: an older client cannot have meant it, and nothing is ignored silently.
"""

from __future__ import annotations

import json

from cluster.serve.schema import GenerateInput, ImageInput, SamplingOptions
from cluster.serve.structured import response_format_spec
from cluster.serve.tool_calls import message_tool_fields, tools_from_body
from duet_client._proto.duet.v1 import duet_pb2 as pb
from engine.errors import InvalidRequestError

# 2: penalties, logprobs, n; 3: response_format, tools (fields added; older requests mean the same)
API_VERSION = 3
TOOLS_VERSION = 3  # the version whose fields are response_format and the tool fields


def request_from_proto(req: pb.GenerateRequest) -> GenerateInput:
    if req.api_version > API_VERSION:
        raise InvalidRequestError(f"api_version {req.api_version} is newer than this server's ({API_VERSION})")
    if not (req.request_id.isascii() and req.request_id.isprintable()):  # it goes back as x-request-id metadata
        raise InvalidRequestError("request_id must be printable ASCII")
    _check_version(req)
    s = req.sampling
    sampling = SamplingOptions(
        temperature=s.temperature if s.HasField("temperature") else None,
        top_p=s.top_p if s.HasField("top_p") else None, top_k=s.top_k if s.HasField("top_k") else None,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None, min_tokens=s.min_tokens,
        stop_token_ids=list(s.stop_token_ids), stop=list(s.stop), ignore_eos=s.ignore_eos,
        seed=s.seed if s.HasField("seed") else None,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else 0.0,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else 0.0,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None, n=s.n or 1,
        structured_outputs=response_format_spec(response_format_dict(req)))
    kind = req.WhichOneof("input")
    inp = GenerateInput(images=[ImageInput(i.data, i.mime_type) for i in req.images], raw_prompt=req.raw_prompt,
                        sampling=sampling, model=req.model, request_id=req.request_id)
    if kind != "chat" and (req.tools or req.tool_choice or req.HasField("parallel_tool_calls")):
        raise InvalidRequestError("'tools', 'tool_choice' and 'parallel_tool_calls' need a chat input "
                                  "(GenerateRequest.chat)")
    if kind == "prompt_token_ids":
        inp.prompt_token_ids = list(req.prompt_token_ids.ids)
    elif kind == "chat":
        inp.messages = [{"role": m.role, "content": m.content, **message_tool_fields(_message_dict(m), i)}
                        for i, m in enumerate(req.chat.messages)]
        inp.tools = tools_from_body(tools_body(req))
    else:
        inp.prompt = req.prompt  # unset: "" -> "the prompt is empty"
    return inp


def _check_version(req: pb.GenerateRequest) -> None:
    """A version-3 field in a request of an older version is refused, naming the field."""
    version = req.api_version or 1
    if version >= TOOLS_VERSION:
        return
    used = [name for name, on in (
        ("response_format", req.HasField("response_format")), ("tools", bool(req.tools)),
        ("tool_choice", bool(req.tool_choice)), ("parallel_tool_calls", req.HasField("parallel_tool_calls")),
        ("chat.messages[].tool_calls / tool_call_id / name",
         any(m.tool_calls or m.tool_call_id or m.name for m in req.chat.messages))) if on]
    if used:
        raise InvalidRequestError(f"'{used[0]}' needs api_version {TOOLS_VERSION} (the request says {version})")


def _json_object(text: str, where: str) -> dict:
    """``text`` parsed as a JSON object (what the HTTP body would hold at ``where``)."""
    try:
        value = json.loads(text)
    except ValueError:
        raise InvalidRequestError(f"'{where}' is not valid JSON") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"'{where}' must be a JSON Schema object")
    return value


def response_format_dict(req: pb.GenerateRequest) -> dict | None:
    """``GenerateRequest.response_format`` as OpenAI's ``response_format`` value (None when unset)."""
    if not req.HasField("response_format"):
        return None
    f = req.response_format
    if f.type != "json_schema":
        if f.schema or f.name or f.HasField("strict"):
            raise InvalidRequestError("'response_format.schema', 'name' and 'strict' are only for type json_schema")
        return {"type": f.type}
    schema = _json_object(f.schema, "response_format.json_schema.schema") if f.schema else None
    return {"type": f.type, "json_schema": {"name": f.name or None, "schema": schema,
                                            "strict": f.strict if f.HasField("strict") else None}}


def tools_body(req: pb.GenerateRequest) -> dict:
    """The ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of an OpenAI chat body, from the request's fields."""
    tools = []
    for i, t in enumerate(req.tools):
        fn: dict = {"name": t.name}
        if t.description:
            fn["description"] = t.description
        if t.parameters:
            fn["parameters"] = _json_object(t.parameters, f"tools[{i}].function.parameters")
        if t.HasField("strict"):
            fn["strict"] = t.strict
        tools.append({"type": "function", "function": fn})
    choice: str | dict | None = req.tool_choice or None
    if choice not in (None, "none", "auto", "required"):
        choice = {"type": "function", "function": {"name": choice}}  # a tool's name
    body: dict = {"tools": tools or None, "tool_choice": choice}
    if req.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = req.parallel_tool_calls
    return body


def _message_dict(m: pb.ChatMessage) -> dict:
    """A chat turn's tool fields as an OpenAI message has them."""
    out: dict = {}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out
