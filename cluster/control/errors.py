"""The control plane's typed errors (registered codes: :mod:`engine.errors`); :mod:`cluster.serve.errors` maps them
to gRPC / HTTP statuses. :class:`AttemptFailed` is internal: one attempt's failure, which the retry loop turns into
a retry or one of the typed errors."""

from __future__ import annotations

from engine.errors import DuetError


class TransferFailedError(DuetError):
    """The request's KV could not be moved to a decode worker, even after a retry."""

    code = "transfer_failed"


class RequestTimeoutError(DuetError):
    """The request did not finish before its deadline."""

    code = "request_timeout"


class PrefillOverloadedError(DuetError):
    """Refused before waiting for prefill room: the prefill pool's queued work (admitted and waiting at the
    front-end) would bring the request's first token after its deadline
    (:meth:`~cluster.control.admission.PrefillAdmission.check_reachable`). Nothing was reserved or charged. Not
    ``retryable`` by the cluster -- another pair draws on the same pool -- but the client may send it again after
    ``retry_after_s`` seconds (the projected wait beyond what the request could wait; 1 s when rebuilt from the wire,
    which carries only the message)."""

    code = "prefill_overloaded"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DecodeInterruptedError(DuetError):
    """The request failed on its decode worker (it died, or its step or expert-parallel group failed) after tokens
    had been streamed to the caller. The cluster does not retry it itself -- a retry would send those tokens again --
    but the same request may succeed if the caller sends it again (``retryable``)."""

    code = "decode_interrupted"
    retryable = True


class ClusterUnavailableError(DuetError):
    """The front-end cannot reach its workers' Ray cluster: the Ray head (GCS) does not answer, or the front-end is
    starting fresh workers after the head came back as a new cluster (:mod:`cluster.serve.head_watch`). Refused at
    once, nothing reserved; the client may send it again after ``retry_after_s`` seconds."""

    code = "cluster_unavailable"
    retryable = True

    def __init__(self, message: str, *, retry_after_s: float = 2.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AttemptFailed(Exception):
    """One attempt of a request failed on its (prefill, decode) pair in a way another pair may avoid: a worker died,
    the transfer failed, or a call raised a retryable typed error. Raised by the attempt
    (:meth:`DisaggCluster._attempt <cluster.control.disagg.DisaggCluster._attempt>`) and caught by its retry loop;
    never reaches a client. ``error``: the typed error the client gets when no retry succeeds either (None: a
    :class:`TransferFailedError`)."""

    def __init__(self, reason: str, *, prefill_worker: str, decode_worker: str, error: DuetError | None = None) -> None:
        super().__init__(reason)
        self.reason, self.prefill_worker, self.decode_worker, self.error = reason, prefill_worker, decode_worker, error
