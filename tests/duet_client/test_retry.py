"""The SDK against a scripted in-process gRPC server (no model, no Ray): UNAVAILABLE is retried with backoff only
before the first token, deadlines cover all attempts, status codes become typed exceptions with the retry hint,
and closing a stream cancels the call on the server."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from duet_client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    RetryPolicy,
    Unavailable,
)
from duet_client._proto.duet.v1 import duet_pb2 as pb
from duet_client._proto.duet.v1 import duet_pb2_grpc as pb_grpc

FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.02, max_backoff_s=0.05)


class Scripted(pb_grpc.DuetServicer):
    """Each Generate call pops the next script: a status code to fail with before any token, "midway" (one token
    then UNAVAILABLE), "stall" (one token then wait until cancelled), or "ok" (two tokens and a final)."""

    def __init__(self) -> None:
        self.script: list = []
        self.calls = 0
        self.cancelled = threading.Event()

    async def Generate(self, request, context):
        self.calls += 1
        step = self.script.pop(0) if self.script else "ok"
        if isinstance(step, grpc.StatusCode):
            md = (("retry-after-ms", "2500"),) if step == grpc.StatusCode.RESOURCE_EXHAUSTED else ()
            await context.abort(step, f"scripted {step.name}", trailing_metadata=md)
        yield pb.GenerateResponse(request_id="r", delta=pb.TokenDelta(token_ids=[7], text="a"))
        if step == "midway":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker went away")
        if step == "stall":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        yield pb.GenerateResponse(request_id="r", delta=pb.TokenDelta(token_ids=[8], text="b"))
        yield pb.GenerateResponse(request_id="r", final=pb.GenerateFinal(
            finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)))


@pytest.fixture(scope="module")
def fake():
    servicer = Scripted()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        server = grpc.aio.server()
        pb_grpc.add_DuetServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield servicer, f"127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)


@pytest.fixture
def scripted(fake):
    servicer, target = fake
    servicer.script, servicer.calls = [], 0
    servicer.cancelled.clear()
    return servicer, target


def test_unavailable_before_the_first_token_is_retried(scripted):
    servicer, target = scripted
    servicer.script = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
    with Client(target, retry=FAST) as c:
        done = c.generate_text("x")
    assert (done.text, done.token_ids, done.finish_reason, servicer.calls) == ("ab", [7, 8], "stop", 3)
    assert done.usage.total_tokens == 3


def test_retries_give_up_after_max_attempts(scripted):
    servicer, target = scripted
    servicer.script = [grpc.StatusCode.UNAVAILABLE] * 4
    with Client(target, retry=FAST) as c, pytest.raises(Unavailable, match="scripted UNAVAILABLE"):
        c.generate_text("x")
    assert servicer.calls == 4


def test_unavailable_after_a_token_is_not_retried(scripted):
    servicer, target = scripted
    servicer.script = ["midway"]
    with Client(target, retry=FAST) as c:
        stream = c.generate("x")
        assert next(stream).text == "a"
        with pytest.raises(Unavailable, match="worker went away"):
            next(stream)
    assert servicer.calls == 1


@pytest.mark.parametrize("code, exc", [(grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
                                       (grpc.StatusCode.INTERNAL, Internal),
                                       (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted)])
def test_other_codes_are_typed_and_not_retried(scripted, code, exc):
    servicer, target = scripted
    servicer.script = [code]
    with Client(target, retry=FAST) as c, pytest.raises(exc) as e:
        c.generate_text("x")
    assert servicer.calls == 1 and e.value.code == code
    if exc is ResourceExhausted:
        assert e.value.retry_after_s == 2.5


def test_deadline_and_cancel_on_close(scripted):
    servicer, target = scripted
    servicer.script = ["stall"]
    with Client(target, retry=FAST) as c:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            c.generate_text("x", timeout=0.5)
        assert time.monotonic() - t0 < 5
        servicer.script = ["stall"]
        stream = c.generate("x")
        next(stream)
        stream.close()
    assert servicer.cancelled.wait(5)


def test_async_client_retries_and_cancels(scripted):
    servicer, target = scripted
    servicer.script = [grpc.StatusCode.UNAVAILABLE, "stall"]

    async def go():
        async with AsyncClient(target, retry=FAST) as ac:
            stream = ac.generate("x")
            first = await stream.__anext__()
            await stream.aclose()
            servicer.script = [grpc.StatusCode.UNAVAILABLE]
            return first, await ac.generate_text("y")

    first, done = asyncio.run(go())
    assert first.text == "a" and done.text == "ab" and servicer.calls == 4
    assert servicer.cancelled.wait(5)
