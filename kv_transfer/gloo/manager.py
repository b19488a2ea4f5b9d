"""torch.distributed point-to-point transport: one two-rank process group per (prefill, decode) manager pair.

The decode manager hosts a TCPStore and accepts joins (see rendezvous.py); a prefill manager creates the pair to a
decode endpoint lazily on its first ``sender()`` and reuses it for every later request (one send thread per pair:
that pair's frames go FIFO). A pair that fails is dropped (its transfers end FAILED with PeerUnavailable) and the
next ``sender()`` builds a new one, so workers can join and leave.

Queues a request moves through, prefill side: ``sender()`` [BOOTSTRAPPING until the pair is up] -> pair outbox
[WAITING] -> encoded and sent by the pair's send thread [TRANSFERRING] -> ``done`` from decode [SUCCESS].
Decode side: ``expect()`` [WAITING] -> frames dispatched by the pair's receive thread [TRANSFERRING] -> ``finish``
verified [SUCCESS].
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from kv_transfer.auth import ClusterSecret, DataPlaneAuth
from kv_transfer.base import KVManager, Lease, PeerUnavailable, Sink, TransferAborted, Unauthenticated
from kv_transfer.codec import Codec, get_codec
from kv_transfer.gloo.rendezvous import (
    JoinWatcher,
    announce,
    challenge,
    connect_store,
    host_store,
    make_groups,
    pair_prefix,
    prove,
)
from kv_transfer.gloo.pair import GroupsFactory, Pair
from kv_transfer.link import LinkState
from kv_transfer.routing import Dispatcher, LinkReceiver, LinkSender
from kv_transfer.watch import DeadlineWatch


class Sender(LinkSender):
    """Prefill side of one transfer (see :class:`kv_transfer.base.KVSender`)."""


class Receiver(LinkReceiver):
    """Decode side of one transfer (see :class:`kv_transfer.base.KVReceiver`)."""


def parse_endpoint(endpoint: str) -> tuple[str, int, str]:
    """``"host:port/worker_id"`` -> (host, port, worker_id)."""
    try:
        address, worker_id = endpoint.split("/", 1)
        host, port = address.rsplit(":", 1)
        return host, int(port), worker_id
    except ValueError:
        raise ValueError(f"bad gloo endpoint {endpoint!r} (expected 'host:port/worker_id')") from None


class Manager(KVManager):
    """Point-to-point transport over gloo (CPU tensors).

    ``host``: the address this worker is reachable at (store and gloo sockets bind/advertise it; loopback by
    default). ``op_timeout_s`` bounds every send/recv and pair set-up; ``keepalive_s`` (< op_timeout_s / 2) is the
    idle ping period. ``secret``: the cluster's data-plane key; without one the manager is built only with the
    explicit ``insecure=True`` (``data_plane_auth: "off"``), else :class:`~kv_transfer.auth.MissingSecret`.
    """

    name: ClassVar[str] = "gloo"
    nccl: ClassVar[bool] = False  # payloads through an NCCL group on CUDA
    supports_gpu_direct = False
    cross_process = True
    cross_host = True

    def __init__(self, *, worker_id: str | None = None, host: str = "127.0.0.1", codec: str = "identity",
                 op_timeout_s: float = 30.0, keepalive_s: float = 2.0, connect_timeout_s: float = 10.0,
                 secret: ClusterSecret | None = None, insecure: bool = False) -> None:
        self._auth = DataPlaneAuth.for_manager(self.name, secret, insecure=insecure, required=self.cross_process)
        if not 0 < keepalive_s < op_timeout_s / 2:
            raise ValueError(f"keepalive_s ({keepalive_s}) must be in (0, op_timeout_s / 2 = {op_timeout_s / 2})")
        self._payload_device = self._check_host()
        self._worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._host, self._codec = host, get_codec(codec)
        self._op_timeout_s, self._keepalive_s, self._connect_timeout_s = op_timeout_s, keepalive_s, connect_timeout_s
        self._dispatcher = Dispatcher(self._auth)
        self._lock = threading.Lock()
        self._out: dict[str, Pair] = {}  # pairs this manager started (prefill role), by decode endpoint
        self._in: set[Pair] = set()  # pairs peers started (decode role)
        self._closed = False
        self._store = host_store(host)
        self._endpoint = f"{host}:{self._store.port}/{self._worker_id}"
        self._watch = DeadlineWatch(f"kv-deadline-{self._worker_id}")
        self._watcher = JoinWatcher(host, self._store.port, self._accept, secret=self._auth.secret,
                                    on_refused=self._refused_join)

    @classmethod
    def _check_host(cls) -> torch.device:
        if not dist.is_available() or not dist.is_gloo_available():
            raise PeerUnavailable("the gloo KV transport needs torch.distributed with gloo")
        return torch.device("cpu")

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
        sender = Sender(lease, link=self._pair_to(lease.endpoint), dispatcher=self._dispatcher,
                        codec=self._codec if codec is None else codec, payload_device=self._payload_device)
        self._watch.add(sender)
        return sender

    def num_active(self) -> int:
        return len(self._dispatcher.live())

    def refused(self) -> dict[str, int]:
        return self._auth.refusals.snapshot()

    def num_pairs(self) -> int:
        """Pairs held now (both roles); for tests and metrics."""
        with self._lock:
            return len(self._out) + len(self._in)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pairs = [*self._out.values(), *self._in]
        for t in self._dispatcher.live():
            t._fail(TransferAborted(f"KV manager {self._worker_id} closed"), notify_peer=True)
        closers = [threading.Thread(target=p.close, args=(2.0,), daemon=True) for p in pairs]
        for c in closers:
            c.start()
        for c in closers:
            c.join(timeout=3.0)
        self._watcher.close()
        self._watch.close()
        self._store = None

    # -- internals -----------------------------------------------------------------------------------------------
    def _check(self, lease: Lease) -> None:
        if lease.transport != self.name:
            raise ValueError(f"lease is for transport {lease.transport!r}, this manager is {self.name!r}")
        if self._closed:
            raise PeerUnavailable(f"KV manager {self._worker_id} is closed")

    def _new_pair(self, *, rank: int, pair_key: str, connect: GroupsFactory, name: str) -> Pair:
        return Pair(dispatcher=self._dispatcher, rank=rank, connect=connect, keepalive_s=self._keepalive_s,
                    payload_device=self._payload_device, name=name, on_closed=self._forget,
                    auth=self._auth.for_link(pair_key, side=str(rank), peer=str(1 - rank)))

    def _pair_to(self, endpoint: str) -> Pair:
        host, port, decode_id = parse_endpoint(endpoint)
        with self._lock:
            pair = self._out.get(endpoint)
            if pair is not None and pair.state < LinkState.CLOSING:
                return pair
            pair_key = f"{self._worker_id}/{uuid.uuid4().hex[:8]}"

            def connect() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
                store = connect_store(host, port, self._connect_timeout_s)
                slot = announce(store, pair_key=pair_key, prefill_id=self._worker_id, secret=self._auth.secret)
                prefix = pair_prefix(pair_key)
                if self._auth.secret is not None:
                    prefix = prove(store, slot, pair_key=pair_key, secret=self._auth.secret,
                                              timeout_s=self._connect_timeout_s)
                return make_groups(store, prefix, rank=1, host=self._host, nccl=self.nccl,
                                              timeout_s=self._op_timeout_s)

            pair = self._out[endpoint] = self._new_pair(rank=1, pair_key=pair_key, connect=connect,
                                                        name=f"{pair_key}->{decode_id}")
        pair.start()
        return pair

    def _accept(self, record: dict[str, Any]) -> None:
        pair_key, slot = str(record["pair_key"]), int(record["slot"])

        def connect() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
            store = connect_store(self._host, self._store.port, self._connect_timeout_s)
            prefix = pair_prefix(pair_key)
            if self._auth.secret is not None:
                try:  # nothing of the pair's is read from the store before the joiner proved the secret
                    prefix = challenge(store, slot, pair_key=pair_key, secret=self._auth.secret,
                                                  timeout_s=self._connect_timeout_s)
                except Unauthenticated as e:
                    self._refused_join(e, slot)
                    raise
            return make_groups(store, prefix, rank=0, host=self._host, nccl=self.nccl,
                                          timeout_s=self._op_timeout_s)

        with self._lock:
            if self._closed:
                return
            pair = self._new_pair(rank=0, pair_key=pair_key, connect=connect, name=f"{pair_key}->{self._worker_id}")
            self._in.add(pair)
        pair.start()

    def _refused_join(self, error: Unauthenticated, slot: int) -> None:
        self._auth.refusals.add(error, f"a gloo join (slot {slot})")

    def _forget(self, pair: Pair) -> None:
        with self._lock:
            self._in.discard(pair)
            for endpoint, held in list(self._out.items()):
                if held is pair:
                    del self._out[endpoint]


class NcclManager(Manager):
    """The same pairs with payloads over NCCL (CUDA tensors end to end; control frames stay on gloo).

    Needs a CUDA device and a torch build with NCCL; NCCL also refuses two ranks on one GPU, so on a one-GPU host
    use a same-node transport instead. Untested on CPU-only hosts (construction raises PeerUnavailable there).
    """

    name: ClassVar[str] = "nccl"
    nccl: ClassVar[bool] = True
    supports_gpu_direct = True

    @classmethod
    def _check_host(cls) -> torch.device:
        if not torch.cuda.is_available() or not dist.is_available() or not dist.is_nccl_available():
            raise PeerUnavailable("the nccl KV transport needs a CUDA device and a torch build with NCCL; this host "
                                  "has none (use 'gloo' or 'grpc')")
        return torch.device("cuda", torch.cuda.current_device())
