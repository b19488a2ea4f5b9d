"""Pair rendezvous through a TCPStore hosted by the decode manager.

1. The decode manager hosts a ``TCPStore`` (master, free port) and runs a :class:`JoinWatcher` thread.
2. A prefill manager that needs the pair connects a store client, takes a slot ``n = add("duet/join/count", 1) - 1``
   and writes its join record (msgpack ``{"v", "pair_key", "prefill_id"}``) under ``duet/join/<n>``.
3. The watcher reads slots in order (polling ``check`` every ``poll_s``) and the decode side builds rank 0 of the pair's group
   while the prefill side builds rank 1, both under ``PrefixStore("duet/pair/<pair_key>/...")``.

With data-plane auth on (a cluster secret), step 3 starts with a challenge: the decode side writes 32 random bytes
under ``duet/join/<n>/challenge``, the joiner answers ``join_proof`` (:mod:`kv_transfer.auth`) under
``duet/join/<n>/proof``, and the decode side writes the verdict (``duet/join/<n>/verdict``, msgpack ``{"ok", "error",
"reason"}``). Only after an ``ok`` does either side touch the pair's keys, and those live under a prefix derived from
the secret and the challenge (``duet/pair/<pair_namespace>``), so a stranger can neither find nor overwrite them.
A joiner without the secret is refused with :class:`~kv_transfer.base.Unauthenticated` and no group is built.

``pair_key`` is fresh per pair incarnation (prefill id + nonce), so a pair recreated after an error never meets the
stale keys of the previous one. A slot reserved but never written (its writer died in between) is skipped after
``stale_s``.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgpack
import torch.distributed as dist

from kv_transfer import auth
from kv_transfer.base import PeerUnavailable, Unauthenticated, error_from_name

log = logging.getLogger(__name__)
JOIN_VERSION = 2
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


def announce(store: dist.TCPStore, *, pair_key: str, prefill_id: str) -> int:
    """Write a join record; returns its slot."""
    n = store.add(JOIN_COUNT, 1) - 1
    store.set(join_key(n), msgpack.packb({"v": JOIN_VERSION, "pair_key": pair_key, "prefill_id": prefill_id}))
    return n


def pair_prefix(pair_key: str) -> str:
    """The pair's key prefix without auth."""
    return f"duet/pair/{pair_key}"


def _await_key(store: dist.Store, key: str, timeout_s: float) -> bytes | None:
    end = time.monotonic() + timeout_s
    while not store.check([key]):  # polled: a blocking wait() logs a C++ warning per timeout
        if time.monotonic() >= end:
            return None
        time.sleep(0.01)
    return store.get(key)


def prove(store: dist.Store, slot: int, *, pair_key: str, secret: auth.ClusterSecret, timeout_s: float) -> str:
    """Joiner: answer the decode side's challenge for ``slot``; returns the pair's key prefix once admitted.
    Raises :class:`Unauthenticated` when refused and :class:`PeerUnavailable` when nothing answers in time."""
    challenge = _await_key(store, f"{join_key(slot)}/challenge", timeout_s)
    if challenge is None:
        raise PeerUnavailable(f"pair {pair_key}: the decode side sent no challenge within {timeout_s} s")
    store.set(f"{join_key(slot)}/proof", auth.join_proof(secret, pair_key, challenge))
    raw = _await_key(store, f"{join_key(slot)}/verdict", timeout_s)
    if raw is None:
        raise PeerUnavailable(f"pair {pair_key}: no admission verdict within {timeout_s} s")
    verdict = msgpack.unpackb(raw, raw=False)
    if not verdict.get("ok"):
        raise error_from_name(verdict.get("error"), f"pair {pair_key}: refused: {verdict.get('reason')}")
    return f"duet/pair/{auth.pair_namespace(secret, pair_key, challenge)}"


def challenge(store: dist.Store, slot: int, *, pair_key: str, secret: auth.ClusterSecret, timeout_s: float) -> str:
    """Decode side: challenge the joiner of ``slot`` and check its proof; returns the pair's key prefix. Raises
    :class:`Unauthenticated` (after writing a refusal verdict) when the joiner cannot prove the secret."""
    nonce = secrets.token_bytes(32)
    store.set(f"{join_key(slot)}/challenge", nonce)
    proof = _await_key(store, f"{join_key(slot)}/proof", timeout_s)
    try:
        if proof is None:
            raise Unauthenticated(f"join slot {slot}: no proof within {timeout_s} s")
        if not hmac.compare_digest(proof, auth.join_proof(secret, pair_key, nonce)):
            raise Unauthenticated(f"join slot {slot}: the joiner's proof is wrong")
    except Unauthenticated as e:
        store.set(f"{join_key(slot)}/verdict", msgpack.packb({"ok": False, "error": type(e).__name__,
                                                             "reason": str(e)}))
        raise
    store.set(f"{join_key(slot)}/verdict", msgpack.packb({"ok": True}))
    return f"duet/pair/{auth.pair_namespace(secret, pair_key, nonce)}"


def make_groups(store: dist.Store, prefix: str, *, rank: int, host: str, nccl: bool,
                timeout_s: float) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The pair's (control, data) groups under ``prefix`` (:func:`pair_prefix`, or what admission returned): gloo
    for control; the data group is the same one, or NCCL."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timedelta(seconds=timeout_s)
    try:
        ctl = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/ctl", store), rank, 2, opts)
        if not nccl:
            return ctl, ctl
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timedelta(seconds=timeout_s)
        data = dist.ProcessGroupNCCL(dist.PrefixStore(f"{prefix}/data", store), rank, 2, nccl_opts)
    except RuntimeError as e:
        raise PeerUnavailable(f"pair group set-up failed: {e}") from e
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
                self._on_join({**record, "slot": n - 1})
            except Exception:
                log.exception("bad join record in slot %d", n - 1)
