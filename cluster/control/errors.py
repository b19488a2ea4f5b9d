"""The control plane's typed errors (registered codes: :mod:`engine.errors`); :mod:`cluster.serve.errors` maps them
to gRPC / HTTP statuses."""

from __future__ import annotations

from engine.errors import DuetError


class TransferFailedError(DuetError):
    """The request's KV could not be moved to a decode worker, even after a retry."""

    code = "transfer_failed"


class RequestTimeoutError(DuetError):
    """The request did not finish before its deadline."""

    code = "request_timeout"


class DecodeInterruptedError(DuetError):
    """The request failed on its decode worker (it died, or its step or expert-parallel group failed) after tokens
    had been streamed to the caller. The cluster does not retry it itself -- a retry would send those tokens again --
    but the same request may succeed if the caller sends it again (``retryable``)."""

    code = "decode_interrupted"
    retryable = True
