"""OpenAI-compatible HTTP API (aiohttp): ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, plus
``/health``, ``/metrics`` (Prometheus) and ``/openapi.json`` (this API's OpenAPI description, :mod:`.openapi`).

Chat messages take text and ``image_url`` parts; images must be base64 ``data:`` URLs (the server fetches nothing).
Each image part becomes an ``<image>`` placeholder at its place in the message, and the conversation goes through
the model's chat template. ``/v1/completions`` takes the prompt as it is (text or token ids). ``stream: true``
answers with server-sent events ending in ``data: [DONE]``. Errors have OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``. A client that disconnects cancels the handler (aiohttp's
handler cancellation), which aborts the request on its workers.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator

from aiohttp import web

from cluster.serve.errors import classify
from cluster.serve.openai_logprobs import chat_logprobs, completion_logprobs, joined, prompt_logprobs
from cluster.serve.openai_requests import chat_input, completion_from_body, stream_flags
from cluster.serve.openapi import openapi_document
from cluster.serve.schema import DeltaEvent, FinalEvent, GenerateInput
from cluster.serve.service import InferenceService
from cluster.serve.tool_calls import ToolStream, reply_message, tool_parser
from engine.errors import InvalidRequestError, RequestAbortedError
from engine.outputs import TokenLogprobs

logger = logging.getLogger(__name__)

SERVICE_KEY = web.AppKey("service", InferenceService)
TOKEN_KEY = web.AppKey("token", str)
_PUBLIC_PATHS = ("/health", "/openapi.json")


# ------------------------------------------------------------------------------------------------------ responses
def error_response(e: BaseException) -> web.Response:
    info = classify(e)
    if info.http_status >= 500 and info.outcome == "error":
        logger.exception("request failed", exc_info=e)
    headers = {"Retry-After": str(max(1, round(info.retry_after_s)))} if info.retry_after_s else None
    return web.json_response(_error_body(info.message, info.openai_type, info.openai_code),
                             status=info.http_status, headers=headers)


def _error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _usage(ev: FinalEvent) -> dict:
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens}


def _finish(reason: str) -> str:
    """An OpenAI finish reason. OpenAI has no "abort": a reply cut short (the server drained past its timeout, the
    request cancelled) is an error -- a 503 before the response started, an in-band error in a stream -- never a
    200 that reads like a natural end."""
    if reason == "abort":
        raise RequestAbortedError("the request was aborted before it finished (the server is shutting down or it "
                                  "was cancelled); it may be sent again")
    return reason


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequestError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return body


class _Reply:
    """How one request's choices are written: chat or completion shape, logprobs, echo."""

    def __init__(self, service: InferenceService, inp: GenerateInput, body: dict, chat: bool) -> None:
        self.chat, self.tok = chat, service.cluster.tokenizer
        self.want_logprobs = inp.sampling.logprobs is not None
        self._echo: str | None = None  # built on first use: after the request was validated (its ids in the vocab)
        self._echo_of = inp if not chat and body.get("echo") else None
        self.streaming = bool(body.get("stream"))
        self.offsets: dict[int, int] = {}  # completions: text returned so far per choice (logprobs text_offset)
        self.prompt: dict | None = None  # echo with logprobs: the prompt tokens' logprobs (completions' shape)
        # chat with tools: the model family's tool-call parser (sets the calls' grammar for required / named)
        self.parser = tool_parser(inp.tools, inp.sampling, service.cluster.inputs.cfg.text.model_type) if chat else None
        self.tool_streams: dict[int, ToolStream] = {}

    @property
    def echo(self) -> str:
        """The prompt's text when the request asked for ``echo`` (else ""); read only once the first event came."""
        if self._echo is None:
            inp = self._echo_of
            self._echo = "" if inp is None else (
                inp.prompt if inp.prompt is not None else token_text_of(self.tok, inp.prompt_token_ids or []))
        return self._echo

    def note(self, ev: DeltaEvent) -> None:
        if ev.prompt_logprobs is not None and self.echo and self.want_logprobs:
            self.prompt = prompt_logprobs(self.tok, ev.prompt_token_ids or [], ev.prompt_logprobs)

    def logprobs(self, index: int, lps: list[TokenLogprobs] | None) -> dict | None:
        if not self.want_logprobs:
            return None
        if self.chat:
            return chat_logprobs(self.tok, lps or [])
        out = completion_logprobs(self.tok, lps or [], self.offsets.get(index, len(self.echo)))
        return joined(self.prompt, out) if index not in self.offsets and not self.streaming else out

    def tool_delta(self, index: int, text: str) -> tuple[str, list]:
        """Streaming chat with tools: the content part of ``text`` and the calls it completed."""
        if self.parser is None:
            return text, []
        return self.tool_streams.setdefault(index, ToolStream(self.parser)).push(text)

    def tool_end(self, index: int) -> tuple[str, list]:
        return self.tool_streams[index].finish() if index in self.tool_streams else ("", [])

    def finish_reason(self, index: int, finish: str) -> str:
        stream = self.tool_streams.get(index)
        return "tool_calls" if stream is not None and stream.calls and finish == "stop" else finish

    def advance(self, index: int, text: str) -> None:
        self.offsets[index] = self.offsets.get(index, len(self.echo)) + len(text)


def token_text_of(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False) if tok is not None else ""


async def _serve(request: web.Request, inp: GenerateInput, body: dict, chat: bool) -> web.StreamResponse:
    service = request.app[SERVICE_KEY]
    kind = "chat.completion" if chat else "text_completion"
    meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": service.model_name}
    reply = _Reply(service, inp, body, chat)
    stream, include_usage = stream_flags(body)
    events = service.generate(inp, api="http")
    try:
        if stream:
            return await _stream(request, events, meta, kind, reply, include_usage)
        texts: dict[int, list[str]] = defaultdict(list)
        lps: dict[int, list[TokenLogprobs]] = defaultdict(list)
        final = None
        async for ev in events:
            if isinstance(ev, DeltaEvent):
                reply.note(ev)
                texts[ev.index].append(ev.text)
                lps[ev.index].extend(ev.logprobs or [])
            else:
                final = ev
        assert final is not None
        choices = []
        for end in final.choices:
            text = reply.echo + "".join(texts[end.index])
            choice: dict = {"index": end.index, "finish_reason": _finish(end.finish_reason),
                            "logprobs": reply.logprobs(end.index, lps[end.index])}
            if chat:
                choice["message"], choice["finish_reason"] = reply_message(reply.parser, text, choice["finish_reason"])
            else:
                choice["text"] = text
            choices.append(choice)
        return web.json_response({**meta, "object": kind, "choices": choices, "usage": _usage(final),
                                  "duet_timeline": final.timeline})
    finally:
        await events.aclose()


async def _stream(request: web.Request, events: AsyncIterator, meta: dict, kind: str, reply: _Reply,
                  include_usage: bool) -> web.StreamResponse:
    first = await anext(events)  # a bad request fails here, before the 200 is sent
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    chat = reply.chat

    async def send(obj: dict | str) -> None:
        await resp.write(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())

    def chunk(index: int, text: str | None, finish: str | None, role: bool = False, lps: dict | None = None) -> dict:
        if chat:
            delta = {"role": "assistant", "content": text or ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": lps}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": lps}
        return {**meta, "object": f"{kind}.chunk" if chat else kind, "choices": [choice]}

    def tool_chunk(index: int, call) -> dict:
        delta = {"tool_calls": [call.openai(reply.tool_streams[index].calls.index(call))]}
        return {**meta, "object": f"{kind}.chunk", "choices": [{"index": index, "delta": delta, "finish_reason": None,
                                                               "logprobs": None}]}

    started: set[int] = set()  # choices whose role chunk (chat) or echo (completions) was sent
    ev = first
    try:
        while True:
            if isinstance(ev, DeltaEvent):
                i = ev.index
                reply.note(ev)
                if i not in started and (chat or reply.echo):
                    await send(chunk(i, reply.echo if not chat else "", None, role=chat, lps=reply.prompt))
                started.add(i)
                text, calls = reply.tool_delta(i, ev.text)
                if text or (reply.want_logprobs and ev.token_ids):
                    lps = reply.logprobs(i, ev.logprobs) if ev.token_ids else None
                    await send(chunk(i, text, None, lps=lps))
                    reply.advance(i, text)
                for call in calls:
                    await send(tool_chunk(i, call))
            else:
                for end in ev.choices:
                    text, calls = reply.tool_end(end.index)
                    if text:
                        await send(chunk(end.index, text, None))
                    for call in calls:
                        await send(tool_chunk(end.index, call))
                    last = chunk(end.index, None, reply.finish_reason(end.index, _finish(end.finish_reason)))
                    if end is ev.choices[-1]:  # the request's timeline rides on its last finish chunk
                        last["duet_timeline"] = ev.timeline
                    await send(last)
                if include_usage:
                    await send({**meta, "object": f"{kind}.chunk" if chat else kind, "choices": [],
                                "usage": _usage(ev)})
                break
            ev = await anext(events)
    except Exception as e:  # noqa: BLE001 - after the 200: report in-band, as OpenAI-compatible servers do
        info = classify(e)
        await send(_error_body(info.message, info.openai_type, info.openai_code))
    await send("[DONE]")
    await resp.write_eof()
    return resp


# --------------------------------------------------------------------------------------------------------- routes
async def chat_completions(request: web.Request) -> web.StreamResponse:
    try:
        body = await _json_body(request)
        return await _serve(request, chat_input(body), body, chat=True)
    except web.HTTPException:
        raise
    except Exception as e:  # noqa: BLE001
        return error_response(e)


async def completions(request: web.Request) -> web.StreamResponse:
    try:
        body = await _json_body(request)
        return await _serve(request, completion_from_body(body), body, chat=False)
    except web.HTTPException:
        raise
    except Exception as e:  # noqa: BLE001
        return error_response(e)


async def models(request: web.Request) -> web.Response:
    info = request.app[SERVICE_KEY].model_info()
    return web.json_response({"object": "list", "data": [
        {"id": info["id"], "object": "model", "created": 0, "owned_by": "duet",
         "max_model_len": info["max_model_len"]}]})


async def health_check(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    ok = service.healthy()
    return web.json_response({"status": "ok" if ok else ("draining" if service.draining else "unavailable")},
                             status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    return web.Response(body=service.metrics.render(), headers={"Content-Type": service.metrics.content_type})


async def openapi_json(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


@web.middleware
async def auth_and_errors(request: web.Request, handler):
    """Bearer token (when configured) on everything but ``/health``; aiohttp's own errors in OpenAI's shape."""
    token = request.app.get(TOKEN_KEY)
    if token and request.path not in _PUBLIC_PATHS:
        got = request.headers.get("Authorization")
        if got is None or not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
            why = "missing bearer token (Authorization header)" if got is None else "wrong bearer token"
            request.app[SERVICE_KEY].metrics.requests.labels("http", "unauthenticated").inc()
            return web.json_response(_error_body(why, "authentication_error", "invalid_api_key"), status=401)
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return web.json_response(_error_body(e.reason or str(e), kind), status=e.status)


def make_app(service: InferenceService, token: str | None, max_body_bytes: int) -> web.Application:
    app = web.Application(middlewares=[auth_and_errors], client_max_size=max_body_bytes)
    app[SERVICE_KEY] = service
    if token:
        app[TOKEN_KEY] = token
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health_check)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi_json)
    return app
