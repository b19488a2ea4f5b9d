"""In-process transport: managers of one process exchange frames through queues.

For tests, single-process serving and warm-up. It runs the full frame path (codec, checksums, msgpack headers,
abort/done replies) with no copy beyond the encode itself; payloads keep their device.

Threads per manager: one inbox thread (routes incoming frames) and one send thread per peer link.
"""

from __future__ import annotations

import queue
import threading
import uuid
import weakref
from collections.abc import Callable

import torch

from kv_transfer.auth import ClusterSecret, DataPlaneAuth
from kv_transfer.base import KVManager, Lease, PeerUnavailable, Sink, TransferAborted
from kv_transfer.codec import Codec, get_codec
from kv_transfer.link import Link
from kv_transfer.routing import Dispatcher, LinkReceiver, LinkSender
from kv_transfer.watch import DeadlineWatch

_LIVE: dict[str, weakref.ref[Manager]] = {}
_LIVE_LOCK = threading.Lock()


class Sender(LinkSender):
    """Prefill side of one transfer (see :class:`kv_transfer.base.KVSender`)."""


class Receiver(LinkReceiver):
    """Decode side of one transfer (see :class:`kv_transfer.base.KVReceiver`)."""


class _QueueLink(Link):
    """Frames from ``src`` go straight into ``dst``'s inbox."""

    def __init__(self, src: Manager, dst: Manager) -> None:
        link_id = "|".join(sorted((src.endpoint, dst.endpoint)))  # the same at both ends
        super().__init__(dispatcher=src._dispatcher, keepalive_s=1.0, name=f"{src.endpoint}->{dst.endpoint}",
                         auth=src._dispatcher.auth.for_link(link_id, side=src.endpoint, peer=dst.endpoint))
        self._src, self._dst = weakref.ref(src), weakref.ref(dst)
        self._src_endpoint = src.endpoint

    def _transmit(self, header: bytes, payload: torch.Tensor | None) -> None:
        dst = self._dst()
        if dst is None or not dst._deliver(header, payload, self._src_endpoint):
            raise PeerUnavailable(f"in-process peer of link {self.name} is closed")

    def _send_loop(self) -> None:
        # no pings in-process: an idle queue cannot time out
        self.keepalive_s = 3600.0
        super()._send_loop()

    def _on_closed(self) -> None:
        src = self._src()
        if src is not None:
            src._forget(self)


class Manager(KVManager):
    """In-process transport manager. ``endpoint`` is ``"inproc://<worker_id>"``; only managers of this process
    can reach it."""

    name = "inproc"
    supports_gpu_direct = True  # payloads never leave their device
    cross_process = False
    cross_host = False

    def __init__(self, *, worker_id: str | None = None, codec: str = "identity",
                 secret: ClusterSecret | None = None, insecure: bool = False) -> None:
        # in-process: nothing crosses a process boundary, so a secret is optional here (it still seals frames)
        auth = DataPlaneAuth.for_manager(self.name, secret, insecure=insecure, required=self.cross_process)
        self._endpoint = f"inproc://{worker_id or uuid.uuid4().hex[:12]}"
        self._codec: Codec = get_codec(codec)
        self._dispatcher = Dispatcher(auth)
        self._watch = DeadlineWatch(f"kv-deadline-{self._endpoint}")
        self._links: dict[str, _QueueLink] = {}
        self._lock = threading.Lock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        with _LIVE_LOCK:
            if self._endpoint in _LIVE and _LIVE[self._endpoint]() is not None:
                raise ValueError(f"an in-process KV manager {self._endpoint} already exists")
            _LIVE[self._endpoint] = weakref.ref(self)
        self._thread = threading.Thread(target=self._route_loop, name=f"kv-inbox-{self._endpoint}", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def expect(self, lease: Lease, sink: Sink, *, on_done: Callable[[dict], None] | None = None) -> Receiver:
        self._check(lease)
        receiver = Receiver(lease, sink, dispatcher=self._dispatcher, on_done=on_done)
        self._watch.add(receiver)
        return receiver

    def sender(self, lease: Lease, *, codec: Codec | None = None) -> Sender:
        self._check(lease)
        link = self._link_to(lease.endpoint) or Link.unreachable(
            self._dispatcher, f"no in-process KV manager at {lease.endpoint} (closed or in another process)")
        sender = Sender(lease, link=link, dispatcher=self._dispatcher, codec=self._codec if codec is None else codec)
        self._watch.add(sender)
        return sender

    def num_active(self) -> int:
        return len(self._dispatcher.live())

    def refused(self) -> dict[str, int]:
        return self._dispatcher.auth.refusals.snapshot()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links = list(self._links.values())
        for t in self._dispatcher.live():
            t._fail(TransferAborted(f"KV manager {self._endpoint} closed"), notify_peer=True)
        for link in links:
            link.close(timeout_s=1.0)
        self._inbox.put(None)
        self._thread.join(timeout=2.0)
        self._watch.close()
        with _LIVE_LOCK:
            if _LIVE.get(self._endpoint, lambda: None)() is self:
                del _LIVE[self._endpoint]

    # -- internals -----------------------------------------------------------------------------------------------
    def _check(self, lease: Lease) -> None:
        if lease.transport != self.name:
            raise ValueError(f"lease is for transport {lease.transport!r}, this manager is {self.name!r}")
        if self._closed:
            raise PeerUnavailable(f"KV manager {self._endpoint} is closed")

    def _link_to(self, endpoint: str) -> _QueueLink | None:
        with _LIVE_LOCK:
            ref = _LIVE.get(endpoint)
        peer = ref() if ref is not None else None
        if peer is None or peer._closed:
            return None
        with self._lock:
            if self._closed:
                return None
            link = self._links.get(endpoint)
            if link is None:
                link = self._links[endpoint] = _QueueLink(self, peer)
                link.start()
            return link

    def _forget(self, link: _QueueLink) -> None:
        with self._lock:
            for endpoint, held in list(self._links.items()):
                if held is link:
                    del self._links[endpoint]

    def _deliver(self, header: bytes, payload: torch.Tensor | None, src_endpoint: str) -> bool:
        if self._closed:
            return False
        self._inbox.put((header, payload, src_endpoint))
        return True

    def _route_loop(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None:
                return
            header, payload, src_endpoint = item
            link = self._link_to(src_endpoint) or self._links.get(src_endpoint)
            if link is not None:
                link.on_frame(header, payload)
