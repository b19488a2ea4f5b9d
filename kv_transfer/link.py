"""Links: bidirectional frame channels between two managers, used by the inproc and gloo transports.

A link has an :class:`Outbox` (control frames first, then layer/finish jobs in FIFO order) drained by ONE send
thread, which encodes each job (codec + checksums) and transmits it, or a ``ping`` when idle. Incoming frames
reach :meth:`Link.on_frame` from the transport's receive path and are routed by the manager's
:class:`FrameRouter` (a :class:`~kv_transfer.routing.Dispatcher`) to the sender or receiver of their request.
Transfers using a link are its *members*: when the link dies they all end FAILED with :class:`PeerUnavailable`.
With data-plane auth on, the link's own frames (``ping``, ``bye``) are sealed and verified with its
:class:`~kv_transfer.auth.LinkAuth`: one that fails is refused (counted by the router) and changes nothing -- a
forged ``bye`` neither closes the link nor fails its members.

Link states: CONNECTING -> UP -> CLOSING (bye sent or received) -> CLOSED.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from enum import IntEnum
from typing import Any, Protocol

import torch

from kv_transfer import frames
from kv_transfer.auth import LinkAuth
from kv_transfer.base import KVPoll, PeerUnavailable, TransferError, Unauthenticated
from kv_transfer.transfer import BaseSender, ControlJob, FinishJob, LayerJob, Transfer

log = logging.getLogger(__name__)
# a dict: a header for the wire as it is -- a link frame (ping / bye; sealed at transmit), or a request frame the
# router answered with (sealed by the router when auth is on)
Item = dict[str, Any] | ControlJob | LayerJob | FinishJob
LINK_FRAME_MAX_BYTES = 128  # a sealed ping / bye packs to about 60 bytes; request frames are routed unparsed


class FrameRouter(Protocol):
    """What a link hands its request frames to (a manager's :class:`~kv_transfer.routing.Dispatcher`)."""

    def route(self, header_bytes: bytes, payload: torch.Tensor | None, link: Link) -> None:
        """Receive path: deliver one request frame that came on ``link`` (never raises for a bad frame)."""

    def refuse(self, error: Unauthenticated, where: str) -> None:
        """Receive path: count and log a frame refused before it was routed (a link frame that failed its MAC)."""


class LinkState(IntEnum):
    CONNECTING = 0
    UP = 1
    CLOSING = 2
    CLOSED = 3


class Outbox:
    """Items waiting for a link's send thread: control headers jump ahead of data jobs."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._control: deque[dict[str, Any] | ControlJob] = deque()
        self._data: deque[LayerJob | FinishJob] = deque()
        self._closed = False

    def put(self, item: Item, *, last: bool = False) -> bool:
        """Queue ``item``; ``last`` closes the outbox behind it. False when already closed."""
        with self._cond:
            if self._closed:
                return False
            (self._control if isinstance(item, dict | ControlJob) else self._data).append(item)
            self._closed = last
            self._cond.notify()
            return True

    def get(self, timeout_s: float) -> Item | None:
        """The next item, or None after ``timeout_s`` idle or once closed and drained of control frames."""
        with self._cond:
            if not (self._control or self._data or self._closed):
                self._cond.wait(timeout_s)
            if self._control:
                return self._control.popleft()
            if self._data and not self._closed:
                return self._data.popleft()
            return None

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


class Link:
    """Base of a transport link. Subclasses implement ``_connect()`` (bounded) and ``_transmit(header, payload)``
    and call :meth:`on_frame` for each incoming frame and :meth:`die` when their receive path breaks. ``auth``
    (None: data-plane auth off) seals this end's ping / bye and verifies the peer's."""

    def __init__(self, *, dispatcher: FrameRouter, keepalive_s: float, name: str,
                 auth: LinkAuth | None = None) -> None:
        self.dispatcher, self.keepalive_s, self.name, self.auth = dispatcher, keepalive_s, name, auth
        self.state = LinkState.CONNECTING
        self.outbox = Outbox()
        self._members: set[Transfer] = set()
        self._lock = threading.Lock()
        self._send_thread = threading.Thread(target=self._run, name=f"kv-send-{name}", daemon=True)

    @classmethod
    def unreachable(cls, dispatcher: FrameRouter, name: str) -> Link:
        """A link that is already CLOSED: transfers given it fail at once with PeerUnavailable."""
        link = cls.__new__(cls)
        Link.__init__(link, dispatcher=dispatcher, keepalive_s=1.0, name=name)
        link.state = LinkState.CLOSED
        link.outbox.close()
        return link

    def start(self) -> None:
        self._send_thread.start()

    def attach(self, t: Transfer) -> bool:
        """Make ``t`` a member; senders move to WAITING once the link is up. False when the link is closing."""
        with self._lock:
            if self.state >= LinkState.CLOSING:
                return False
            self._members.add(t)
            up = self.state is LinkState.UP
        if up and isinstance(t, BaseSender):
            t._advance(KVPoll.WAITING)
        return True

    def detach(self, t: Transfer) -> None:
        with self._lock:
            self._members.discard(t)

    def post(self, item: Item) -> bool:
        return self.outbox.put(item)

    def close(self, timeout_s: float = 2.0) -> None:
        """Orderly close: send ``bye`` after the queued control frames; wait (bounded) for the peer's ``bye``."""
        self._begin_close()
        if self._send_thread.is_alive():
            self._send_thread.join(timeout_s)
        self._join_receive(timeout_s)
        self.die(PeerUnavailable(f"link {self.name} closed"))

    def die(self, error: TransferError) -> None:
        """Mark the link CLOSED and fail every member with ``error``. Idempotent."""
        with self._lock:
            if self.state is LinkState.CLOSED:
                return
            self.state = LinkState.CLOSED
            members, self._members = list(self._members), set()
        self.outbox.close()
        for t in members:
            t._fail(error, notify_peer=False)
        self._on_closed()

    def on_frame(self, header_bytes: bytes, payload: torch.Tensor | None) -> bool:
        """Receive path: handle one frame. Returns False when the peer said ``bye`` (stop receiving)."""
        header = _peek_link_frame(header_bytes)
        if header is None:
            self.dispatcher.route(header_bytes, payload, self)
            return True
        if self.auth is not None:
            try:
                self.auth.verify(header, payload)
            except Unauthenticated as e:  # refused: the link and its members go on
                self.dispatcher.refuse(e, f"link {self.name}")
                return True
        if header["kind"] == "bye":
            self._fail_members(PeerUnavailable(f"peer closed link {self.name}"))
            self._begin_close()
            return False
        return True

    # -- subclass hooks ------------------------------------------------------------------------------------------
    def _connect(self) -> None:
        """Bounded set-up of the channel; raise PeerUnavailable on failure."""

    def _transmit(self, header: bytes, payload: torch.Tensor | None) -> None:
        raise NotImplementedError

    def _join_receive(self, timeout_s: float) -> None:
        """Wait (bounded) for the receive path to stop after ``bye``."""

    def _on_closed(self) -> None:
        """Called once when the link is CLOSED (drop it from the manager's tables)."""

    # -- internals -----------------------------------------------------------------------------------------------
    def _begin_close(self) -> None:
        with self._lock:
            if self.state >= LinkState.CLOSING:
                return
            self.state = LinkState.CLOSING
        self.outbox.put(frames.link_frame("bye"), last=True)

    def _fail_members(self, error: TransferError) -> None:
        with self._lock:
            members, self._members = list(self._members), set()
        for t in members:
            t._fail(error, notify_peer=False)

    def _run(self) -> None:
        try:
            self._connect()
        except Exception as e:  # noqa: BLE001 - any set-up failure ends the link; its members see PeerUnavailable
            self.die(e if isinstance(e, TransferError) else PeerUnavailable(f"link {self.name}: connect failed: {e}"))
            return
        with self._lock:
            if self.state is LinkState.CONNECTING:
                self.state = LinkState.UP
            senders = [t for t in self._members if isinstance(t, BaseSender)]
        for s in senders:
            s._advance(KVPoll.WAITING)
        try:
            self._send_loop()
        except Exception as e:  # noqa: BLE001 - a thread boundary: any wire error ends the link, never the process
            log.log(logging.DEBUG if self.state >= LinkState.CLOSING else logging.WARNING,
                    "link %s: send failed: %s", self.name, e)
            self.die(PeerUnavailable(f"link {self.name}: send failed: {e}"))

    def _send_loop(self) -> None:
        while True:
            item = self.outbox.get(self.keepalive_s)
            if item is None:
                if self.outbox.closed:
                    return
                item = frames.link_frame("ping")
            frame = self._encode(item)
            if frame is None:
                continue
            header, payload = frame
            self._transmit(frames.pack(header), payload)
            if header["kind"] == "bye":
                return

    def _encode(self, item: Item) -> tuple[dict[str, Any], torch.Tensor | None] | None:
        if isinstance(item, dict):
            if self.auth is not None and item.get("kind") in frames.LINK_KINDS:
                item = self.auth.seal(item, None)
            return item, None
        if isinstance(item, ControlJob):
            return item.transfer.seal(item.header), None
        try:
            return item.sender.encode_job(item)
        except Exception as e:  # a bad job fails its own transfer, not the link
            log.exception("encoding a frame of request %r failed", item.sender.request_id)
            item.sender._fail(TransferError(f"encoding failed: {e!r}"), notify_peer=True)
            return None


def _peek_link_frame(header_bytes: bytes) -> dict[str, Any] | None:
    """The header of a link frame (``ping`` / ``bye``, not yet verified); None for a request frame."""
    if len(header_bytes) > LINK_FRAME_MAX_BYTES:  # link frames are tiny; request frames skip this second parse
        return None
    try:
        header = frames.unpack(header_bytes)
    except frames.FrameRejected:
        return None
    return header if header.get("kind") in frames.LINK_KINDS and "request_id" not in header else None
