"""The asyncio client: :class:`AsyncClient` and its :class:`AsyncTokenStream` (same methods as the sync client).

    async with AsyncClient("127.0.0.1:50051") as client:
        async for delta in client.generate("<image>Describe the image.", images=["shapes.png"]):
            print(delta.text, end="")
        print((await client.generate_text("How many shapes are there?", images=["shapes.png"])).text)

Closing the stream (``await stream.aclose()``, leaving ``async with``, or cancelling the task that iterates it)
cancels the call, which aborts the request on the server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from duet_client._proto.duet.v1 import duet_pb2 as pb
from duet_client._proto.duet.v1.duet_pb2_grpc import DuetStub
from duet_client.channel import (
    CHANNEL_OPTIONS,
    RetryPolicy,
    TLSConfig,
    call_metadata,
    tls_options,
)
from duet_client.client import _time_left
from duet_client.errors import Internal, Unavailable, from_rpc_error
from duet_client.request import API_VERSION, build_request
from duet_client.types import Completion, CompletionBuilder, Delta, message_to_dict


def _retryable(e: grpc.aio.AioRpcError) -> bool:
    return e.code() == grpc.StatusCode.UNAVAILABLE


class AsyncTokenStream(AsyncIterator[Delta]):
    """Deltas of one Generate call; ``completion`` is complete once the iterator is exhausted."""

    def __init__(self, start: Callable[[float | None], grpc.aio.UnaryStreamCall], deadline: float | None,
                 retry: RetryPolicy) -> None:
        self._start, self._deadline, self._retry = start, deadline, retry
        self._builder = CompletionBuilder()
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._attempts = 0
        self._closed = False

    @property
    def completion(self) -> Completion:
        return self._builder.completion

    @property
    def request_id(self) -> str:
        return self._builder.completion.request_id

    def __aiter__(self) -> AsyncTokenStream:
        return self

    async def __anext__(self) -> Delta:
        while True:
            if self._closed:
                raise StopAsyncIteration
            if self._call is None:
                self._attempts += 1
                self._call = self._start(_time_left(self._deadline))
            try:
                resp = await self._call.read()
            except grpc.aio.AioRpcError as e:
                if await self._may_retry(e):
                    continue
                self._closed = True
                raise from_rpc_error(e) from None
            except asyncio.CancelledError:
                self._cancel()
                raise
            if resp is grpc.aio.EOF:
                self._closed = True
                if not self._builder.finished:
                    raise Internal("the stream ended without a final message")
                raise StopAsyncIteration
            delta = self._builder.add(resp)
            if delta is not None:
                return delta

    async def _may_retry(self, e: grpc.aio.AioRpcError) -> bool:
        if not _retryable(e) or self._builder.started or self._attempts >= self._retry.max_attempts:
            return False
        pause = self._retry.backoff_s(self._attempts - 1)
        if self._deadline is not None and time.monotonic() + pause >= self._deadline:
            return False
        await asyncio.sleep(pause)
        self._call = None
        return True

    def _cancel(self) -> None:
        if self._call is not None and not self._closed:
            self._call.cancel()
        self._closed = True

    async def aclose(self) -> None:
        """Cancel the call if it is still running (the server aborts the request)."""
        self._cancel()

    async def __aenter__(self) -> AsyncTokenStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._cancel()


class AsyncClient:
    """The asyncio twin of :class:`duet_client.Client` (same arguments and methods, awaitable)."""

    def __init__(self, target: str, token: str | None = None, tls: bool | TLSConfig | None = None, *,
                 retry: RetryPolicy | None = None, options: Sequence[tuple[str, Any]] = ()) -> None:
        creds, extra = tls_options(tls)
        opts = [*CHANNEL_OPTIONS, *extra, *options]
        self._channel = (grpc.aio.secure_channel(target, creds, opts) if creds
                         else grpc.aio.insecure_channel(target, opts))
        self._stub = DuetStub(self._channel)
        self._metadata = call_metadata(token)
        self.retry = retry or RetryPolicy()

    def generate(self, prompt: str | Sequence[int] | None = None, *, timeout: float | None = None,
                 **options: Any) -> AsyncTokenStream:
        """As :meth:`duet_client.Client.generate`; iterate with ``async for``."""
        req = build_request(prompt, **options)
        deadline = None if timeout is None else time.monotonic() + timeout

        def start(left: float | None) -> grpc.aio.UnaryStreamCall:
            return self._stub.Generate(req, timeout=left, metadata=self._metadata)

        return AsyncTokenStream(start, deadline, self.retry)

    async def generate_text(self, prompt: str | Sequence[int] | None = None, *, timeout: float | None = None,
                            **options: Any) -> Completion:
        async with self.generate(prompt, timeout=timeout, **options) as stream:
            async for _ in stream:
                pass
            return stream.completion

    async def abort(self, request_id: str, *, timeout: float = 10.0) -> bool:
        resp = await self._unary(self._stub.Abort, pb.AbortRequest(api_version=API_VERSION, request_id=request_id),
                                 timeout)
        return resp.found

    async def list_models(self, *, timeout: float = 10.0) -> list[dict]:
        resp = await self._unary(self._stub.ListModels, pb.ListModelsRequest(api_version=API_VERSION), timeout)
        return [message_to_dict(m) for m in resp.models]

    async def cluster_status(self, *, timeout: float = 10.0) -> dict:
        return message_to_dict(await self._unary(self._stub.ClusterStatus,
                                                 pb.ClusterStatusRequest(api_version=API_VERSION), timeout))

    async def wait_ready(self, timeout: float = 30.0) -> None:
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise Unavailable(f"server not reachable within {timeout:.0f} s") from None

    async def _unary(self, method, req, timeout: float):
        deadline = time.monotonic() + timeout
        for attempt in range(self.retry.max_attempts):
            try:
                return await method(req, timeout=_time_left(deadline), metadata=self._metadata)
            except grpc.aio.AioRpcError as e:
                pause = self.retry.backoff_s(attempt)
                if (not _retryable(e) or attempt + 1 >= self.retry.max_attempts
                        or time.monotonic() + pause >= deadline):
                    raise from_rpc_error(e) from None
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
