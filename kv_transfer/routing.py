"""Routing for link transports: a manager's live transfers by request id, and the link-bound sender/receiver.

Frames addressed ``to: receiver`` go to the receiver registered by ``expect()`` (an ``open`` for an unknown request
is answered with an abort, so the sender fails at once); frames ``to: sender`` go to the local sender. A receiver
answers (``done`` / ``abort``) over the link its sender's first frame came on.

With data-plane auth on, a frame is verified against its transfer's lease (MAC, lease id, seq) before anything
else reads it -- before the version check, the link binding and the sink; a refused frame is counted, logged and
dropped, and the transfer it named goes on. A frame for no live transfer is verified with the key its own
``request_id`` and ``lease`` derive; only an authentic ``open`` is answered (with a sealed abort).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from kv_transfer import frames
from kv_transfer.auth import DataPlaneAuth, LeaseAuth
from kv_transfer.base import (
    Lease,
    PeerUnavailable,
    Sink,
    TransferAborted,
    TransferError,
    Unauthenticated,
)
from kv_transfer.codec import Codec
from kv_transfer.link import Link
from kv_transfer.transfer import BaseReceiver, BaseSender, ControlJob, FinishJob, LayerJob, Transfer

log = logging.getLogger(__name__)


class Dispatcher:
    """A manager's live link transfers by request id; routes incoming frames to them."""

    def __init__(self, auth: DataPlaneAuth | None = None) -> None:
        self.auth = auth or DataPlaneAuth(None)
        self._lock = threading.Lock()
        self._tables: dict[str, dict[str, Transfer]] = {frames.TO_SENDER: {}, frames.TO_RECEIVER: {}}
        self._largest_payload = 0  # the most any lease expected here so far allows one frame (max_payload_bytes)

    def add(self, t: LinkSender | LinkReceiver) -> None:
        table = self._tables[frames.TO_SENDER if isinstance(t, BaseSender) else frames.TO_RECEIVER]
        with self._lock:
            if t.request_id in table:
                raise ValueError(f"a live transfer for request {t.request_id!r} already exists here")
            table[t.request_id] = t
            if not isinstance(t, BaseSender):
                self._largest_payload = max(self._largest_payload, t.lease.max_payload_bytes)

    @property
    def max_payload_bytes(self) -> int:
        """The largest payload a frame arriving here may announce: the largest :attr:`Lease.max_payload_bytes` of
        any receiver registered so far (never lowered: frames of an aborted transfer may still be on the wire). 0 on
        a side that has expected nothing (a prefill worker receives no payloads). A link that reads a larger size
        from its peer stops before allocating it."""
        return self._largest_payload

    def remove(self, t: Transfer) -> None:
        table = self._tables[frames.TO_SENDER if isinstance(t, BaseSender) else frames.TO_RECEIVER]
        with self._lock:
            if table.get(t.request_id) is t:
                del table[t.request_id]

    def live(self) -> list[Transfer]:
        with self._lock:
            return [t for table in self._tables.values() for t in table.values()]

    def refuse(self, error: Unauthenticated, where: str) -> None:
        self.auth.refusals.add(error, where)

    def route(self, header_bytes: bytes, payload: torch.Tensor | None, link: Link) -> None:
        try:
            header = frames.parse(header_bytes)
        except frames.FrameRejected as e:
            if self.auth.enabled:
                self.auth.refusals.add(Unauthenticated(f"an undecodable frame: {e}"), f"link {link.name}")
            else:
                log.warning("link %s: dropped a frame: %s", link.name, e)
            return
        to, rid = header.get("to"), header.get("request_id")
        t = self._lookup(to, rid)
        if self.auth.enabled:
            try:
                if t is None:
                    self._unknown(header, payload, link)
                    return
                t.verify(header, payload)
            except Unauthenticated as e:
                self.auth.refusals.add(e, f"link {link.name}")
                return
        try:
            header = frames.check(header)
        except frames.FrameRejected as e:
            if t is None:
                log.warning("link %s: dropped a frame: %s", link.name, e)
                return
            if isinstance(t, LinkReceiver):
                t.bind(link)
            t._fail(e, notify_peer=True)
            return
        if isinstance(t, LinkReceiver):
            t.bind(link)
            t.handle_frame(header, payload)
        elif isinstance(t, LinkSender):
            t.handle_frame(header)
        elif to == frames.TO_RECEIVER and header["kind"] == "open":
            link.post(frames.abort_frame(str(rid), frames.TO_SENDER, _not_expected(rid)))

    def _unknown(self, header: dict, payload: torch.Tensor | None, link: Link) -> None:
        """A frame for no live transfer, auth on: verify it with its own lease's key; answer an authentic open."""
        rid, lease_id = header.get("request_id"), header.get("lease")
        if not isinstance(rid, str) or not isinstance(lease_id, str):
            raise Unauthenticated(f"a {header.get('kind')!r} frame names no request and lease")
        auth = LeaseAuth(self.auth.secret, rid, lease_id)
        auth.verify(header, payload)
        if header.get("to") == frames.TO_RECEIVER and header.get("kind") == "open":
            link.post(auth.seal(frames.abort_frame(rid, frames.TO_SENDER, _not_expected(rid)), None))

    def _lookup(self, to: Any, rid: Any) -> Transfer | None:
        with self._lock:
            return self._tables[to].get(rid) if to in self._tables else None


def _not_expected(rid: object) -> TransferAborted:
    return TransferAborted(f"no transfer is expected for request {rid!r} (expired, aborted or never leased)")


class LinkSender(BaseSender):
    """A sender whose frames go through a :class:`Link` (the link's send thread encodes them)."""

    def __init__(self, lease: Lease, *, link: Link, dispatcher: Dispatcher, codec: Codec,
                 payload_device: torch.device | None = None) -> None:
        super().__init__(lease, codec=codec, payload_device=payload_device, auth=dispatcher.auth.for_lease(lease))
        self._link, self._dispatcher = link, dispatcher
        dispatcher.add(self)
        if not link.attach(self) or not link.post(ControlJob(self, frames.open_frame(self.request_id))):
            self._fail(PeerUnavailable(f"link {link.name} is closed"), notify_peer=False)

    def _post(self, job: LayerJob | FinishJob) -> None:
        if not self._link.post(job):
            self._fail(PeerUnavailable(f"link {self._link.name} is closed"), notify_peer=False)

    def _on_terminal(self, error: TransferError | None, notify_peer: bool) -> None:
        self._dispatcher.remove(self)
        if error is not None and notify_peer:
            self._link.post(ControlJob(self, frames.abort_frame(self.request_id, frames.TO_RECEIVER, error)))
        self._link.detach(self)


class LinkReceiver(BaseReceiver):
    """A receiver answering over the link its sender's frames came on (bound by the first frame)."""

    def __init__(self, lease: Lease, sink: Sink, *, dispatcher: Dispatcher,
                 on_done: Callable[[dict], None] | None = None) -> None:
        super().__init__(lease, sink, on_done, auth=dispatcher.auth.for_lease(lease))
        self._dispatcher, self._link = dispatcher, None
        self._bind_lock = threading.Lock()
        dispatcher.add(self)

    def bind(self, link: Link) -> None:
        with self._bind_lock:
            if self._link is not None:
                return
            self._link = link
        if not link.attach(self):
            self._fail(PeerUnavailable(f"link {link.name} is closed"), notify_peer=False)

    def _on_terminal(self, error: TransferError | None, notify_peer: bool) -> None:
        self._dispatcher.remove(self)
        with self._bind_lock:
            link = self._link
        if link is None:
            return
        if error is None:
            link.post(ControlJob(self, frames.done_frame(self.request_id)))
        elif notify_peer:
            link.post(ControlJob(self, frames.abort_frame(self.request_id, frames.TO_SENDER, error)))
        link.detach(self)
