"""The synchronous client: :class:`Client` and its :class:`TokenStream`.

    with Client("127.0.0.1:50051") as client:
        for delta in client.generate("<image>Describe the image.", images=["shapes.png"], max_tokens=32):
            print(delta.text, end="", flush=True)
        print(client.generate_text("How many shapes are there?", images=["shapes.png"]).text)

A stream is an iterator of :class:`~duet_client.types.Delta`; once exhausted, ``stream.completion`` has the finish
reason, usage and the request's timeline. Closing it (``close()``, leaving a ``with`` block, or dropping it) cancels
the call, which aborts the request on the server's prefill and decode workers. A call that fails with UNAVAILABLE
before any token arrived is retried with backoff within its deadline (``timeout``, seconds, covering all attempts).
Failures raise the typed exceptions of :mod:`duet_client.errors`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from duet_client._proto.duet.v1 import duet_pb2 as pb
from duet_client._proto.duet.v1.duet_pb2_grpc import DuetStub
from duet_client.channel import (
    CHANNEL_OPTIONS,
    RetryPolicy,
    TLSConfig,
    call_metadata,
    tls_options,
)
from duet_client.errors import DeadlineExceeded, Internal, Unavailable, from_rpc_error
from duet_client.request import API_VERSION, build_request
from duet_client.types import Completion, CompletionBuilder, Delta, message_to_dict


def _time_left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("deadline exceeded before the call could be made")
    return left


def _retryable(e: grpc.RpcError) -> bool:
    return isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.UNAVAILABLE


class TokenStream(Iterator[Delta]):
    """Deltas of one Generate call; ``completion`` is complete once the iterator is exhausted."""

    def __init__(self, start: Callable[[float | None], Any], deadline: float | None, retry: RetryPolicy) -> None:
        self._start, self._deadline, self._retry = start, deadline, retry
        self._builder = CompletionBuilder()
        self._call: Any = None
        self._attempts = 0
        self._closed = False

    @property
    def completion(self) -> Completion:
        return self._builder.completion

    @property
    def request_id(self) -> str:
        return self._builder.completion.request_id

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> Delta:
        while True:
            if self._closed:
                raise StopIteration
            if self._call is None:
                self._attempts += 1
                self._call = self._start(_time_left(self._deadline))
            try:
                resp = next(self._call)
            except StopIteration:
                self._closed = True
                if not self._builder.finished:
                    raise Internal("the stream ended without a final message") from None
                raise
            except grpc.RpcError as e:
                if self._may_retry(e):
                    continue
                self._closed = True
                raise from_rpc_error(e) from None
            delta = self._builder.add(resp)
            if delta is not None:
                return delta

    def _may_retry(self, e: grpc.RpcError) -> bool:
        if not _retryable(e) or self._builder.started or self._attempts >= self._retry.max_attempts:
            return False
        pause = self._retry.backoff_s(self._attempts - 1)
        if self._deadline is not None and time.monotonic() + pause >= self._deadline:
            return False
        time.sleep(pause)
        self._call = None
        return True

    def close(self) -> None:
        """Cancel the call if it is still running (the server aborts the request)."""
        if self._call is not None and not self._closed:
            self._call.cancel()
        self._closed = True

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class Client:
    """A connection to a Duet server (``target`` is "host:port"). ``token``: the server's bearer token;
    ``tls``: True (system roots) or a :class:`TLSConfig`; None/False for plaintext (loopback, trusted networks)."""

    def __init__(self, target: str, token: str | None = None, tls: bool | TLSConfig | None = None, *,
                 retry: RetryPolicy | None = None, options: Sequence[tuple[str, Any]] = ()) -> None:
        creds, extra = tls_options(tls)
        opts = [*CHANNEL_OPTIONS, *extra, *options]
        self._channel = grpc.secure_channel(target, creds, opts) if creds else grpc.insecure_channel(target, opts)
        self._stub = DuetStub(self._channel)
        self._metadata = call_metadata(token)
        self.retry = retry or RetryPolicy()

    def generate(self, prompt: str | Sequence[int] | None = None, *, timeout: float | None = None,
                 **options: Any) -> TokenStream:
        """Stream the completion of ``prompt`` (text, each ``<image>`` marking where the next of ``images`` goes, or
        token ids) or of chat ``messages=[{"role", "content"}]``. Options: ``images`` (bytes, paths or PIL
        images), ``max_tokens, temperature, top_p, top_k, seed, stop`` (a string or a list), ``stop_token_ids,
        min_tokens, ignore_eos, raw_prompt`` (skip the chat template), ``model``, ``request_id``, the penalties,
        ``logprobs, prompt_logprobs, n``; ``response_format`` (OpenAI's dict: structured outputs), and with chat
        ``messages`` ``tools, tool_choice, parallel_tool_calls`` as OpenAI's chat API takes them (the final
        ``Completion`` then has ``tool_calls`` and ``content``; the deltas carry the raw text). ``timeout`` is the
        deadline in seconds for the whole call, retries included."""
        req = build_request(prompt, **options)
        deadline = None if timeout is None else time.monotonic() + timeout

        def start(left: float | None):
            return self._stub.Generate(req, timeout=left, metadata=self._metadata)

        return TokenStream(start, deadline, self.retry)

    def generate_text(self, prompt: str | Sequence[int] | None = None, *, timeout: float | None = None,
                      **options: Any) -> Completion:
        """Run :meth:`generate` to the end; returns the whole :class:`Completion`."""
        with self.generate(prompt, timeout=timeout, **options) as stream:
            for _ in stream:
                pass
            return stream.completion

    def abort(self, request_id: str, *, timeout: float = 10.0) -> bool:
        """End a running request by id; False when none was running."""
        return self._unary(self._stub.Abort, pb.AbortRequest(api_version=API_VERSION, request_id=request_id),
                           timeout).found

    def list_models(self, *, timeout: float = 10.0) -> list[dict]:
        """The served models (``id``, context length, limits on prompts, images and max_tokens)."""
        resp = self._unary(self._stub.ListModels, pb.ListModelsRequest(api_version=API_VERSION), timeout)
        return [message_to_dict(m) for m in resp.models]

    def cluster_status(self, *, timeout: float = 10.0) -> dict:
        """Workers, their queues and KV use, in-flight requests, expert load summary, and the pool healer's state:
        each worker's ``healing`` (``WORKER_HEALING_RESPAWNING`` / ``WORKER_HEALING_GIVEN_UP`` for a dead one) and
        ``healing`` ``{prefill_respawns, decode_respawns, given_up: [worker ids], respawning: [worker ids]}`` (a
        version-1 server sends neither: ``WORKER_HEALING_UNSPECIFIED`` and zeros / empty lists)."""
        return message_to_dict(self._unary(self._stub.ClusterStatus,
                                           pb.ClusterStatusRequest(api_version=API_VERSION), timeout))

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the channel is connected (raises :class:`~duet_client.errors.Unavailable` on timeout)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"server not reachable within {timeout:.0f} s") from None

    def _unary(self, method, req, timeout: float):
        deadline = time.monotonic() + timeout
        for attempt in range(self.retry.max_attempts):
            try:
                return method(req, timeout=_time_left(deadline), metadata=self._metadata)
            except grpc.RpcError as e:
                pause = self.retry.backoff_s(attempt)
                if (not _retryable(e) or attempt + 1 >= self.retry.max_attempts
                        or time.monotonic() + pause >= deadline):
                    raise from_rpc_error(e) from None
                time.sleep(pause)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
