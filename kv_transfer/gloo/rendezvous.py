"""Pair rendezvous through a TCPStore hosted by the decode manager.

1. The decode manager hosts a ``TCPStore`` (master, free port) and runs a :class:`JoinWatcher` thread.
2. A prefill manager that needs the pair connects a store client, takes a slot ``n = add("duet/join/count", 1) - 1``
   and writes its join record (msgpack ``{"v", "pair_key", "prefill_id"}``) under ``duet/join/<n>``.
3. The watcher reads slots in order (polling ``check`` every ``poll_s``) and the decode side builds rank 0 of the pair's group
   while the prefill side builds rank 1, both under ``PrefixStore("duet/pair/<pair_key>/...")``.

``pair_key`` is fresh per pair incarnation (prefill id + nonce), so a pair recreated after an error never meets the
stale keys of the previous one. A slot reserved but never written (its writer died in between) is skipped after
``stale_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgpack
import torch.distributed as dist

from kv_transfer.base import PeerUnavailable

log = logging.getLogger(__name__)
JOIN_VERSION = 1
JOIN_COUNT = "duet/join/count"


def join_key(n: int) -> str:
    return f"duet/join/{n}"


def host_store(host: str) -> dist.TCPStore:
    """A master TCPStore on ``host`` at a free port (``store.port``)."""
    return dist.TCPStore(host, 0, None, True, timedelta(seconds=30), wait_for_workers=False)


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the store at ``host:port``; :class:`PeerUnavailable` when it cannot be reached in time."""
    try:
        return dist.TCPStore(host, port, None, False, timedelta(seconds=max(0.1, timeout_s)))
    except RuntimeError as e:
        raise PeerUnavailable(f"cannot reach the KV store at {host}:{port}: {e}") from e


def announce(store: dist.TCPStore, *, pair_key: str, prefill_id: str) -> None:
    n = store.add(JOIN_COUNT, 1) - 1
    store.set(join_key(n), msgpack.packb({"v": JOIN_VERSION, "pair_key": pair_key, "prefill_id": prefill_id}))


def make_groups(store: dist.Store, pair_key: str, *, rank: int, host: str, nccl: bool,
                timeout_s: float) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The pair's (control, data) groups: gloo for control; the data group is the same one, or NCCL."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timedelta(seconds=timeout_s)
    try:
        ctl = dist.ProcessGroupGloo(dist.PrefixStore(f"duet/pair/{pair_key}/ctl", store), rank, 2, opts)
        if not nccl:
            return ctl, ctl
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timedelta(seconds=timeout_s)
        data = dist.ProcessGroupNCCL(dist.PrefixStore(f"duet/pair/{pair_key}/data", store), rank, 2, nccl_opts)
    except RuntimeError as e:
        raise PeerUnavailable(f"pair {pair_key}: process group set-up failed: {e}") from e
    return ctl, data


class JoinWatcher:
    """Decode side: calls ``on_join(record)`` on its thread for each join record, in order. ``close()`` stops it."""

    def __init__(self, host: str, port: int, on_join: Callable[[dict[str, Any]], None], *,
                 poll_s: float = 0.05, stale_s: float = 10.0) -> None:
        self._host, self._port, self._on_join = host, port, on_join
        self._poll_s, self._stale_s = poll_s, stale_s
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-join-{port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        try:
            store = connect_store(self._host, self._port, 5.0)
        except PeerUnavailable:
            log.exception("join watcher could not connect to its own store")
            return
        n, missing_since = 0, None
        while not self._closed.is_set():
            try:
                present = store.check([join_key(n)])  # a blocking wait() would log a C++ warning per timeout
            except RuntimeError:  # our own store went away: the manager is closing
                present = False
            if not present:
                if self._closed.wait(self._poll_s):
                    return
                # The stale clock starts only once slot n is reserved (count > n): an idle watcher must not skip
                # a slot whose record is written microseconds after the reservation.
                if store.add(JOIN_COUNT, 0) <= n:
                    missing_since = None
                elif missing_since is None:
                    missing_since = time.monotonic()
                elif time.monotonic() - missing_since > self._stale_s:
                    log.warning("join slot %d was reserved but never written; skipping it", n)
                    n, missing_since = n + 1, None
                continue
            raw = store.get(join_key(n))
            store.delete_key(join_key(n))
            n, missing_since = n + 1, None
            try:
                record = msgpack.unpackb(raw, raw=False)
                if not isinstance(record, dict) or record.get("v") != JOIN_VERSION:
                    raise ValueError(f"unsupported join record {record!r}")
                self._on_join(record)
            except Exception:
                log.exception("bad join record in slot %d", n - 1)
