"""gRPC streaming transport, for hosts without a shared NCCL fabric (or without torch.distributed reachability).

The decode manager runs a ``grpc.server`` (bound to ``host``, port 0 = free port; ``endpoint`` is "host:PORT");
the prefill manager keeps one channel per endpoint and makes one ``Push`` call per request (HTTP/2 multiplexes
them on the channel).

Queues a request moves through, prefill side: ``sender()`` -> the sender's job queue [WAITING] -> encoded by the
call's request iterator [TRANSFERRING] -> ok summary [SUCCESS]. Decode side: ``expect()`` [WAITING] -> frames fed
by the Push handler thread [TRANSFERRING] -> ``finish`` verified [SUCCESS].
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures

import grpc

from kv_transfer.auth import ClusterSecret, DataPlaneAuth
from kv_transfer.base import KVManager, Lease, PeerUnavailable, ProtocolError, Sink, TransferAborted
from kv_transfer.codec import Codec, get_codec
from kv_transfer.grpc.client import Sender
from kv_transfer.grpc.server import PING, PUSH, SERVICE, PushHandler, Receiver, pack_ping, ping_handler, unpack_ping
from kv_transfer.transfer import TERMINAL, Transfer
from kv_transfer.watch import DeadlineWatch

log = logging.getLogger(__name__)
CHUNK_BYTES = 4 << 20


def link_options(keepalive_s: float) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(channel options, server options) that keep a broken HTTP/2 connection from holding the link: both sides ping
    every ``keepalive_s`` and close a connection whose ping is unanswered within ``2 * keepalive_s`` (a byte flipped
    in a frame length desyncs a connection without closing it: every call on it would wait for its deadline); a
    closed link redials after at most 2 s (gRPC's default backoff grows to 120 s). The server accepts the pings.
    Each channel keeps its own connections (a local subchannel pool): a replaced link's successor dials afresh
    instead of sharing the old channel's connection, which gRPC's global pool would hand it while the old one lives."""
    ms = max(1, int(keepalive_s * 1000))
    ping = [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", 2 * ms),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
    channel = ping + [("grpc.use_local_subchannel_pool", 1), ("grpc.initial_reconnect_backoff_ms", 100),
                      ("grpc.min_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2000)]
    server = ping + [("grpc.http2.min_ping_interval_without_data_ms", ms // 2),
                     ("grpc.http2.max_ping_strikes", 0)]
    return channel, server


class _Link:
    """One channel to a decode endpoint: ``answered_at``, the latest start (``time.monotonic()``) of a call on it
    that was answered (a call started later than that and unanswered is news; an answer that merely arrives later,
    to a call sent earlier, is not), its Push calls in flight, whether a probe of it is out, and whether it was
    retired (no new calls; closed once idle)."""

    def __init__(self, endpoint: str, channel: grpc.Channel) -> None:
        self.endpoint, self.channel, self.answered_at = endpoint, channel, time.monotonic()
        self.calls, self.probing, self.retired, self.closed = 0, False, False, False


class Manager(KVManager):
    """gRPC transport manager. ``max_concurrent``: Push calls served at once (one handler thread each). ``proxy``
    ("host:port"): this side's Push calls dial the decode side through that HTTP CONNECT proxy (a site's egress
    proxy; the chaos soak's fault proxy, :mod:`duet_bench.chaos.proxy`). ``secret``: the cluster's data-plane key;
    without one the manager is built only with the explicit ``insecure=True`` (``data_plane_auth: "off"``), else
    :class:`~kv_transfer.auth.MissingSecret`.

    A wedged channel is replaced. When a Push call ends without the decode side's summary (its deadline passed, the
    decode side cancelled it at the lease deadline, the stream broke) and no call on its channel was answered since
    it started, the manager probes the channel: a ``Ping`` call (a nonce, echoed) with a ``probe_s`` deadline. A
    channel that answers is kept (the transfer failed, not the link); one that does not is closed (its other calls
    end, as stuck as the probe) and the next sender dials afresh (``links_replaced`` counts them). A sender made
    while its channel is under probe does not wait for the verdict: it dials a fresh channel, and the probed one is
    retired (closed once its calls end, or at once when the probe fails). HTTP/2 pings alone
    do not catch every wedge: a corrupted byte can leave the connection answering them while no stream moves, and
    the lease deadline alone cannot tell a stuck link from a transfer that never finished. ``keepalive_s``: HTTP/2
    ping period of both ends (:func:`link_options`)."""

    name = "grpc"
    supports_gpu_direct = False
    cross_process = True
    cross_host = True
    dials_through_proxy = True

    def __init__(self, *, worker_id: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 codec: str = "identity", chunk_bytes: int = CHUNK_BYTES, max_concurrent: int = 32,
                 secret: ClusterSecret | None = None, insecure: bool = False, proxy: str | None = None,
                 keepalive_s: float = 2.0, probe_s: float = 1.0) -> None:
        self._auth = DataPlaneAuth.for_manager(self.name, secret, insecure=insecure, required=self.cross_process)
        if not 0 < chunk_bytes <= CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in (0, {CHUNK_BYTES}], got {chunk_bytes}")
        self._worker_id = worker_id or f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._codec: Codec = get_codec(codec)
        self._chunk_bytes = chunk_bytes
        self._proxy = proxy
        if not 0.1 <= keepalive_s <= 60:
            raise ValueError(f"keepalive_s must be in [0.1, 60], got {keepalive_s}")
        if not 0.05 <= probe_s <= 30:
            raise ValueError(f"probe_s must be in [0.05, 30], got {probe_s}")
        self._probe_s = probe_s
        self._channel_options, server_options = link_options(keepalive_s)
        self._limit = chunk_bytes + (1 << 20)  # room for a large header message
        self._lock = threading.Lock()
        self._live: dict[tuple[str, str], Transfer] = {}
        self._channels: dict[str, _Link] = {}  # the channel new calls to an endpoint take
        self._links: set[_Link] = set()  # every channel not yet closed, retired ones included
        self.links_replaced = 0
        self._closed = False
        self._watch = DeadlineWatch(f"kv-deadline-{self._worker_id}")
        self._pool = futures.ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix=f"kv-push-{self._worker_id}")
        self._server = grpc.server(
            self._pool,
            options=[("grpc.max_receive_message_length", self._limit), ("grpc.so_reuseport", 0), *server_options])
        handlers = {"Push": grpc.stream_unary_rpc_method_handler(PushHandler(self._lookup, self._auth)),
                    "Ping": grpc.unary_unary_rpc_method_handler(ping_handler)}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if not bound:
            raise PeerUnavailable(f"cannot bind the KV gRPC server to {host}:{port}")
        self._server.start()
        self._endpoint = f"{host}:{bound}"

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def expect(self, lease: Lease, sink: Sink, *, on_done: Callable[[dict], None] | None = None) -> Receiver:
        self._check(lease)
        receiver = Receiver(lease, sink, on_done=on_done, on_terminal=self._forget,
                            lease_auth=self._auth.for_lease(lease))
        self._register("receiver", receiver)
        return receiver

    def sender(self, lease: Lease, *, codec: Codec | None = None) -> Sender:
        self._check(lease)
        with self._lock:
            if ("sender", lease.request_id) in self._live:
                raise ValueError(f"a live transfer for request {lease.request_id!r} already exists here")
            link = self._channel(lease.endpoint)
            link.calls += 1  # given back by the call's end, or below when no call started
        try:
            sender = Sender(lease, push=link.channel.stream_unary(PUSH), codec=self._codec if codec is None else codec,
                            chunk_bytes=self._chunk_bytes, on_terminal=self._forget, secret=self._auth.secret,
                            on_call_end=lambda started, answered: self._call_ended(link, started, answered))
        except BaseException:
            self._call_ended(link, time.monotonic(), None)
            raise
        if sender.call is None:  # the lease had run out: no call
            self._call_ended(link, time.monotonic(), None)
        self._register("sender", sender)
        return sender

    def refused(self) -> dict[str, int]:
        return self._auth.refusals.snapshot()

    def num_active(self) -> int:
        with self._lock:
            return len(self._live)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live = list(self._live.values())
        for t in live:
            t._fail(TransferAborted(f"KV manager {self._worker_id} closed"), notify_peer=True)
        end = time.monotonic() + 1.0  # let abort frames go out before the channels close
        for t in live:
            if isinstance(t, Sender) and t.call is not None:
                while not t.call.done() and time.monotonic() < end:
                    time.sleep(0.01)
        self._server.stop(grace=0.5).wait(2.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            links, self._channels, self._links = list(self._links), {}, set()
        for link in links:
            link.closed = True
            link.channel.close()
        self._watch.close()

    # -- internals -----------------------------------------------------------------------------------------------
    def _check(self, lease: Lease) -> None:
        if lease.transport != self.name:
            raise ValueError(f"lease is for transport {lease.transport!r}, this manager is {self.name!r}")
        if self._closed:
            raise PeerUnavailable(f"KV manager {self._worker_id} is closed")

    def _register(self, role: str, t: Transfer) -> None:
        with self._lock:
            if (role, t.request_id) in self._live:
                raise ValueError(f"a live transfer for request {t.request_id!r} already exists here")
            self._live[(role, t.request_id)] = t
        self._watch.add(t)
        if t.poll() in TERMINAL:  # it ended before it was registered: drop it again
            self._forget(t)

    def _forget(self, t: Transfer) -> None:
        key = ("receiver" if isinstance(t, Receiver) else "sender", t.request_id)
        with self._lock:
            if self._live.get(key) is t:
                del self._live[key]

    def _lookup(self, request_id: str) -> Receiver | None:
        with self._lock:
            t = self._live.get(("receiver", request_id))
        return t if isinstance(t, Receiver) else None

    def _call_ended(self, link: _Link, started: float, answered: bool | None) -> None:
        """A Push call on ``link`` ended: answered (its summary came back), not (which starts a probe unless a call
        was answered since it started or a probe is already out), or cancelled here (None)."""
        with self._lock:
            link.calls -= 1
            if answered:
                link.answered_at = max(link.answered_at, started)
            probe = (answered is False and not (self._closed or link.closed or link.probing)
                     and link.answered_at < started)
            link.probing |= probe
            idle = not probe and self._retire_if_idle(link)
        if idle:
            self._close_link(link)
        if not probe:
            return
        nonce, sent = os.urandom(8), time.monotonic()
        try:
            call = link.channel.unary_unary(PING).future(pack_ping(nonce), timeout=self._probe_s)
        except Exception as e:  # the channel was closed meanwhile
            log.debug("cannot probe the KV link to %s: %r", link.endpoint, e)
            self._probed(link, None, nonce, sent)
            return
        call.add_done_callback(lambda done: self._probed(link, done, nonce, sent))

    def _probed(self, link: _Link, call: grpc.Future | None, nonce: bytes, sent: float) -> None:
        try:
            ok = (call is not None and not call.cancelled() and call.exception() is None
                  and unpack_ping(call.result()) == nonce)
        except ProtocolError:
            ok = False
        with self._lock:
            link.probing = False
            if ok:
                link.answered_at = max(link.answered_at, sent)
                close = self._retire_if_idle(link)
            else:
                close = not (self._closed or link.closed)
                if close:
                    link.retired, link.closed = True, True
                    self._links.discard(link)
                    if self._channels.get(link.endpoint) is link:
                        del self._channels[link.endpoint]
                    self.links_replaced += 1
        if not ok and close:
            log.warning("KV link to %s answered no call started in the last %.1f s nor a probe within %.1f s: "
                        "closing it, the next transfer dials afresh", link.endpoint,
                        time.monotonic() - link.answered_at, self._probe_s)
        if close:
            self._close_link(link)

    def _retire_if_idle(self, link: _Link) -> bool:
        """(under the lock) Mark a retired ``link`` with no call nor probe left closed; True when the caller must
        close its channel."""
        if not link.retired or link.closed or link.calls > 0 or link.probing:
            return False
        link.closed = True
        self._links.discard(link)
        return True

    @staticmethod
    def _close_link(link: _Link) -> None:
        threading.Thread(target=link.channel.close, name="kv-link-close", daemon=True).start()  # not on gRPC's thread

    def _channel(self, endpoint: str) -> _Link:
        """(under the lock) The channel a new call to ``endpoint`` takes: a fresh one when none is open or the open
        one is under probe (that one is retired)."""
        link = self._channels.get(endpoint)
        if link is not None and link.probing:
            link.retired = True
            link = None
        if link is None:
            options = [("grpc.max_send_message_length", self._limit),
                       ("grpc.max_receive_message_length", self._limit), *self._channel_options]
            if self._proxy:
                options.append(("grpc.http_proxy", f"http://{self._proxy}"))
            link = self._channels[endpoint] = _Link(endpoint, grpc.insecure_channel(endpoint, options=options))
            self._links.add(link)
        return link
