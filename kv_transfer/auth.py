"""Data-plane authentication: a per-cluster secret, one token per lease, a MAC on every frame, pair admission.

The front-end generates a :class:`ClusterSecret` at cluster start and hands it to every worker as an actor
constructor argument (Ray pickles it on the control plane, as the rest of the config; never a command line or an
environment variable). Each manager holds it; nothing here logs, reprs or raises with it.

Derivations (HMAC-SHA256 throughout; the labels keep the uses apart, so no derived value reveals another)::

    token(lease)       = HMAC(secret,     "duet/kv/lease/v1" 0 request_id 0 lease_id)   one-time: lease_id is fresh
    frame_key(lease)   = HMAC(token,      "frame")
    grpc_proof(lease)  = HMAC(token,      "grpc-admit")         gRPC call metadata (a sniffer learns no frame key)
    pair_token(key)    = HMAC(secret,     "duet/kv/pair/v1" 0 pair_key)
    join_proof         = HMAC(pair_token, "join" 0 challenge)   the joiner's answer to the decode side's challenge
    pair_namespace     = HMAC(pair_token, "ns" 0 challenge)     prefix of the pair's TCPStore keys (unguessable)

Frame MAC: ``HMAC(frame_key, pack(header without "mac") || payload)``; the header carries ``"lease"`` (the lease id)
and ``"seq"`` (per lease and direction; a side accepts only a seq greater than the last it accepted). CUDA payloads
(the nccl transport) are not hashed: their header's per-block crc32s are, and the pair itself was admitted.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
from collections import Counter
from typing import Any

import torch

from kv_transfer.errors import FrameReplayed, LeaseMismatch, Unauthenticated
from kv_transfer.frames import pack as pack_frame
from kv_transfer.lease import Lease

log = logging.getLogger(__name__)
SECRET_BYTES = 32
MAC_FIELD = "mac"


class ClusterSecret:
    """32 random bytes shared by the front-end and the workers of one cluster. Its repr and str never show them."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) < 16:
            raise ValueError("a cluster secret is at least 16 bytes")
        self._key = key

    @classmethod
    def generate(cls) -> ClusterSecret:
        return cls(secrets.token_bytes(SECRET_BYTES))

    def __repr__(self) -> str:
        return "ClusterSecret(<redacted>)"

    __str__ = __repr__

    def __getstate__(self) -> bytes:  # Ray pickles actor arguments on the control plane
        return self._key

    def __setstate__(self, key: bytes) -> None:
        self._key = key

    def derive(self, *parts: str | bytes) -> bytes:
        return _mac(self._key, *parts)


def _mac(key: bytes, *parts: str | bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.digest()


def lease_token(secret: ClusterSecret, request_id: str, lease_id: str) -> bytes:
    return secret.derive("duet/kv/lease/v1", request_id, lease_id)


def grpc_proof(secret: ClusterSecret, request_id: str, lease_id: str) -> str:
    """The hex proof a gRPC ``Push`` call carries in its metadata for one lease."""
    return _mac(lease_token(secret, request_id, lease_id), "grpc-admit").hex()


def check_grpc_proof(secret: ClusterSecret, request_id: str, lease_id: str, proof: str) -> None:
    """Raise :class:`Unauthenticated` unless ``proof`` is the lease's gRPC proof."""
    if not hmac.compare_digest(grpc_proof(secret, request_id, lease_id), proof):
        raise Unauthenticated(f"request {request_id!r}: the Push call's lease proof is wrong")


def pair_token(secret: ClusterSecret, pair_key: str) -> bytes:
    return secret.derive("duet/kv/pair/v1", pair_key)


def join_proof(secret: ClusterSecret, pair_key: str, challenge: bytes) -> bytes:
    return _mac(pair_token(secret, pair_key), "join", challenge)


def pair_namespace(secret: ClusterSecret, pair_key: str, challenge: bytes) -> str:
    return _mac(pair_token(secret, pair_key), "ns", challenge)[:16].hex()


class LeaseAuth:
    """One side's MAC state for one lease: seals outgoing frames, verifies incoming ones. Thread-safe."""

    def __init__(self, secret: ClusterSecret, request_id: str, lease_id: str) -> None:
        self.request_id, self.lease_id = request_id, lease_id
        self._key = _mac(lease_token(secret, request_id, lease_id), "frame")
        self._lock = threading.Lock()
        self._next_seq, self._last_seen = 0, -1

    def __repr__(self) -> str:
        return f"LeaseAuth({self.request_id!r})"

    def seal(self, header: dict[str, Any], payload: torch.Tensor | None) -> dict[str, Any]:
        """``header`` with the lease id, the next seq and the MAC (call in transmit order)."""
        with self._lock:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
        header = {**header, "lease": self.lease_id, "seq": seq}
        header[MAC_FIELD] = self._frame_mac(header, payload)
        return header

    def verify(self, header: dict[str, Any], payload: torch.Tensor | None) -> None:
        """Accept a frame or raise: :class:`LeaseMismatch` (bound to another lease), :class:`Unauthenticated`
        (no MAC or a wrong one), :class:`FrameReplayed` (a seq already accepted). Nothing changes on a refusal."""
        if "lease" not in header or MAC_FIELD not in header:
            raise Unauthenticated(f"request {self.request_id!r}: a {header.get('kind')!r} frame without credentials")
        if header.get("lease") != self.lease_id:
            raise LeaseMismatch(f"request {self.request_id!r}: a {header.get('kind')!r} frame bound to another lease")
        mac = header.get(MAC_FIELD)
        body = {k: v for k, v in header.items() if k != MAC_FIELD}
        if not isinstance(mac, bytes) or not hmac.compare_digest(mac, self._frame_mac(body, payload)):
            raise Unauthenticated(f"request {self.request_id!r}: a {header.get('kind')!r} frame failed its MAC")
        seq = header.get("seq")
        with self._lock:
            if not isinstance(seq, int) or seq <= self._last_seen:
                raise FrameReplayed(f"request {self.request_id!r}: {header.get('kind')!r} frame seq {seq!r} was "
                                    f"already accepted (last {self._last_seen})")
            self._last_seen = seq

    def seal_bytes(self, data: bytes) -> bytes:
        """A MAC over a whole message (the gRPC Push summary)."""
        return _mac(self._key, "summary", data)

    def check_bytes(self, data: bytes, mac: Any) -> None:
        if not isinstance(mac, bytes) or not hmac.compare_digest(mac, self.seal_bytes(data)):
            raise Unauthenticated(f"request {self.request_id!r}: the Push summary failed its MAC")

    def _frame_mac(self, header: dict[str, Any], payload: torch.Tensor | None) -> bytes:
        h = hmac.new(self._key, pack_frame(header), hashlib.sha256)
        if payload is not None and not payload.is_cuda and payload.numel():
            h.update(memoryview(payload.contiguous().numpy()))
        return h.digest()


class Refusals:
    """What a manager refused, counted by error class name (the worker stats expose it). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, error: Unauthenticated, where: str) -> None:
        """Count and log one refusal (the message names the request and the reason, never a key)."""
        with self._lock:
            self._counts[type(error).__name__] += 1
        log.warning("KV data plane refused %s: %s: %s", where, type(error).__name__, error)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class DataPlaneAuth:
    """A manager's auth context: the secret (None: ``data_plane_auth="off"``) and its refusal counter."""

    def __init__(self, secret: ClusterSecret | None) -> None:
        if secret is not None and not isinstance(secret, ClusterSecret):
            raise TypeError(f"secret must be a ClusterSecret, got {type(secret).__name__}")
        self.secret = secret
        self.refusals = Refusals()

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def __repr__(self) -> str:
        return f"DataPlaneAuth(enabled={self.enabled})"

    def for_lease(self, lease: Lease) -> LeaseAuth | None:
        return None if self.secret is None else LeaseAuth(self.secret, lease.request_id, lease.lease_id)
