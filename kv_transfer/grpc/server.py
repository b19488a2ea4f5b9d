"""Decode side of the gRPC transport: the ``Push`` handler and the per-request :class:`Receiver`.

``Push`` is client-streaming, one call per request, raw bytes (no generated stubs). Messages: a frame header
(msgpack, see frames.py), then, for a layer frame, its payload split into messages of at most ``chunk_bytes``;
then the next header. The call's single response is a msgpack summary ``{"v", "ok", "error", "reason"}``.
gRPC's flow-control windows pace the sender; the handler thread runs the sink.

With data-plane auth on, a call is admitted only with its lease's proof in the metadata (``duet-kv-request-bin``,
``duet-kv-lease``, ``duet-kv-proof``; :mod:`kv_transfer.auth`), checked before the first message is read: a call
without it ends UNAUTHENTICATED, counted. Each frame is then verified against the lease (MAC, lease id, seq) before
the receiver sees it, and before its payload is joined into one buffer; a message or frame that fails is counted and
dropped, and the transfer goes on (a later valid frame still counts). The summary carries a MAC as well.

Nothing is allocated on a header's word: a header naming more payload than its lease can carry
(:attr:`~kv_transfer.transfer.BaseReceiver.max_payload_nbytes`) is refused before any of it is read, with auth on or
off, and a payload is kept in the messages it arrived in until its frame is verified.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
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
PING = f"/{SERVICE}/Ping"
SUMMARY_VERSION = 1
PING_VERSION = 1
PING_MAX_BYTES = 256
PAYLOAD_KINDS = ("layer", "state")
MD_REQUEST, MD_LEASE, MD_PROOF = "duet-kv-request-bin", "duet-kv-lease", "duet-kv-proof"


def pack_ping(nonce: bytes) -> bytes:
    """A ``Ping`` request (and, echoed, its answer): msgpack ``{"v", "nonce"}``."""
    return msgpack.packb({"v": PING_VERSION, "nonce": nonce})


def unpack_ping(data: bytes) -> bytes:
    """The nonce of a ``Ping`` message; :class:`ProtocolError` for anything else."""
    if not isinstance(data, bytes) or len(data) > PING_MAX_BYTES:
        raise ProtocolError("a Ping message is not bytes or longer than it may be")
    try:
        msg = msgpack.unpackb(data)
    except Exception as e:
        raise ProtocolError(f"a Ping message is not msgpack: {e}") from None
    if not isinstance(msg, dict) or msg.get("v") != PING_VERSION:
        raise ProtocolError(f"a Ping message of another version or shape: {msg!r:.80}")
    nonce = msg.get("nonce")
    if not isinstance(nonce, bytes) or not 0 < len(nonce) <= 32:
        raise ProtocolError("a Ping message without a nonce of 1-32 bytes")
    return nonce


def ping_handler(request: bytes, context: grpc.ServicerContext) -> bytes:
    """The ``Ping`` method: echoes the nonce. It proves that a new call's bytes cross the connection both ways (a
    wedged HTTP/2 connection can still answer transport pings); it touches no transfer and needs no lease."""
    try:
        return pack_ping(unpack_ping(request))
    except ProtocolError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


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
    """One Push call's messages -> ``(header, pieces)`` frames: a header message, then (for a layer or state frame)
    its payload in messages of ``"nbytes"`` in all. A header naming more than ``limit`` bytes (the lease's
    :attr:`~kv_transfer.transfer.BaseReceiver.max_payload_nbytes`) is rejected before anything is kept, and the
    payload stays in the messages it came in until the frame is whole: nothing is allocated on a header's word.
    After a rejected message the reader expects a header again."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._header: dict[str, Any] | None = None
        self._pieces: list[bytes] = []
        self._left = 0

    def feed(self, message: bytes) -> tuple[dict[str, Any], list[bytes]] | None:
        """The frame ``message`` completes, or None; :class:`~kv_transfer.frames.FrameRejected` for a message that
        cannot be taken (not a header, a size out of bounds, a payload longer than its header said)."""
        if self._header is None:
            header = frames.parse(message)
            kind = header.get("kind")
            nbytes = header.get("nbytes", 0) if kind in PAYLOAD_KINDS else 0
            if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= self._limit:
                raise frames.FrameRejected(f"a {kind!r} frame names {nbytes!r} payload bytes; its lease carries at "
                                           f"most {self._limit} a frame")
            if nbytes == 0:
                return header, []
            self._header, self._pieces, self._left = header, [], nbytes
            return None
        if len(message) > self._left:
            kind, self._header, self._pieces = self._header.get("kind"), None, []
            raise frames.FrameRejected(f"a {kind!r} frame's payload overruns the size its header named")
        self._pieces.append(message)
        self._left -= len(message)
        if self._left:
            return None
        frame, self._header, self._pieces = (self._header, self._pieces), None, []
        return frame


class PushHandler:
    """The Push method: feeds one call's frames to the receiver registered for their request id."""

    def __init__(self, lookup: Callable[[str], Receiver | None], data_auth: auth.DataPlaneAuth) -> None:
        self._lookup, self._auth = lookup, data_auth

    def __call__(self, messages: Iterable[bytes], context: grpc.ServicerContext) -> bytes:
        stream = iter(messages)
        if self._auth.enabled:  # before any message is read
            try:
                receiver, lease_auth = self._admit(context)
            except Unauthenticated as e:
                self._auth.refusals.add(e, f"a gRPC Push call from {context.peer()}")
                context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{type(e).__name__}: {e}")
            if receiver is None:
                return pack_summary(_not_expected(lease_auth.request_id), lease_auth)
        else:  # the first header names the request
            try:
                first = next(stream, None)
                rid = None if first is None else frames.parse(first).get("request_id")
            except frames.FrameRejected as e:
                return pack_summary(e)
            except grpc.RpcError as e:  # the client went away or cancelled
                return pack_summary(PeerUnavailable(f"the Push stream broke: {e}"))
            receiver = self._bind(rid, context)
            if receiver is None:
                return pack_summary(_not_expected(rid))
            stream = itertools.chain((first,), stream)
        try:
            error = self._serve(stream, receiver, context)
        except TransferError as e:
            error = e
        except grpc.RpcError as e:  # the client went away or cancelled
            error = PeerUnavailable(f"the Push stream broke: {e}")
        if error is not None:
            receiver._fail(error, notify_peer=False)
        return pack_summary(receiver.failure_exception(), receiver.auth)

    def _serve(self, stream: Iterator[bytes], receiver: Receiver,
               context: grpc.ServicerContext) -> TransferError | None:
        """Feed ``receiver`` until it is terminal (None) or the error that ends its transfer. With auth on, a
        message or frame that cannot be verified is refused (counted) and skipped: only that frame, the transfer
        goes on and a later valid frame still counts. An authentic frame that is wrong ends the transfer."""
        reader = FrameReader(receiver.max_payload_nbytes)
        for message in stream:
            try:
                frame = reader.feed(message)
            except frames.FrameRejected as e:
                if not self._auth.enabled:
                    return e
                self._refuse(Unauthenticated(f"request {receiver.request_id!r}: an unverifiable message: {e}"),
                             context)
                continue
            if frame is None:
                continue
            header, pieces = frame
            try:
                receiver.verify(header, pieces)  # the MAC runs over the pieces as they came: nothing allocated yet
            except Unauthenticated as e:
                self._refuse(e, context)
                continue
            header = frames.check(header)
            if not self._auth.enabled and header.get("request_id") != receiver.request_id:
                return ProtocolError(f"a Push call for {receiver.request_id!r} carried a frame for "
                                     f"{header.get('request_id')!r}")
            receiver.handle_frame(header, _joined(pieces))
            if receiver.poll() in TERMINAL:
                return None
        return PeerUnavailable("the Push stream ended before the final frame")

    def _refuse(self, error: Unauthenticated, context: grpc.ServicerContext) -> None:
        self._auth.refusals.add(error, f"a frame of a gRPC Push call from {context.peer()}")

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


def _joined(pieces: list[bytes]) -> torch.Tensor | None:
    """A verified frame's payload as one uint8 tensor (None when it has none)."""
    return torch.frombuffer(bytearray().join(pieces), dtype=torch.uint8) if pieces else None


def _metadata(context: grpc.ServicerContext) -> dict[str, str | bytes]:
    return {k: v for k, v in (context.invocation_metadata() or ())}


def _not_expected(rid: Any) -> TransferAborted:
    return TransferAborted(f"no transfer is expected for request {rid!r} (expired, aborted or never leased)")
