"""Decode side of the gRPC transport: the ``Push`` handler and the per-request :class:`Receiver`.

``Push`` is client-streaming, one call per request, raw bytes (no generated stubs). Messages: a frame header
(msgpack, see frames.py), then, for a layer frame, its payload split into messages of at most ``chunk_bytes``;
then the next header. The call's single response is a msgpack summary ``{"v", "ok", "error", "reason"}``.
gRPC's flow-control windows pace the sender; the handler thread runs the sink.

With data-plane auth on, a call is admitted only with its lease's proof in the metadata (``duet-kv-request-bin``,
``duet-kv-lease``, ``duet-kv-proof``; :mod:`kv_transfer.auth`), checked before the first message is read: a call
without it ends UNAUTHENTICATED, counted. Each frame is then verified against the lease (MAC, lease id, seq) before
the receiver sees it; a refused frame is counted and dropped. The summary carries a MAC as well.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
import msgpack
import torch

from kv_transfer import auth, frames
from kv_transfer.base import (
    Lease,
    LeaseMismatch,
    PeerUnavailable,
    ProtocolError,
    Sink,
    TransferAborted,
    TransferError,
    Unauthenticated,
)
from kv_transfer.transfer import TERMINAL, BaseReceiver

SERVICE = "duet.kv.v1.KVTransfer"
PUSH = f"/{SERVICE}/Push"
SUMMARY_VERSION = 1
MAX_PAYLOAD_BYTES = 1 << 40
MD_REQUEST, MD_LEASE, MD_PROOF = "duet-kv-request-bin", "duet-kv-lease", "duet-kv-proof"


def call_metadata(secret: auth.ClusterSecret, lease: Lease) -> tuple[tuple[str, str | bytes], ...]:
    """The metadata that admits a Push call for ``lease``."""
    return ((MD_REQUEST, lease.request_id.encode()), (MD_LEASE, lease.lease_id),
            (MD_PROOF, auth.grpc_proof(secret, lease.request_id, lease.lease_id)))


def pack_summary(error: TransferError | None, lease_auth: auth.LeaseAuth | None = None) -> bytes:
    body = {"v": SUMMARY_VERSION, "ok": error is None, "error": None if error is None else type(error).__name__,
            "reason": "" if error is None else str(error)}
    if lease_auth is None:
        return msgpack.packb(body)
    return msgpack.packb({"body": msgpack.packb(body), "mac": lease_auth.seal_bytes(msgpack.packb(body)),
                          "v": SUMMARY_VERSION})


def unpack_summary(data: bytes, lease_auth: auth.LeaseAuth | None = None) -> dict[str, Any]:
    """Parse a Push response; raises :class:`ProtocolError` for garbage or an unknown version, and
    :class:`Unauthenticated` for a summary without its lease's MAC (auth on)."""
    try:
        summary = msgpack.unpackb(data, raw=False)
        if lease_auth is not None and isinstance(summary, dict) and summary.get("v") == SUMMARY_VERSION:
            lease_auth.check_bytes(summary.get("body"), summary.get("mac"))
            summary = msgpack.unpackb(summary["body"], raw=False)
    except Unauthenticated:
        raise
    except Exception as e:
        raise ProtocolError(f"Push response is not msgpack: {e}") from e
    if not isinstance(summary, dict) or summary.get("v") != SUMMARY_VERSION:
        raise ProtocolError(f"Push response version {summary!r} is not supported")
    return summary


class Receiver(BaseReceiver):
    """Decode side of one transfer (see :class:`kv_transfer.base.KVReceiver`), fed by one Push call."""

    def __init__(self, lease: Lease, sink: Sink, *, on_done: Callable[[dict], None] | None,
                 on_terminal: Callable[[Receiver], None], lease_auth: auth.LeaseAuth | None = None) -> None:
        super().__init__(lease, sink, on_done, lease_auth)
        self._forget = on_terminal
        self._context: grpc.ServicerContext | None = None
        self._handler_thread: int | None = None
        self._bind_lock = threading.Lock()

    def bind(self, context: grpc.ServicerContext) -> bool:
        """Attach the call feeding this receiver; False when another call already did."""
        with self._bind_lock:
            if self._context is not None:
                return False
            self._context, self._handler_thread = context, threading.get_ident()
            return True

    def _on_terminal(self, error: TransferError | None, notify_peer: bool) -> None:
        self._forget(self)
        with self._bind_lock:
            context, handler = self._context, self._handler_thread
        # The handler thread reports its own failures in the summary; anything else (abort(), deadline) can only
        # reach the sender by ending the call.
        if error is not None and notify_peer and context is not None and threading.get_ident() != handler:
            context.cancel()


class FrameReader:
    """Push messages -> ``(header, payload | None)`` frames."""

    def __init__(self) -> None:
        self._header: dict[str, Any] | None = None
        self._buf: torch.Tensor | None = None
        self._filled = 0

    def feed(self, message: bytes) -> tuple[dict[str, Any], torch.Tensor | None] | None:
        if self._header is None:
            header = frames.unpack(message)
            nbytes = header.get("nbytes", 0) if header["kind"] in ("layer", "state") else 0
            if not isinstance(nbytes, int) or not 0 <= nbytes <= MAX_PAYLOAD_BYTES:
                raise frames.FrameRejected(f"bad payload size {nbytes!r}", request_id=header.get("request_id"),
                                           to=header.get("to"))
            if nbytes == 0:
                return header, None
            self._header, self._buf, self._filled = header, torch.empty(nbytes, dtype=torch.uint8), 0
            return None
        end = self._filled + len(message)
        if end > self._buf.numel():
            raise ProtocolError(f"payload overruns its header's {self._buf.numel()} bytes")
        self._buf.numpy()[self._filled:end] = memoryview(message)
        self._filled = end
        if end < self._buf.numel():
            return None
        frame = (self._header, self._buf)
        self._header, self._buf = None, None
        return frame


class PushHandler:
    """The Push method: feeds one call's frames to the receiver registered for their request id."""

    def __init__(self, lookup: Callable[[str], Receiver | None], data_auth: auth.DataPlaneAuth) -> None:
        self._lookup, self._auth = lookup, data_auth

    def __call__(self, messages, context: grpc.ServicerContext) -> bytes:
        reader, receiver = FrameReader(), None
        if self._auth.enabled:  # before any message is read
            try:
                receiver, lease_auth = self._admit(context)
            except Unauthenticated as e:
                self._auth.refusals.add(e, f"a gRPC Push call from {context.peer()}")
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{type(e).__name__}: {e}")
            if receiver is None:
                return pack_summary(_not_expected(lease_auth.request_id), lease_auth)
        try:
            for message in messages:
                frame = reader.feed(message)
                if frame is None:
                    continue
                header, payload = frame
                if receiver is None:
                    receiver = self._bind(header.get("request_id"), context)
                    if receiver is None:
                        return pack_summary(_not_expected(header.get("request_id")))
                elif header.get("request_id") != receiver.request_id and not self._auth.enabled:
                    raise ProtocolError(f"a Push call for {receiver.request_id!r} carried a frame for "
                                        f"{header.get('request_id')!r}")
                try:
                    receiver.verify(header, payload)
                except Unauthenticated as e:  # refused: counted and dropped, the transfer goes on
                    self._auth.refusals.add(e, f"a frame of a gRPC Push call from {context.peer()}")
                    continue
                receiver.handle_frame(header, payload)
                if receiver.poll() in TERMINAL:
                    return pack_summary(receiver.failure_exception(), receiver.auth)
            error: TransferError = PeerUnavailable("the Push stream ended before the final frame")
        except frames.FrameRejected as e:
            if self._auth.enabled and receiver is not None:  # unverifiable bytes: refuse the frame, not the transfer
                self._auth.refusals.add(Unauthenticated(f"an undecodable frame: {e}"), "a gRPC Push call")
            receiver = receiver or self._bind(e.request_id, context)
            error = e
        except TransferError as e:
            error = e
        except grpc.RpcError as e:  # the client went away or cancelled
            error = PeerUnavailable(f"the Push stream broke: {e}")
        if receiver is not None:
            receiver._fail(error, notify_peer=False)
            return pack_summary(receiver.failure_exception(), receiver.auth)
        return pack_summary(error)

    def _admit(self, context: grpc.ServicerContext) -> tuple[Receiver | None, auth.LeaseAuth]:
        """The receiver the call's metadata proves a lease for (bound to this call; None when no such transfer is
        live: an authentic late call) and that lease's MAC state for the summary; :class:`Unauthenticated` without
        a valid proof."""
        md = _metadata(context)
        rid, lease_id, proof = md.get(MD_REQUEST), md.get(MD_LEASE), md.get(MD_PROOF)
        if not isinstance(rid, bytes) or not isinstance(lease_id, str) or not isinstance(proof, str):
            raise Unauthenticated("a Push call without lease credentials")
        rid = rid.decode(errors="replace")
        auth.check_grpc_proof(self._auth.secret, rid, lease_id, proof)
        receiver = self._lookup(rid)
        if receiver is not None and receiver.lease.lease_id != lease_id:
            raise LeaseMismatch(f"request {rid!r}: a Push call proved another lease")
        if receiver is not None and receiver.bind(context):
            return receiver, receiver.auth
        return None, auth.LeaseAuth(self._auth.secret, rid, lease_id)

    def _bind(self, request_id: Any, context: grpc.ServicerContext) -> Receiver | None:
        receiver = self._lookup(request_id) if isinstance(request_id, str) else None
        return receiver if receiver is not None and receiver.bind(context) else None


def _metadata(context: grpc.ServicerContext) -> dict[str, str | bytes]:
    return {k: v for k, v in (context.invocation_metadata() or ())}


def _not_expected(rid: Any) -> TransferAborted:
    return TransferAborted(f"no transfer is expected for request {rid!r} (expired, aborted or never leased)")
