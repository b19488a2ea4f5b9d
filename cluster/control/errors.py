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
