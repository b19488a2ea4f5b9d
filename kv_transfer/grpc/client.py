"""Prefill side of the gRPC transport: one client-streaming ``Push`` call per request.

The call's request iterator runs on a gRPC thread: it pulls jobs from the sender's queue, encodes them (codec and
checksums off the caller's thread) and yields a header message plus payload chunks. The call deadline is the lease
deadline. The outcome is the server's summary (or the call's status when it broke).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterator

import grpc
import torch

from kv_transfer import frames
from kv_transfer.base import (
    KVPoll,
    Lease,
    PeerUnavailable,
    ProtocolError,
    TransferAborted,
    TransferError,
    TransferTimeout,
    Unauthenticated,
    error_from_name,
)
from kv_transfer.auth import ClusterSecret, LeaseAuth
from kv_transfer.codec import Codec
from kv_transfer.grpc.server import call_metadata, unpack_summary
from kv_transfer.transfer import TERMINAL, BaseSender, FinishJob, LayerJob

log = logging.getLogger(__name__)
_ABORT = object()


def status_error(e: BaseException) -> TransferError:
    """The transfer error for a broken call (a ``grpc.Call`` carries the status code)."""
    code = e.code() if isinstance(e, grpc.Call) else None
    detail = f"Push call ended with {code}: {e.details() if isinstance(e, grpc.Call) else e!r}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TransferTimeout(detail)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(f"the decode side refused the Push call ({detail})")
    if code == grpc.StatusCode.CANCELLED:
        return TransferAborted(f"the decode side cancelled the transfer ({detail})")
    return PeerUnavailable(detail)


class Sender(BaseSender):
    """Prefill side of one transfer (see :class:`kv_transfer.base.KVSender`)."""

    def __init__(self, lease: Lease, *, push: grpc.StreamUnaryMultiCallable, codec: Codec, chunk_bytes: int,
                 on_terminal: Callable[[Sender], None], secret: ClusterSecret | None = None,
                 on_call_end: Callable[[float, bool | None], None] | None = None) -> None:
        super().__init__(lease, codec=codec, payload_device=torch.device("cpu"),
                         auth=None if secret is None else LeaseAuth(secret, lease.request_id, lease.lease_id))
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._chunk_bytes, self._forget, self._on_call_end = chunk_bytes, on_terminal, on_call_end
        self._call_started = time.monotonic()
        self.call: grpc.Future | None = None
        timeout = lease.latest_s - time.time()
        if timeout <= 0:
            self.poll()  # fails with TransferTimeout
            return
        metadata = None if secret is None else call_metadata(secret, lease)
        self.call = push.future(self._messages(), timeout=timeout, metadata=metadata)
        self._advance(KVPoll.WAITING)
        self.call.add_done_callback(self._on_call_done)

    def _post(self, job: LayerJob | FinishJob) -> None:
        self._jobs.put(job)

    def _on_terminal(self, error: TransferError | None, notify_peer: bool) -> None:
        self._forget(self)
        if error is not None and notify_peer:
            self._jobs.put(_ABORT)

    def _messages(self) -> Iterator[bytes]:
        yield frames.pack(self.seal(frames.open_frame(self.request_id)))
        while True:
            try:
                job = self._jobs.get(timeout=0.1)
            except queue.Empty:
                if self._state in TERMINAL:
                    return
                continue
            if job is _ABORT:
                yield frames.pack(self.seal(frames.abort_frame(self.request_id, frames.TO_RECEIVER, self._error)))
                return
            try:
                frame = self.encode_job(job)
            except Exception as e:
                log.exception("encoding a frame of request %r failed", self.request_id)
                self._fail(TransferError(f"encoding failed: {e!r}"), notify_peer=True)
                continue
            if frame is None:
                continue
            header, payload = frame
            yield frames.pack(header)
            if payload is not None:
                view = memoryview(payload.numpy())
                for start in range(0, len(view), self._chunk_bytes):
                    yield bytes(view[start:start + self._chunk_bytes])
            if isinstance(job, FinishJob):
                return

    def _on_call_done(self, call: grpc.Future) -> None:
        cancelled = call.cancelled()
        error = None if cancelled else call.exception()
        if self._on_call_end is not None:
            # True: the decode side's summary came back. False: any other end (deadline, the decode side cancelling
            # at the lease deadline, a broken stream) proves nothing about the link: the manager probes it. None:
            # this side cancelled the call.
            self._on_call_end(self._call_started, None if cancelled else error is None)
        if cancelled or error is not None:
            if time.time() >= self.deadline_s:  # the decode side ended the call because the lease ran out
                self._fail(TransferTimeout(f"request {self.request_id!r}: lease deadline passed (the Push call "
                                           "ended)"), notify_peer=False)
            elif cancelled:
                self._fail(TransferAborted(f"request {self.request_id!r}: Push call cancelled"), notify_peer=False)
            else:
                self._fail(status_error(error), notify_peer=False)
            return
        try:
            summary = unpack_summary(call.result(), self.auth)
        except ProtocolError as e:
            self._fail(e, notify_peer=False)
            return
        if summary["ok"]:
            self._advance(KVPoll.SUCCESS)  # the server says ok only after the finish frame
        else:
            self._fail(error_from_name(summary.get("error"), f"receiver side: {summary.get('reason')}"),
                       notify_peer=False)
