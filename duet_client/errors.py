"""Typed exceptions for gRPC status codes.

Every failed call raises a subclass of :class:`DuetClientError` carrying the status ``code`` and the server's
``details`` (which name the problem). :class:`ResourceExhausted` also carries ``retry_after_s``, the server's hint
(``retry-after-ms`` trailing metadata) for when to try again.
"""

from __future__ import annotations

import grpc
import grpc.aio

RETRY_AFTER_KEY = "retry-after-ms"


class DuetClientError(Exception):
    """Base class: a call to a Duet server failed."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, *, code: grpc.StatusCode | None = None) -> None:
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code


class InvalidArgument(DuetClientError):
    """The request was rejected as malformed (the message names the problem); nothing ran."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthenticated(DuetClientError):
    """Missing or wrong bearer token."""

    code = grpc.StatusCode.UNAUTHENTICATED


class _RetryHint(DuetClientError):
    """An error that may carry the server's ``retry_after_s`` hint (gRPC trailing metadata)."""

    def __init__(self, details: str, *, code: grpc.StatusCode | None = None, retry_after_s: float | None = None
                 ) -> None:
        super().__init__(details, code=code)
        self.retry_after_s = retry_after_s


class ResourceExhausted(_RetryHint):
    """The server is at its concurrency cap, out of KV space, or its prefill workers have more queued than they could
    finish before this request's timeout; retry after ``retry_after_s`` seconds."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(DuetClientError):
    """The call's deadline (``timeout``) passed before it finished."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(_RetryHint):
    """The server cannot be reached, is draining, has no live worker (retried before the first token), or cannot
    reach its Ray cluster; ``retry_after_s``: the server's hint when it gave one."""

    code = grpc.StatusCode.UNAVAILABLE


class NotFound(DuetClientError):
    code = grpc.StatusCode.NOT_FOUND


class Cancelled(DuetClientError):
    """The call was cancelled (by this client closing the stream, or by the server)."""

    code = grpc.StatusCode.CANCELLED


class Internal(DuetClientError):
    """The server failed (INTERNAL, UNKNOWN, or a code this client does not map)."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[DuetClientError]] = {
    cls.code: cls for cls in (InvalidArgument, Unauthenticated, ResourceExhausted, DeadlineExceeded, Unavailable,
                              NotFound, Cancelled, Internal)
}
_BY_CODE[grpc.StatusCode.ALREADY_EXISTS] = InvalidArgument
_BY_CODE[grpc.StatusCode.OUT_OF_RANGE] = InvalidArgument
_BY_CODE[grpc.StatusCode.PERMISSION_DENIED] = Unauthenticated


def retry_after_from_metadata(metadata) -> float | None:
    """Seconds from a ``retry-after-ms`` entry of trailing metadata, if present."""
    for key, value in metadata or ():
        if key == RETRY_AFTER_KEY:
            try:
                return int(value) / 1000.0
            except ValueError:
                return None
    return None


def from_status(code: grpc.StatusCode, details: str | None, trailing_metadata=None) -> DuetClientError:
    cls = _BY_CODE.get(code, Internal)
    details = details or code.name
    if issubclass(cls, _RetryHint):
        return cls(details, code=code, retry_after_s=retry_after_from_metadata(trailing_metadata))
    return cls(details, code=code)


def from_rpc_error(e: grpc.RpcError) -> DuetClientError:
    """The typed exception for a failed call (a ``grpc.Call`` from the sync API or an ``AioRpcError``)."""
    if isinstance(e, grpc.Call | grpc.aio.AioRpcError):
        return from_status(e.code(), e.details(), e.trailing_metadata())
    return Internal(str(e) or type(e).__name__)
