"""The OpenAPI 3.1 description of the OpenAI-compatible HTTP API, served at ``GET /openapi.json``.

:func:`openapi_document` describes what :mod:`cluster.serve.openai_api` routes and what
:mod:`cluster.serve.openai_requests` accepts: the request bodies carry the validators' rules (types, ranges, enums,
required fields), so a generator working from this document (schemathesis, in ``tests/cluster/serve/
test_fuzz_http.py``) sends requests that pass some checks and fail others. A top-level body field the server does
not know is a 400 unless it is null (``CHAT_FIELDS`` / ``COMPLETION_FIELDS``), so the bodies allow only null extras;
nested objects (messages, content parts) stay open where the server ignores extra keys. Every error is
``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status.

Keeping it in step: a field added to (or a rule changed in) ``openai_requests`` (``CHAT_FIELDS``,
``COMPLETION_FIELDS``, ``sampling_from_body``, ``chat_from_body``, ``completion_from_body``), a new route in
``openai_api.make_app``, or a new status in ``errors.classify`` needs the same change here (a test compares the
described body fields with ``CHAT_FIELDS`` / ``COMPLETION_FIELDS``); ``test_fuzz_http.py`` checks every response against this document,
so a server that answers outside it fails the fuzz test.
"""

from __future__ import annotations

from typing import Any

from engine.sampling_params import MAX_LOGPROBS, MAX_N

OPENAPI_VERSION = "3.1.0"
INT64_MAX = 2 ** 63 - 1  # what the workers' wire (msgpack) carries
_UNKNOWN = {"type": "null"}  # any other field is a 400 naming it, unless null ("not given")
_JSON = "application/json"


def _obj(properties: dict[str, Any], required: tuple[str, ...] = (), **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": properties, **extra}
    if required:
        out["required"] = list(required)
    return out


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _int(minimum: int | None = None, maximum: int | None = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "integer", **extra}
    if minimum is not None:
        out["minimum"] = minimum
    if maximum is not None:
        out["maximum"] = maximum
    return out


def _sampling_properties() -> dict[str, Any]:
    """The sampling fields both completion endpoints take (``openai_requests.sampling_from_body``)."""
    token_ids = {"type": "array", "items": _int(0, INT64_MAX)}
    penalty = {"type": "number", "minimum": -2, "maximum": 2}
    return {
        "model": _nullable({"type": "string", "description": "must name the served model (GET /v1/models) when set"}),
        "max_tokens": _nullable(_int(1, INT64_MAX, description="capped by the server's limit and by what the context "
                                                               "has left")),
        "max_completion_tokens": _nullable(_int(1, INT64_MAX, description="takes precedence over max_tokens")),
        "temperature": _nullable({"type": "number", "minimum": 0, "description": "0 = greedy"}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable(_int(-1, INT64_MAX, description="-1 or 0 = disabled (Duet extension)")),
        "min_tokens": _nullable(_int(0, INT64_MAX, description="at most max_tokens (Duet extension)")),
        "stop": _nullable({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}),
        "stop_token_ids": _nullable({**token_ids, "description": "Duet extension"}),
        "ignore_eos": _nullable({"type": "boolean", "description": "Duet extension"}),
        "seed": _nullable(_int(-(2 ** 63), 2 ** 64 - 1)),
        "n": _nullable(_int(1, MAX_N, description="choices decoded from one prefill of the prompt")),
        "presence_penalty": _nullable(penalty),
        "frequency_penalty": _nullable(penalty),
        "repetition_penalty": _nullable({"type": "number", "minimum": 0.01, "maximum": 10,
                                         "description": "vLLM's, over prompt and output (Duet extension)"}),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable(_obj({"include_usage": {"type": "boolean"}}, additionalProperties=False,
                                         description="only with stream: true")),
        **{name: {"description": "accepted; changes no token"} for name in ("user", "metadata", "store",
                                                                             "service_tier")},
    }


def _content_part() -> dict[str, Any]:
    text = _obj({"type": {"const": "text"}, "text": {"type": "string"}}, ("type", "text"))
    url = {"type": "string", "description": "data:<mime>;base64,<data> (the server fetches nothing)",
           "pattern": "^data:"}
    image = _obj({"type": {"const": "image_url"},
                  "image_url": {"anyOf": [url, _obj({"url": url}, ("url",))]}},
                 ("type", "image_url"))
    return {"anyOf": [text, image]}


def _tool() -> dict[str, Any]:
    fn = _obj({"name": {"type": "string", "pattern": "^[A-Za-z0-9_.\\-]{1,64}$"}, "description": {"type": "string"},
               "parameters": {"type": "object", "description": "a JSON Schema (it must compile: a 400 otherwise)"}},
              ("name",))
    return _obj({"type": {"const": "function"}, "function": fn}, ("type", "function"))


def _response_format() -> dict[str, Any]:
    """cluster.serve.structured: text, json_object, or json_schema (a schema that does not compile is a 400)."""
    schema = _obj({"name": _nullable({"type": "string"}), "schema": {"type": "object"}, "strict": _nullable({"type": "boolean"})},
                  ("schema",))
    return {"anyOf": [_obj({"type": {"enum": ["text", "json_object"]}}, ("type",)),
                      _obj({"type": {"const": "json_schema"}, "json_schema": schema}, ("type", "json_schema"))]}


def _chat_request() -> dict[str, Any]:
    message = _obj({
        "role": {"enum": ["system", "user", "assistant", "tool"]},
        "tool_calls": _nullable({"type": "array", "items": _obj({"function": _obj({"name": {"type": "string"}},
                                                                               ("name",))}, ("function",))}),
        "content": _nullable({"anyOf": [{"type": "string"}, {"type": "array", "items": _content_part()}]}),
    }, ("role",))
    return _obj({"messages": {"type": "array", "items": message, "minItems": 1}, **_sampling_properties(),
                 "logprobs": _nullable({"type": "boolean"}),
                 "top_logprobs": _nullable(_int(0, MAX_LOGPROBS, description="needs logprobs: true")),
                 "tools": _nullable({"type": "array", "items": _tool(), "maxItems": 128}),
                 "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, _obj(
                     {"type": {"const": "function"}, "function": _obj({"name": {"type": "string"}}, ("name",))},
                     ("type", "function"), description="a function named in tools (tools required)")]}),
                 "parallel_tool_calls": _nullable({"type": "boolean"}),
                 "response_format": _nullable(_response_format())},
                ("messages",), additionalProperties=_UNKNOWN)


def _completion_request() -> dict[str, Any]:
    ids = {"type": "array", "items": _int(0, INT64_MAX), "minItems": 1}
    prompt = {"anyOf": [{"type": "string", "minLength": 1}, ids,
                        {"type": "array", "minItems": 1, "maxItems": 1,
                         "items": {"anyOf": [{"type": "string", "minLength": 1}, ids]}}],
              "description": "text (as is, no chat template), token ids, or a batch of exactly one of those"}
    return _obj({"prompt": prompt, "echo": _nullable({"type": "boolean"}), **_sampling_properties(),
                 "response_format": _nullable(_response_format()),
                 "logprobs": _nullable(_int(0, MAX_LOGPROBS, description="alternatives beside the sampled token"))},
                ("prompt",), additionalProperties=_UNKNOWN)


def _usage() -> dict[str, Any]:
    n = _int(0)
    return _obj({"prompt_tokens": n, "completion_tokens": n, "total_tokens": n},
                ("prompt_tokens", "completion_tokens", "total_tokens"))


def _completion_response(chat: bool) -> dict[str, Any]:
    finish = {"enum": ["stop", "length", "tool_calls"] if chat else ["stop", "length"]}
    if chat:
        call = _obj({"id": {"type": "string"}, "type": {"const": "function"},
                     "function": _obj({"name": {"type": "string"}, "arguments": {"type": "string"}},
                                      ("name", "arguments"))}, ("id", "type", "function"))
        body = {"message": _obj({"role": {"const": "assistant"}, "content": _nullable({"type": "string"}),
                                 "tool_calls": {"type": "array", "items": call}}, ("role", "content"))}
    else:
        body = {"text": {"type": "string"}}
    choice = _obj({"index": _int(0), "finish_reason": finish, "logprobs": _nullable({"type": "object"}), **body},
                  ("index", "finish_reason", *body))
    return _obj({"id": {"type": "string"}, "object": {"const": "chat.completion" if chat else "text_completion"},
                 "created": _int(0), "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
                 "usage": _usage(), "duet_timeline": {"type": "object"}},
                ("id", "object", "created", "model", "choices", "usage"))


def _error_schema() -> dict[str, Any]:
    s = {"type": "string"}
    return _obj({"error": _obj({"message": s, "type": s, "param": _nullable(s), "code": _nullable(s)},
                               ("message", "type", "param", "code"))}, ("error",))


def _errors(*statuses: int) -> dict[str, Any]:
    why = {400: "invalid request (the message names the field)", 401: "missing or wrong bearer token",
           413: "body over the server's size limit",
           429: "over the concurrency cap, out of KV blocks, or the prefill workers could not reach the request "
                "before its timeout (Retry-After)",
           503: "draining or no live worker", 504: "the request timed out"}
    ref = {"content": {_JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {str(s): {"description": why[s], **ref} for s in statuses}


def _generate_operation(summary: str, request: str, response: str) -> dict[str, Any]:
    # one schema per server-sent event: chunks (or an in-band error after the 200) as JSON text, then "[DONE]"
    ok = {"description": "the completion; with stream=true, server-sent events ending in `data: [DONE]`",
          "content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{response}"}},
                      "text/event-stream": {"schema": _obj({"data": {"type": "string"}}, ("data",))}}}
    return {"post": {"summary": summary, "requestBody": {
        "required": True, "content": {_JSON: {"schema": {"$ref": f"#/components/schemas/{request}"}}}},
        "responses": {"200": ok, **_errors(400, 401, 413, 429, 503, 504)}}}


def _get(summary: str, schema: dict[str, Any], content_type: str = _JSON, public: bool = False,
         extra: dict[str, Any] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {
        "200": {"description": "OK", "content": {content_type: {"schema": schema}}}, **(extra or {})}}
    if public:
        op["security"] = []
    else:
        op["responses"].update(_errors(401))
    return {"get": op}


def openapi_document(server_url: str | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document (a fresh dict; ``server_url`` becomes its one ``servers`` entry when given)."""
    model = _obj({"id": {"type": "string"}, "object": {"const": "model"}, "created": _int(0),
                  "owned_by": {"type": "string"}, "max_model_len": _int(1)}, ("id", "object"))
    health = _obj({"status": {"enum": ["ok", "draining", "unavailable"]}}, ("status",))
    doc: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "Duet OpenAI-compatible API", "version": "1"},
        "paths": {
            "/v1/chat/completions": _generate_operation("chat completion (chat template applied)",
                                                        "ChatCompletionRequest", "ChatCompletion"),
            "/v1/completions": _generate_operation("text completion (prompt as is)", "CompletionRequest",
                                                   "Completion"),
            "/v1/models": _get("the served model", _obj({"object": {"const": "list"},
                                                         "data": {"type": "array", "items": model}},
                                                        ("object", "data"))),
            "/health": _get("liveness: a live prefill and decode worker and not draining", health, public=True,
                            extra={"503": {"description": "draining or no live worker",
                                           "content": {_JSON: {"schema": health}}}}),
            "/metrics": _get("Prometheus metrics", {"type": "string"}, "text/plain"),
            "/openapi.json": _get("this document", {"type": "object"}, public=True),
        },
        "components": {
            "schemas": {"ChatCompletionRequest": _chat_request(), "CompletionRequest": _completion_request(),
                        "ChatCompletion": _completion_response(chat=True),
                        "Completion": _completion_response(chat=False), "Error": _error_schema()},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
    if server_url:
        doc["servers"] = [{"url": server_url}]
    return doc
