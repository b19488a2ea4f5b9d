"""The ``duet.v1.Duet`` gRPC service (grpc.aio), its bearer-token check, and the standard health service.

Messages are converted at this edge only: :func:`~cluster.serve.grpc_requests.request_from_proto` builds the
service's :class:`~cluster.serve.service.GenerateInput`; events go back as ``GenerateResponse`` messages. A request
with tools (api_version 3) streams its raw text as any other; its final message carries each choice's tool calls,
parsed by the same parser and rule as the HTTP reply (:func:`~cluster.serve.tool_calls.reply_message`). A client that
cancels the call cancels the handler task, which closes the service's stream and aborts the request on its workers.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import uuid
from collections import defaultdict
from pathlib import Path

import grpc
import grpc.aio
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.serve.config import ServeConfig
from cluster.serve.errors import classify
from cluster.serve.grpc_requests import API_VERSION, request_from_proto
from cluster.serve.schema import ChoiceEnd, DeltaEvent, FinalEvent
from cluster.serve.service import InferenceService
from cluster.serve.tool_calls import HermesParser, reply_message, tool_parser
from engine.errors import DuetError
from duet_client._proto.duet.v1 import duet_pb2 as pb
from duet_client._proto.duet.v1 import duet_pb2_grpc as pb_grpc
from duet_client.errors import RETRY_AFTER_KEY

logger = logging.getLogger(__name__)

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT,
           "tool_calls": pb.FINISH_REASON_TOOL_CALLS}
_ROLES = {"prefill": pb.WORKER_ROLE_PREFILL, "decode": pb.WORKER_ROLE_DECODE}
# a status row's "healing" (cluster.control.pool_healer.PoolHealer.state_of)
_HEALING = {"respawning": pb.WORKER_HEALING_RESPAWNING, "given_up": pb.WORKER_HEALING_GIVEN_UP}


class ToolReplies:
    """A request with tools: each choice's streamed text, parsed into tool calls when the final message is written."""

    def __init__(self, parser: HermesParser) -> None:
        self.parser = parser
        self.texts: dict[int, list[str]] = defaultdict(list)

    def note(self, ev: DeltaEvent) -> None:
        self.texts[ev.index].append(ev.text)

    def choice(self, end: ChoiceEnd) -> pb.ChoiceFinal:
        """Choice ``end`` with its calls, the content without them, and ``tool_calls`` as its finish reason when it
        stopped with calls (the HTTP reply's rule)."""
        msg, finish = reply_message(self.parser, "".join(self.texts[end.index]), end.finish_reason)
        calls = [pb.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                 for c in msg.get("tool_calls", [])]
        return pb.ChoiceFinal(index=end.index, finish_reason=_FINISH.get(finish, pb.FINISH_REASON_UNSPECIFIED),
                              stop=end.stop, completion_tokens=end.completion_tokens, tool_calls=calls,
                              content=msg["content"] or "")


def _choice_to_proto(end: ChoiceEnd) -> pb.ChoiceFinal:
    return pb.ChoiceFinal(index=end.index, finish_reason=_FINISH.get(end.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
                          stop=end.stop, completion_tokens=end.completion_tokens)


def final_to_proto(ev: FinalEvent, tools: ToolReplies | None = None) -> pb.GenerateFinal:
    t, kv = ev.timeline, ev.timeline.get("kv_transfer") or {}
    timeline = pb.Timeline(
        vision_encode_seconds=float(t.get("vision_encode_s", 0.0)),
        queue_seconds=t["queue_s"], preprocess_seconds=t["preprocess_s"], prefill_seconds=t["prefill_s"],
        decode_seconds=t["decode_s"], ttft_seconds=t["ttft_s"], total_seconds=t["total_s"],
        attempts=t["attempts"], prefill_worker=t.get("prefill_worker", ""),
        decode_worker=t.get("decode_worker", ""),
        ttft_breakdown=pb.TtftBreakdown(**{k[:-2] + "_seconds": float(v)
                                           for k, v in (t.get("ttft_breakdown") or {}).items()}),
        kv_transfer=pb.KVTransfer(transport=kv.get("transport", ""), bytes=int(kv.get("bytes", 0)),
                                  wire_bytes=int(kv.get("wire_bytes", kv.get("bytes", 0))),
                                  layers=int(kv.get("layers", 0)), seconds=float(kv.get("seconds", 0.0)),
                                  exposed_seconds=float(kv.get("exposed_seconds", 0.0)),
                                  state_bytes=int(kv.get("state_bytes", 0)),
                                  state_frames=int(kv.get("state_frames", 0))))
    usage = pb.Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens,
                     total_tokens=ev.prompt_tokens + ev.completion_tokens)
    choices = [tools.choice(c) if tools is not None else _choice_to_proto(c) for c in ev.choices]
    finish = _FINISH.get(ev.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
    if tools is not None:  # TOOL_CALLS when choice 0 ended with calls
        finish = next((c.finish_reason for c in choices if c.index == 0), finish)
    return pb.GenerateFinal(finish_reason=finish, stop=ev.stop, usage=usage, timeline=timeline, choices=choices)


def _logprobs_to_proto(lps) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=x) for t, x in lp.top]) for lp in lps if lp is not None]


def delta_to_proto(ev: DeltaEvent) -> pb.TokenDelta:
    return pb.TokenDelta(token_ids=ev.token_ids, text=ev.text, index=ev.index,
                         logprobs=_logprobs_to_proto(ev.logprobs or []),
                         prompt_logprobs=_logprobs_to_proto(ev.prompt_logprobs or []))


class DuetServicer(pb_grpc.DuetServicer):
    def __init__(self, service: InferenceService) -> None:
        self.service = service

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id or uuid.uuid4().hex
        try:
            inp = request_from_proto(request)
            inp.request_id = rid
            # chat with tools: the model family's parser (sets the calls' grammar for required / a named tool)
            parser = tool_parser(inp.tools, inp.sampling, self.service.cluster.inputs.cfg.text.model_type)
            tools = ToolReplies(parser) if parser is not None else None
            await context.send_initial_metadata((("x-request-id", rid),))
            # aclosing: a cancelled call closes the request at once, wherever this handler was suspended
            async with contextlib.aclosing(self.service.generate(inp, api="grpc")) as events:
                async for ev in events:
                    if isinstance(ev, DeltaEvent):
                        if tools is not None:
                            tools.note(ev)
                        yield pb.GenerateResponse(api_version=API_VERSION, request_id=rid,
                                                  delta=delta_to_proto(ev))
                    else:
                        yield pb.GenerateResponse(api_version=API_VERSION, request_id=rid,
                                                  final=final_to_proto(ev, tools))
        except Exception as e:  # noqa: BLE001 - every failure becomes a status
            await _abort_with(context, e)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(api_version=API_VERSION, found=self.service.abort(request.request_id))

    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(api_version=API_VERSION, models=[pb.ModelInfo(**self.service.model_info())])

    async def ClusterStatus(self, request: pb.ClusterStatusRequest, context) -> pb.ClusterStatusResponse:
        try:
            st = await self.service.status()
        except DuetError as e:  # the cluster cannot be asked (its Ray head is gone): UNAVAILABLE, not INTERNAL
            await _abort_with(context, e)
        return status_to_proto(st)


def status_to_proto(st: dict) -> pb.ClusterStatusResponse:
    """:meth:`InferenceService.status <cluster.serve.service.InferenceService.status>` as ``ClusterStatusResponse``."""
    workers = [pb.WorkerStatus(
        worker_id=w["worker_id"], role=_ROLES[w["role"]], alive=w["alive"], waiting=w.get("waiting", 0),
        running=w.get("running", 0), receiving=w.get("receiving", 0),
        outstanding_tokens=w.get("outstanding_tokens", 0), free_blocks=w.get("free_blocks", 0),
        total_blocks=w.get("total_blocks", 0), prompt_tokens=w.get("prompt_tokens", 0),
        cached_tokens=w.get("cached_tokens", 0), kv_pool_bytes=w.get("kv_pool_bytes", 0),
        kv_mirror_bytes=w.get("kv_mirror_bytes", 0), kv_state_bytes=w.get("kv_state_bytes", 0),
        vision_cache_bytes=w.get("vision_cache_bytes", 0), kv_text_bytes=w.get("kv_text_bytes", 0),
        kv_visual_bytes=w.get("kv_visual_bytes", 0), encoder_workspace_bytes=w.get("encoder_workspace_bytes", 0),
        prefix_cache_off=w.get("prefix_cache_off") or "",
        healing=_HEALING.get(w.get("healing"), pb.WORKER_HEALING_UNSPECIFIED)) for w in st["workers"]]
    h = st["healing"]  # cluster.control.disagg.DisaggCluster.healing
    healing = pb.PoolHealing(prefill_respawns=h["respawns"]["prefill"], decode_respawns=h["respawns"]["decode"],
                             given_up=h["given_up"]["prefill"] + h["given_up"]["decode"], respawning=h["respawning"])
    return pb.ClusterStatusResponse(
        api_version=API_VERSION, model=st["model"], transport=st["transport"], workers=workers,
        in_flight=st["in_flight"], max_concurrent=st["max_concurrent"], kv_usage=st["kv_usage"],
        experts=pb.ExpertSummary(**st["experts"]), requests_served=st["requests_served"],
        draining=st["draining"], prefix_hit_rate=st["prefix_cache"]["hit_rate"] or 0.0,
        predicted_prefix_hit_rate=st["prefix_cache"]["predicted_hit_rate"] or 0.0,
        kv_memory_bytes=st["kv_memory"]["total_bytes"], healing=healing,
        kv_state_bytes=st["kv_memory"]["state_bytes"], prefix_cache_off_reason=st["prefix_cache"]["off_reason"] or "")


async def _abort_with(context: grpc.aio.ServicerContext, e: BaseException) -> None:
    info = classify(e)
    if info.grpc_code == grpc.StatusCode.INTERNAL:
        logger.exception("Generate failed", exc_info=e)
    trailing = ((RETRY_AFTER_KEY, str(int(info.retry_after_s * 1000))),) if info.retry_after_s else ()
    await context.abort(info.grpc_code, info.message, trailing_metadata=trailing)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` on every call except the health service's."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        got = dict(details.invocation_metadata or ()).get("authorization")
        if got is not None and hmac.compare_digest(str(got).encode(), self._expected):
            return handler
        why = "missing bearer token (authorization metadata)" if got is None else "wrong bearer token"
        return _denying(handler, why)


def _denying(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with UNAUTHENTICATED."""
    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}

    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield  # pragma: no cover - makes this an async generator

    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(deny, **kw)


class _Malformed:
    """What a request whose bytes do not parse becomes, so its handler can refuse it with a typed status."""

    def __init__(self, why: str) -> None:
        self.why = why


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """A request message that does not parse ends with INVALID_ARGUMENT (grpc's own answer would be UNKNOWN)."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler  # no client-streaming method in duet.v1 or the health service
        parse = handler.request_deserializer

        def deserialize(data: bytes):
            try:
                return parse(data)
            except DecodeError as e:
                return _Malformed(f"the request message does not parse: {e}")

        kw = {"request_deserializer": deserialize, "response_serializer": handler.response_serializer}
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
                async for reply in inner_stream(request, context):
                    yield reply

            return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
        inner = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)


async def start_grpc(service: InferenceService, cfg: ServeConfig
                     ) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start the gRPC server on ``cfg.host:cfg.grpc_port``; returns it, the bound port, and its health servicer."""
    # the token check first: it answers with the handler the malformed-request check built
    interceptors = [*([TokenAuthInterceptor(cfg.token)] if cfg.token else []), MalformedRequestInterceptor()]
    size = cfg.limits.max_message_bytes
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size),
        ("grpc.so_reuseport", 0)])
    pb_grpc.add_DuetServicer_to_server(DuetServicer(service), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{cfg.host}:{cfg.grpc_port}" if ":" not in cfg.host else f"[{cfg.host}]:{cfg.grpc_port}"
    if cfg.tls:
        creds = grpc.ssl_server_credentials([(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())])
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    await server.start()
    for name in ("", "duet.v1.Duet"):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer
