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
from kv_transfer.base import KVManager, Lease, PeerUnavailable, Sink, TransferAborted
from kv_transfer.codec import Codec, get_codec
from kv_transfer.grpc.client import Sender
from kv_transfer.grpc.server import PUSH, SERVICE, PushHandler, Receiver
from kv_transfer.transfer import TERMINAL, Transfer
from kv_transfer.watch import DeadlineWatch

log = logging.getLogger(__name__)
CHUNK_BYTES = 4 << 20


def link_options(keepalive_s: float) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(channel options, server options) that keep a broken HTTP/2 connection from holding the link: both sides ping
    every ``keepalive_s`` and close a connection whose ping is unanswered within ``2 * keepalive_s`` (a byte flipped
    in a frame length desyncs a connection without closing it: every call on it would wait for its deadline); a
    closed link redials after at most 2 s (gRPC's default backoff grows to 120 s). The server accepts the pings."""
    ms = max(1, int(keepalive_s * 1000))
    ping = [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", 2 * ms),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
    channel = ping + [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 500),
                      ("grpc.max_reconnect_backoff_ms", 2000)]
    server = ping + [("grpc.http2.min_ping_interval_without_data_ms", ms // 2),
                     ("grpc.http2.max_ping_strikes", 0)]
    return channel, server


class _Link:
    """One decode endpoint's channel and when a Push call on it was last answered (``time.monotonic()``)."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel, self.answered_at = channel, time.monotonic()


class Manager(KVManager):
    """gRPC transport manager. ``max_concurrent``: Push calls served at once (one handler thread each). ``proxy``
    ("host:port"): this side's Push calls dial the decode side through that HTTP CONNECT proxy (a site's egress
    proxy; the chaos soak's fault proxy, :mod:`duet_bench.chaos.proxy`). ``secret``: the cluster's data-plane key;
    without one the manager is built only with the explicit ``insecure=True`` (``data_plane_auth: "off"``), else
    :class:`~kv_transfer.auth.MissingSecret`.

    A wedged channel is replaced: when a Push call runs into its deadline and no call on its channel was answered
    since it started, the channel is closed (its other calls end, as stuck as this one) and the next sender dials
    afresh (``links_replaced`` counts them). Pings alone do not catch every wedge: a corrupted byte can leave the
    connection answering pings while no stream moves. ``keepalive_s``: HTTP/2 ping period of both ends (:func:`link_options`)."""

    name = "grpc"
    supports_gpu_direct = False
    cross_process = True
    cross_host = True
    dials_through_proxy = True

    def __init__(self, *, worker_id: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 codec: str = "identity", chunk_bytes: int = CHUNK_BYTES, max_concurrent: int = 32,
                 secret: ClusterSecret | None = None, insecure: bool = False, proxy: str | None = None,
                 keepalive_s: float = 2.0) -> None:
        self._auth = DataPlaneAuth.for_manager(self.name, secret, insecure=insecure, required=self.cross_process)
        if not 0 < chunk_bytes <= CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in (0, {CHUNK_BYTES}], got {chunk_bytes}")
        self._worker_id = worker_id or f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._codec: Codec = get_codec(codec)
        self._chunk_bytes = chunk_bytes
        self._proxy = proxy
        if not 0.1 <= keepalive_s <= 60:
            raise ValueError(f"keepalive_s must be in [0.1, 60], got {keepalive_s}")
        self._channel_options, server_options = link_options(keepalive_s)
        self._limit = chunk_bytes + (1 << 20)  # room for a large header message
        self._lock = threading.Lock()
        self._live: dict[tuple[str, str], Transfer] = {}
        self._channels: dict[str, _Link] = {}
        self.links_replaced = 0
        self._closed = False
        self._watch = DeadlineWatch(f"kv-deadline-{self._worker_id}")
        self._pool = futures.ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix=f"kv-push-{self._worker_id}")
        self._server = grpc.server(
            self._pool,
            options=[("grpc.max_receive_message_length", self._limit), ("grpc.so_reuseport", 0), *server_options])
        handler = grpc.stream_unary_rpc_method_handler(PushHandler(self._lookup, self._auth))
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Push": handler}),))
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
        link = self._channel(lease.endpoint)
        push = link.channel.stream_unary(PUSH)
        with self._lock:
            if ("sender", lease.request_id) in self._live:
                raise ValueError(f"a live transfer for request {lease.request_id!r} already exists here")
        sender = Sender(lease, push=push, codec=self._codec if codec is None else codec, chunk_bytes=self._chunk_bytes,
                        on_terminal=self._forget, secret=self._auth.secret,
                        on_call_end=lambda started, answered: self._call_ended(lease.endpoint, link, started, answered))
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
            channels, self._channels = list(self._channels.values()), {}
        for link in channels:
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

    def _call_ended(self, endpoint: str, link: _Link, started: float, answered: bool) -> None:
        with self._lock:
            if answered:
                link.answered_at = max(link.answered_at, time.monotonic())
                return
            if link.answered_at >= started or self._channels.get(endpoint) is not link:
                return
            del self._channels[endpoint]
            self.links_replaced += 1
        log.warning("KV link to %s answered no Push call for %.1f s: closing it, the next transfer dials afresh",
                    endpoint, time.monotonic() - link.answered_at)
        threading.Thread(target=link.channel.close, name="kv-link-close", daemon=True).start()  # not on gRPC's thread

    def _channel(self, endpoint: str) -> _Link:
        with self._lock:
            link = self._channels.get(endpoint)
            if link is None:
                options = [("grpc.max_send_message_length", self._limit),
                           ("grpc.max_receive_message_length", self._limit), *self._channel_options]
                if self._proxy:
                    options.append(("grpc.http_proxy", f"http://{self._proxy}"))
                link = self._channels[endpoint] = _Link(grpc.insecure_channel(endpoint, options=options))
            return link
