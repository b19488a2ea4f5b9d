"""How a failed request is reported on each API: gRPC status code, HTTP status, OpenAI error type, metric outcome.

One table for both front-ends, so a bad image is INVALID_ARGUMENT on gRPC and 400 on HTTP by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from cluster.control.errors import (
    ClusterUnavailableError,
    DecodeInterruptedError,
    PrefillOverloadedError,
    RequestTimeoutError,
    TransferFailedError,
)
from cluster.serve.limits import Overloaded
from engine.errors import DuetError, InvalidRequestError, OutOfBlocksError, RequestAbortedError, is_retryable
from engine.isolation import RequestFailedError


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve."""


class DuplicateRequestIdError(InvalidRequestError):
    """A running request already has this id."""


class ServerDrainingError(DuetError):
    """The server is shutting down and takes no new requests."""


@dataclass(frozen=True)
class ErrorInfo:
    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str
    openai_code: str | None
    outcome: str  # metric label
    message: str
    retry_after_s: float | None = None  # a refusal's hint: HTTP Retry-After, gRPC retry-after-ms trailing metadata


def classify(e: BaseException) -> ErrorInfo:
    """The report of ``e`` (an unexpected exception is INTERNAL / 500 with a generic message)."""
    msg = str(e) or type(e).__name__
    if isinstance(e, ModelNotFoundError):
        return ErrorInfo(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", "model_not_found",
                         "invalid", msg)
    if isinstance(e, InvalidRequestError):
        return ErrorInfo(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", None, "invalid", msg)
    if isinstance(e, Overloaded):
        return ErrorInfo(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "rate_limit_exceeded",
                         "overloaded", msg, e.retry_after_s)
    if isinstance(e, PrefillOverloadedError):  # refused before waiting: the prefill pool would not reach it in time
        return ErrorInfo(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", PrefillOverloadedError.code,
                         "overloaded", msg, e.retry_after_s)
    if isinstance(e, OutOfBlocksError):
        return ErrorInfo(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "out_of_kv_blocks",
                         "overloaded", f"{msg}; retry shortly", 1.0)
    if isinstance(e, ClusterUnavailableError):  # the Ray head is gone or being replaced: refused, nothing done
        return ErrorInfo(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", ClusterUnavailableError.code,
                         "unavailable", msg, e.retry_after_s)
    if isinstance(e, ServerDrainingError | TransferFailedError):
        return ErrorInfo(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", None, "unavailable", msg)
    if isinstance(e, DecodeInterruptedError):  # after tokens were streamed: the client may send it again
        return ErrorInfo(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", DecodeInterruptedError.code,
                         "unavailable", msg)
    if isinstance(e, RequestAbortedError):  # cut short by a drain or a cancel: the client may send it again
        return ErrorInfo(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", RequestAbortedError.code,
                         "unavailable", msg)
    if isinstance(e, RequestTimeoutError):
        return ErrorInfo(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout", None, "timeout", msg)
    if isinstance(e, RequestFailedError):  # its own fault in a worker step; the rest of the batch went on
        return ErrorInfo(grpc.StatusCode.INTERNAL, 500, "server_error", RequestFailedError.code, "error", msg)
    if isinstance(e, DuetError) and is_retryable(e):  # another pair could not serve it either: the pool is healing
        return ErrorInfo(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", None, "unavailable", msg)
    return ErrorInfo(grpc.StatusCode.INTERNAL, 500, "server_error", None, "error", f"internal error: {msg}")
