"""The transfer state machine shared by every transport: what a sender and a receiver do with frames.

A transport only moves frames. It gives a :class:`BaseSender` its jobs back to encode (``encode_job``) on a
transport thread, hands incoming frames to ``handle_frame`` on a transport thread, and implements two hooks:
``_post(job)`` (sender: queue a job for the wire) and ``_on_terminal(error, notify_peer)`` (both: leave the
manager's tables; tell the peer when the failure started on this side).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kv_transfer import frames
from kv_transfer.base import (
    KVPoll,
    KVReceiver,
    KVSender,
    Lease,
    MissingLayer,
    ProtocolError,
    Sink,
    TransferAborted,
    TransferError,
    TransferTimeout,
    error_from_name,
)
from kv_transfer.codec import Codec, CodecContext, decode_layer, encode_layer
from kv_transfer.compression import max_layer_payload
from kv_transfer.state_frames import decode_state, encode_state

if TYPE_CHECKING:
    from kv_transfer.auth import LeaseAuth, Payload

log = logging.getLogger(__name__)
TERMINAL = (KVPoll.FAILED, KVPoll.SUCCESS)
START_CHECK_S = 1.0  # how often the deadline watch looks at a start-counted transfer that has not started


class Transfer:
    """Forward-only state with a condition to wait on; the lease deadline is applied by ``poll``/``wait``.

    ``auth`` (None: data-plane auth off) seals this side's frames and verifies the peer's (:mod:`kv_transfer.auth`).
    """

    def __init__(self, lease: Lease, initial: KVPoll, auth: LeaseAuth | None = None) -> None:
        self.lease, self.auth = lease, auth
        self._state = initial
        self._error: TransferError | None = None
        self._started_at: float | None = None  # wall time the first layer / state frame moved
        self._cond = threading.Condition()

    @property
    def request_id(self) -> str:
        return self.lease.request_id

    @property
    def deadline_s(self) -> float:
        """When this transfer fails with :class:`TransferTimeout` (:meth:`Lease.due_s`: it moves once the transfer
        starts, for a lease with ``start_by_s``)."""
        return self.lease.due_s(self._started_at)

    @property
    def next_check_s(self) -> float:
        """When the deadline watch should look at this transfer next: its deadline, or, while a start-counted
        lease has not started, within ``START_CHECK_S`` (its deadline moves when it starts)."""
        if self.lease.start_by_s is not None and self._started_at is None:
            return min(self.deadline_s, time.time() + START_CHECK_S)
        return self.deadline_s

    @property
    def terminal(self) -> bool:
        return self._state in TERMINAL

    def poll(self) -> KVPoll:
        if self._state not in TERMINAL and time.time() >= self.deadline_s:
            self._fail(TransferTimeout(f"request {self.request_id!r}: lease deadline passed while "
                                       f"{self._state.name}"), notify_peer=True)
        return self._state

    def wait(self, timeout_s: float) -> KVPoll:
        end = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            while self._state not in TERMINAL:
                left = min(end - time.monotonic(), self.deadline_s - time.time())
                if left <= 0:
                    break
                self._cond.wait(left)
        return self.poll()

    def failure_exception(self) -> TransferError | None:
        return self._error

    def seal(self, header: dict[str, Any], payload: torch.Tensor | None = None) -> dict[str, Any]:
        """Transport thread, in transmit order: ``header`` ready for the wire (bound to the lease when auth is on)."""
        return header if self.auth is None else self.auth.seal(header, payload)

    def verify(self, header: dict[str, Any], payload: Payload) -> None:
        """Transport thread, before ``handle_frame``: raise :class:`~kv_transfer.base.Unauthenticated` (or a subclass)
        for a frame that is not the peer's next one for this lease; ``payload`` may still be its messages (bytes)."""
        if self.auth is not None:
            self.auth.verify(header, payload)

    def abort(self, reason: str = "aborted") -> None:
        self._fail(TransferAborted(f"request {self.request_id!r}: {reason}"), notify_peer=True)

    def _start_clock(self) -> None:
        """The transfer started (a start-counted lease's deadline is ``transfer_s`` from now): the receiver's first
        layer or state frame, or the sender's first one handed over by its caller -- not the first one on the wire,
        so a link that stalls before any byte moves still ends the transfer on time."""
        with self._cond:
            if self._started_at is None:
                self._started_at = time.time()

    def _advance(self, state: KVPoll) -> bool:
        with self._cond:
            if self._state in TERMINAL or state <= self._state:
                return False
            self._state = state
            if state is KVPoll.TRANSFERRING and self._started_at is None:
                self._started_at = time.time()
            self._cond.notify_all()
        if state is KVPoll.SUCCESS:
            self._on_terminal(None, False)
        return True

    def _fail(self, error: TransferError, *, notify_peer: bool) -> bool:
        """FAILED with ``error`` unless already terminal; ``notify_peer`` when the failure started on this side."""
        with self._cond:
            if self._state in TERMINAL:
                return False
            self._state, self._error = KVPoll.FAILED, error
            self._cond.notify_all()
        self._on_terminal(error, notify_peer)
        return True

    def _on_terminal(self, error: TransferError | None, notify_peer: bool) -> None:
        """Transport hook, called once, outside the state lock."""


@dataclass
class LayerJob:
    sender: BaseSender
    layer: int
    k: torch.Tensor
    v: torch.Tensor
    ctx: CodecContext | None = None  # the sender's own copy (CodecContext.detached)
    ready: Any = None  # torch.cuda.Event recorded after the copy, when the tensors are on a GPU


@dataclass
class StateJob:
    sender: BaseSender
    index: int
    tensors: dict[str, torch.Tensor]  # the sender's own copies


@dataclass
class FinishJob:
    sender: BaseSender
    meta: dict[str, Any]


@dataclass
class ControlJob:
    """A control frame (open / abort / done) of one transfer, sealed when its link transmits it."""

    transfer: Transfer
    header: dict[str, Any]


class BaseSender(Transfer, KVSender):
    """See :class:`KVSender`. ``payload_device``: where payloads must be for the wire (None: where k/v are)."""

    def __init__(self, lease: Lease, *, codec: Codec, payload_device: torch.device | None = None,
                 auth: LeaseAuth | None = None) -> None:
        super().__init__(lease, KVPoll.BOOTSTRAPPING, auth)
        self._codec, self._payload_device = codec, payload_device
        self._sent = bytearray(lease.layout.num_layers)
        self._state_sent = bytearray(0 if lease.state is None else lease.state.num_frames)
        self._finished = self._finish_encoded = False
        self._lock = threading.Lock()

    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, ctx: CodecContext | None = None) -> None:
        layout = self.lease.layout
        shape = layout.block_shape(self.lease.num_blocks)
        if not 0 <= layer < layout.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {layout.num_layers})")
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != shape or t.dtype != layout.torch_dtype:
                raise ValueError(f"{name} is {tuple(t.shape)} {t.dtype}; the lease needs {shape} {layout.torch_dtype}")
        if ctx is not None:
            ctx.check(shape)
        with self._lock:
            if self._finished:
                raise ValueError(f"request {self.request_id!r}: send_layer after finish")
            if self._sent[layer]:
                raise ValueError(f"request {self.request_id!r}: layer {layer} sent twice")
            self._sent[layer] = 1
        self._start_clock()
        if self._state is KVPoll.FAILED:
            return
        job = LayerJob(self, layer, k.detach().clone(), v.detach().clone(), None if ctx is None else ctx.detached())
        if job.k.is_cuda:
            job.ready = torch.cuda.Event()
            job.ready.record()
        self._post(job)

    def send_state(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        state = self.lease.state
        if state is None:
            raise ValueError(f"request {self.request_id!r}: the lease expects no state frames")
        copies = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
        encode_state(self.request_id, index, copies, state)  # validates names, shapes, dtypes, index
        with self._lock:
            if self._finished:
                raise ValueError(f"request {self.request_id!r}: send_state after finish")
            if self._state_sent[index]:
                raise ValueError(f"request {self.request_id!r}: state frame {index} sent twice")
            self._state_sent[index] = 1
        self._start_clock()
        if self._state is not KVPoll.FAILED:
            self._post(StateJob(self, index, copies))

    def finish(self, meta: dict[str, Any]) -> None:
        frames.check_meta(meta)
        with self._lock:
            if self._finished:
                raise ValueError(f"request {self.request_id!r}: finish called twice")
            self._finished = True
        if self._state is not KVPoll.FAILED:
            self._post(FinishJob(self, meta))

    def encode_job(self, job: LayerJob | StateJob | FinishJob) -> tuple[dict[str, Any], torch.Tensor | None] | None:
        """Transport thread: the frame for ``job``, or None when this transfer failed (drop it)."""
        if self._state is KVPoll.FAILED:
            return None
        if isinstance(job, FinishJob):
            self._finish_encoded = True
            return self.seal(frames.finish_frame(self.request_id, job.meta)), None
        if isinstance(job, StateJob):
            assert self.lease.state is not None
            fields, payload = encode_state(self.request_id, job.index, job.tensors, self.lease.state)
            header = frames.state_frame(fields)
            if self.tamper is not None:
                self.tamper(header, payload)
            header = self.seal(header, payload)
            self._advance(KVPoll.TRANSFERRING)
            return header, payload
        if job.ready is not None:
            job.ready.synchronize()
        codec_header, payload = encode_layer(self.request_id, job.layer, job.k, job.v, self._codec, job.ctx,
                                             payload_device=self._payload_device)
        header = frames.layer_frame(codec_header)
        if self.tamper is not None:
            self.tamper(header, payload)
        header = self.seal(header, payload)  # after tamper: a test's corruption is the sender's, not the wire's
        self._advance(KVPoll.TRANSFERRING)
        return header, payload

    def handle_frame(self, header: dict[str, Any]) -> None:
        """Transport thread: a frame from the receiver (``done`` or ``abort``)."""
        kind = header["kind"]
        if kind == "done" and self._finish_encoded:
            self._advance(KVPoll.SUCCESS)
        elif kind == "abort":
            self._fail(error_from_name(header.get("error"), f"receiver side: {header.get('reason')}"),
                       notify_peer=False)
        else:
            self._fail(ProtocolError(f"request {self.request_id!r}: unexpected {kind!r} frame"), notify_peer=True)

    def _post(self, job: LayerJob | StateJob | FinishJob) -> None:
        raise NotImplementedError


class BaseReceiver(Transfer, KVReceiver):
    """See :class:`KVReceiver`. The sink lock makes ``abort()`` wait for a running sink call, so that no sink
    call happens after a failure is visible (the decode side may free the blocks right then)."""

    def __init__(self, lease: Lease, sink: Sink, on_done: Callable[[dict], None] | None = None,
                 auth: LeaseAuth | None = None) -> None:
        super().__init__(lease, KVPoll.WAITING, auth)
        self._sink, self._on_done = sink, on_done
        self._sink_lock = threading.RLock()
        self._arrived = bytearray(lease.layout.num_layers)
        self._state_arrived = bytearray(0 if lease.state is None else lease.state.num_frames)
        self.wire_bytes = 0  # payload bytes of the verified layers (what travelled, after compression)
        self.state_bytes = 0  # payload bytes of the verified state frames (raw)
        self.decode_device: torch.device | None = None  # decode payloads here (the pool's device), after checksums
        self._meta: dict[str, Any] | None = None

    @property
    def meta(self) -> dict[str, Any] | None:
        return self._meta

    @property
    def max_payload_nbytes(self) -> int:
        """Most payload bytes one frame of this lease can carry (any codec's layer, or a state frame), unverified."""
        layers = max_layer_payload(self.lease.layout, self.lease.num_blocks)
        return layers if self.lease.state is None else max(layers, self.lease.state.frame_nbytes)

    def _fail(self, error: TransferError, *, notify_peer: bool) -> bool:
        with self._sink_lock:
            return super()._fail(error, notify_peer=notify_peer)

    def handle_frame(self, header: dict[str, Any], payload: torch.Tensor | None) -> None:
        """Transport thread: a frame from the sender. Never raises; failures end the transfer."""
        kind = header["kind"]
        if kind == "layer":
            self._on_layer(header, payload)
        elif kind == "state":
            self._on_state(header, payload)
        elif kind == "finish":
            self._on_finish(header)
        elif kind == "abort":
            self._fail(error_from_name(header.get("error"), f"sender side: {header.get('reason')}"),
                       notify_peer=False)
        elif kind != "open":
            self._fail(ProtocolError(f"request {self.request_id!r}: unexpected {kind!r} frame"), notify_peer=True)

    def _on_layer(self, header: dict[str, Any], payload: torch.Tensor | None) -> None:
        with self._sink_lock:
            if self._state in TERMINAL:
                return
            layer = header.get("layer")
            try:
                if not isinstance(layer, int) or not 0 <= layer < len(self._arrived):
                    raise ProtocolError(f"layer {layer!r} out of range")
                if header.get("first_block") != 0 or header.get("num_blocks") != self.lease.num_blocks:
                    raise ProtocolError(f"frame covers blocks {header.get('first_block')}+{header.get('num_blocks')}"
                                        f"; the lease has {self.lease.num_blocks}")
                if self._arrived[layer]:
                    raise ProtocolError(f"layer {layer} arrived twice")
                k, v, dropped = decode_layer(header, payload, self.lease.layout, device=self.decode_device)
                self.wire_bytes += 0 if payload is None else payload.numel()
            except TransferError as e:
                self._fail(e, notify_peer=True)
                return
            self._advance(KVPoll.TRANSFERRING)
            try:
                if dropped is None:
                    self._sink(layer, k, v)
                else:
                    self._sink(layer, k, v, dropped=dropped)
            except Exception as e:  # the sink is caller code: any failure ends this transfer only
                log.exception("sink failed for request %r layer %d", self.request_id, layer)
                self._fail(TransferError(f"sink raised {e!r}"), notify_peer=True)
                return
            self._arrived[layer] = 1

    def _on_state(self, header: dict[str, Any], payload: torch.Tensor | None) -> None:
        with self._sink_lock:
            if self._state in TERMINAL:
                return
            index = header.get("index")
            try:
                if self.lease.state is None or not isinstance(index, int) or not 0 <= index < len(self._state_arrived):
                    raise ProtocolError(f"state frame {index!r} out of range for the lease")
                if self._state_arrived[index]:
                    raise ProtocolError(f"state frame {index} arrived twice")
                if self.state_sink is None:
                    raise ProtocolError("state frame for a receiver without a state sink")
                tensors = decode_state(header, payload, self.lease.state, device=self.decode_device)
            except TransferError as e:
                self._fail(e, notify_peer=True)
                return
            self._advance(KVPoll.TRANSFERRING)
            try:
                self.state_sink(index, tensors)
            except Exception as e:
                log.exception("state sink failed for request %r frame %d", self.request_id, index)
                self._fail(TransferError(f"state sink raised {e!r}"), notify_peer=True)
                return
            self.state_bytes += payload.numel()
            self._state_arrived[index] = 1

    def _on_finish(self, header: dict[str, Any]) -> None:
        with self._sink_lock:
            if self._state in TERMINAL:
                return
            missing = [i for i, got in enumerate(self._arrived) if not got]
            missing_state = [i for i, got in enumerate(self._state_arrived) if not got]
            if missing or missing_state:
                self._fail(MissingLayer(f"request {self.request_id!r}: finish arrived without layer(s) {missing}"
                                        f" / state frame(s) {missing_state}"), notify_peer=True)
                return
            self._meta = header.get("meta") or {}
            if not self._advance(KVPoll.SUCCESS):
                return
        if self._on_done is not None:
            try:
                self._on_done(self._meta)
            except Exception:
                log.exception("on_done failed for request %r", self.request_id)
