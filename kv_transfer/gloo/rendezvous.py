"""Pair rendezvous through a TCPStore hosted by the decode manager.

1. The decode manager hosts a ``TCPStore`` (master, free port) and runs a :class:`JoinWatcher` thread.
2. A prefill manager that needs the pair connects a store client, picks a random slot ``n`` and pushes its join
   record (msgpack ``{"v", "slot", "pair_key", "prefill_id"}``, plus ``"claim"`` with auth on) onto the store's
   queue ``duet/join/queue``.
3. The watcher pops records as they arrive (polling every ``poll_s``) and the decode side builds rank 0 of the pair's
   group while the prefill side builds rank 1, both under ``PrefixStore("duet/pair/<pair_key>/...")``.

The store is reachable by anyone on its host, so nothing in it is trusted to say what to wait for: the watcher never
waits for a record, it only takes those that are there. (It used to number slots with a shared counter and wait
``stale_s`` for each reserved slot in turn, so a stranger who added 1,000 to the counter stalled every later join
for 1,000 of those waits.) A record that is garbage, of another version, or (auth on) without its claim costs one
pop and is dropped or refused at once.

With data-plane auth on (a cluster secret), a record carries ``join_claim`` (:mod:`kv_transfer.auth`; bound to its
pair key and slot); one without a valid claim gets a refusal verdict at once and nothing else. Otherwise step 3
starts with a challenge: the decode side writes 32 random bytes under ``duet/join/<n>/challenge``, the joiner answers
``join_proof`` under ``duet/join/<n>/proof``, and the decode side writes the verdict (``duet/join/<n>/verdict``,
msgpack ``{"ok", "error", "reason"}``). Only after an ``ok`` does either side touch the pair's keys, and those live
under a prefix derived from the secret and the challenge (``duet/pair/<pair_namespace>``), so a stranger can neither
find nor overwrite them. A joiner without the secret is refused with :class:`~kv_transfer.base.Unauthenticated` and no
group is built. Every wait is bounded (``timeout_s``); a stranger who deletes or overwrites a slot's keys can make
that one join fail (typed, in time; the next ``sender()`` tries again), never wait longer.

``pair_key`` is fresh per pair incarnation (prefill id + nonce), so a pair recreated after an error never meets the
stale keys of the previous one.
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
from kv_transfer.base import PeerUnavailable, ProtocolError, Unauthenticated, error_from_name

log = logging.getLogger(__name__)
JOIN_VERSION = 3
JOIN_QUEUE = "duet/join/queue"
SLOT_BITS = 62


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


def announce(store: dist.TCPStore, *, pair_key: str, prefill_id: str, secret: auth.ClusterSecret | None = None) -> int:
    """Queue a join record (with its claim when ``secret`` is given); returns its slot (random)."""
    slot = secrets.randbits(SLOT_BITS)
    record: dict[str, Any] = {"v": JOIN_VERSION, "slot": slot, "pair_key": pair_key, "prefill_id": prefill_id}
    if secret is not None:
        record["claim"] = auth.join_claim(secret, pair_key, slot)
    store.queue_push(JOIN_QUEUE, msgpack.packb(record))
    return slot


def pair_prefix(pair_key: str) -> str:
    """The pair's key prefix without auth."""
    return f"duet/pair/{pair_key}"


def _await_key(store: dist.Store, key: str, timeout_s: float) -> bytes | None:
    found = _await_any(store, (key,), timeout_s)
    return None if found is None else found[1]


def _await_any(store: dist.Store, keys: tuple[str, ...], timeout_s: float) -> tuple[str, bytes] | None:
    """The first of ``keys`` to exist (in ``keys`` order) and its value; None after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        for key in keys:
            if store.check([key]):  # polled: a blocking wait() logs a C++ warning per timeout
                return key, store.get(key)
        if time.monotonic() >= end:
            return None
        time.sleep(0.01)


def _verdict(raw: bytes, pair_key: str) -> None:
    """Raise the error a refusal verdict names (:class:`ProtocolError` for garbage); return on ``ok``."""
    try:
        verdict = msgpack.unpackb(raw, raw=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"pair {pair_key}: the admission verdict is not msgpack: {e}") from e
    if not isinstance(verdict, dict):
        raise ProtocolError(f"pair {pair_key}: the admission verdict is a {type(verdict).__name__}")
    if not verdict.get("ok"):
        raise error_from_name(verdict.get("error"), f"pair {pair_key}: refused: {verdict.get('reason')}")


def prove(store: dist.Store, slot: int, *, pair_key: str, secret: auth.ClusterSecret, timeout_s: float) -> str:
    """Joiner: answer the decode side's challenge for ``slot``; returns the pair's key prefix once admitted.
    Raises :class:`Unauthenticated` when refused (a record without its claim is refused before any challenge) and
    :class:`PeerUnavailable` when nothing answers in time."""
    verdict_key = f"{join_key(slot)}/verdict"
    found = _await_any(store, (verdict_key, f"{join_key(slot)}/challenge"), timeout_s)
    if found is None:
        raise PeerUnavailable(f"pair {pair_key}: the decode side sent no challenge within {timeout_s} s")
    challenge, raw = (None, found[1]) if found[0] == verdict_key else (found[1], None)  # a verdict first: refused
    if challenge is not None:
        store.set(f"{join_key(slot)}/proof", auth.join_proof(secret, pair_key, challenge))
        raw = _await_key(store, verdict_key, timeout_s)
        if raw is None:
            raise PeerUnavailable(f"pair {pair_key}: no admission verdict within {timeout_s} s")
    store.delete_key(verdict_key)
    _verdict(raw, pair_key)
    if challenge is None:
        raise ProtocolError(f"pair {pair_key}: an admission verdict without a challenge")
    return f"duet/pair/{auth.pair_namespace(secret, pair_key, challenge)}"


def challenge(store: dist.Store, slot: int, *, pair_key: str, secret: auth.ClusterSecret, timeout_s: float) -> str:
    """Decode side: challenge the joiner of ``slot`` and check its proof; returns the pair's key prefix. Raises
    :class:`Unauthenticated` (after writing a refusal verdict) when the joiner cannot prove the secret."""
    nonce = secrets.token_bytes(32)
    store.set(f"{join_key(slot)}/challenge", nonce)
    proof = _await_key(store, f"{join_key(slot)}/proof", timeout_s)
    for key in ("challenge", "proof"):
        store.delete_key(f"{join_key(slot)}/{key}")
    try:
        if proof is None:
            raise Unauthenticated(f"join slot {slot}: no proof within {timeout_s} s")
        if not hmac.compare_digest(proof, auth.join_proof(secret, pair_key, nonce)):
            raise Unauthenticated(f"join slot {slot}: the joiner's proof is wrong")
    except Unauthenticated as e:
        refuse(store, slot, e)
        raise
    store.set(f"{join_key(slot)}/verdict", msgpack.packb({"ok": True}))
    return f"duet/pair/{auth.pair_namespace(secret, pair_key, nonce)}"


def check_claim(record: dict[str, Any], secret: auth.ClusterSecret) -> None:
    """Decode side: raise :class:`Unauthenticated` unless the join record carries its claim."""
    claim = record.get("claim")
    if not isinstance(claim, bytes) or not hmac.compare_digest(
            claim, auth.join_claim(secret, record["pair_key"], record["slot"])):
        raise Unauthenticated(f"join slot {record['slot']}: the record has no valid claim")


def refuse(store: dist.Store, slot: int, error: Unauthenticated) -> None:
    """Decode side: the refusal verdict for ``slot`` (its joiner raises ``error``'s class)."""
    store.set(f"{join_key(slot)}/verdict", msgpack.packb({"ok": False, "error": type(error).__name__,
                                                         "reason": str(error)}))


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
    """Decode side: pops join records in arrival order and calls ``on_join(record)`` on its thread for each
    well-formed one (``{"v", "slot", "pair_key", "prefill_id"}``, checked). With ``secret`` (auth on), a record
    without its claim is refused at once instead: a refusal verdict in its slot, then ``on_refused(error, slot)``.
    ``close()`` stops it (bounded)."""

    def __init__(self, host: str, port: int, on_join: Callable[[dict[str, Any]], None], *,
                 secret: auth.ClusterSecret | None = None,
                 on_refused: Callable[[Unauthenticated, int], None] | None = None, poll_s: float = 0.05) -> None:
        self._host, self._port, self._on_join, self._poll_s = host, port, on_join, poll_s
        self._secret, self._on_refused = secret, on_refused
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
        while not self._closed.is_set():
            try:
                raw = store.queue_pop(JOIN_QUEUE, block=False)
            except RuntimeError:  # empty (QueueEmptyError), or our own store went away: the manager is closing
                if self._closed.wait(self._poll_s):
                    return
                continue
            try:
                self._handle(store, raw)
            except Exception:  # a thread boundary: one record never stops the watcher
                log.exception("handling a join record failed")

    def _handle(self, store: dist.Store, raw: bytes) -> None:
        try:
            record = _parse_record(raw)
        except ValueError as e:  # anyone can push to the queue: a warning, no traceback
            log.warning("dropped a join record: %s", e)
            return
        if self._secret is not None:
            try:
                check_claim(record, self._secret)
            except Unauthenticated as e:
                refuse(store, record["slot"], e)
                if self._on_refused is not None:
                    self._on_refused(e, record["slot"])
                return
        self._on_join(record)


def _parse_record(raw: bytes) -> dict[str, Any]:
    try:
        record = msgpack.unpackb(raw, raw=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise ValueError(f"not msgpack: {e}") from e
    if not (isinstance(record, dict) and record.get("v") == JOIN_VERSION and _is_slot(record.get("slot"))
            and isinstance(record.get("pair_key"), str) and isinstance(record.get("prefill_id"), str)):
        raise ValueError(f"not a version {JOIN_VERSION} join record: {str(record)[:120]}")
    return record


def _is_slot(slot: Any) -> bool:
    return isinstance(slot, int) and not isinstance(slot, bool) and 0 <= slot < 1 << SLOT_BITS
