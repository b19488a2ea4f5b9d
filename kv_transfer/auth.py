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
    join_claim         = HMAC(pair_token, "claim" 0 slot)       a join record's credential (no challenge without it)
    link_key(side)     = HMAC(secret,     "duet/kv/link/v1" 0 link_id 0 side)   a link's ping / bye, one per sender

Frame MAC: ``HMAC(frame_key, pack(header without "mac") || payload)``; the header carries ``"lease"`` (the lease id)
and ``"seq"`` (per lease and direction; a side accepts only a seq greater than the last it accepted). CUDA payloads
(the nccl transport) are not hashed: their header's per-block crc32s are, and the pair itself was admitted. A link's
own frames (``ping``, ``bye``) carry ``"seq"`` and ``"mac"`` under the key of the side that sent them
(:class:`LinkAuth`), so a forged ``bye`` cannot close a link, and a side's frames reflected back to it do not verify.

Managers fail closed: a transport that crosses processes raises :class:`MissingSecret` when it is built with neither
a secret nor the explicit ``insecure=True`` (``data_plane_auth: "off"``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from kv_transfer.errors import FrameReplayed, LeaseMismatch, Unauthenticated
from kv_transfer.frames import pack as pack_frame
from kv_transfer.lease import Lease

log = logging.getLogger(__name__)
SECRET_BYTES = 32
MAC_FIELD = "mac"
Payload = torch.Tensor | Sequence[bytes] | None  # a tensor, or a payload still in the messages it arrived in


class MissingSecret(ValueError):
    """A KV manager whose transport crosses processes was built with neither a cluster secret nor the explicit
    ``insecure=True``: it would accept frames from anyone who reaches its port, so it is not built."""


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


def join_claim(secret: ClusterSecret, pair_key: str, slot: int) -> bytes:
    return _mac(pair_token(secret, pair_key), "claim", str(slot))


class FrameAuth:
    """One side's MAC state for one stream of frames: seals outgoing frames with ``seal_key`` and verifies incoming
    ones with ``verify_key``; ``bound_field`` (when set) names the header field that must hold ``bound_to``.
    Thread-safe. Messages name the stream as ``what``; nothing here shows a key."""

    bound_field: ClassVar[str | None] = None

    def __init__(self, seal_key: bytes, verify_key: bytes, *, what: str, bound_to: str | None = None) -> None:
        self._seal_key, self._verify_key, self._bound_to, self._what = seal_key, verify_key, bound_to, what
        self._lock = threading.Lock()
        self._next_seq, self._last_seen = 0, -1

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._what})"

    def seal(self, header: dict[str, Any], payload: Payload) -> dict[str, Any]:
        """``header`` with the binding, the next seq and the MAC (call in transmit order)."""
        with self._lock:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
        header = {**header, "seq": seq} if self.bound_field is None else \
            {**header, self.bound_field: self._bound_to, "seq": seq}
        header[MAC_FIELD] = _frame_mac(self._seal_key, header, payload)
        return header

    def verify(self, header: dict[str, Any], payload: Payload) -> None:
        """Accept a frame or raise: :class:`LeaseMismatch` (bound to another lease), :class:`Unauthenticated`
        (no MAC or a wrong one), :class:`FrameReplayed` (a seq already accepted). Nothing changes on a refusal.
        ``payload`` may still be the messages it arrived in: it is hashed piece by piece, never joined."""
        kind = header.get("kind")
        if MAC_FIELD not in header or (self.bound_field is not None and self.bound_field not in header):
            raise Unauthenticated(f"{self._what}: a {kind!r} frame without credentials")
        if self.bound_field is not None and header.get(self.bound_field) != self._bound_to:
            raise LeaseMismatch(f"{self._what}: a {kind!r} frame bound to another {self.bound_field}")
        mac = header.get(MAC_FIELD)
        body = {k: v for k, v in header.items() if k != MAC_FIELD}
        if not isinstance(mac, bytes) or not hmac.compare_digest(mac, _frame_mac(self._verify_key, body, payload)):
            raise Unauthenticated(f"{self._what}: a {kind!r} frame failed its MAC")
        seq = header.get("seq")
        with self._lock:
            if not isinstance(seq, int) or seq <= self._last_seen:
                raise FrameReplayed(f"{self._what}: {kind!r} frame seq {seq!r} was already accepted (last "
                                    f"{self._last_seen})")
            self._last_seen = seq


class LeaseAuth(FrameAuth):
    """One side's MAC state for one lease (both directions share the lease's frame key; ``"to"`` tells them
    apart)."""

    bound_field = "lease"

    def __init__(self, secret: ClusterSecret, request_id: str, lease_id: str) -> None:
        key = _mac(lease_token(secret, request_id, lease_id), "frame")
        super().__init__(key, key, bound_to=lease_id, what=f"request {request_id!r}")
        self.request_id, self.lease_id = request_id, lease_id

    def seal_bytes(self, data: bytes) -> bytes:
        """A MAC over a whole message (the gRPC Push summary)."""
        return _mac(self._seal_key, "summary", data)

    def check_bytes(self, data: bytes, mac: Any) -> None:
        if not isinstance(mac, bytes) or not hmac.compare_digest(mac, self.seal_bytes(data)):
            raise Unauthenticated(f"request {self.request_id!r}: the Push summary failed its MAC")


class LinkAuth(FrameAuth):
    """One end's MAC state for a link's own frames (``ping``, ``bye``): ``side`` seals, ``peer`` is verified.
    ``link_id`` is the same at both ends (a gloo pair's fresh ``pair_key``), and so is each side's name."""

    def __init__(self, secret: ClusterSecret, link_id: str, *, side: str, peer: str) -> None:
        seal_key, verify_key = (secret.derive("duet/kv/link/v1", link_id, who) for who in (side, peer))
        super().__init__(seal_key, verify_key, what=f"link {link_id!r}")


def _frame_mac(key: bytes, header: dict[str, Any], payload: Payload) -> bytes:
    h = hmac.new(key, pack_frame(header), hashlib.sha256)
    if isinstance(payload, torch.Tensor):
        if not payload.is_cuda and payload.numel():
            h.update(memoryview(payload.contiguous().numpy()))
    elif payload is not None:
        for piece in payload:
            h.update(piece)
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

    @classmethod
    def for_manager(cls, transport: str, secret: ClusterSecret | None, *, insecure: bool,
                    required: bool) -> DataPlaneAuth:
        """A manager's context, failing closed: with ``required`` (the transport crosses processes) a manager needs
        ``secret`` or the explicit ``insecure=True``, else :class:`MissingSecret`; both at once is a ``ValueError``."""
        if secret is not None and insecure:
            raise ValueError(f"the {transport!r} KV manager got a secret and insecure=True; pass one of them")
        if secret is None and required and not insecure:
            raise MissingSecret(f"the {transport!r} KV manager needs secret=ClusterSecret(...), or insecure=True to "
                                "run its data plane without authentication (data_plane_auth: \"off\")")
        return cls(secret)

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def __repr__(self) -> str:
        return f"DataPlaneAuth(enabled={self.enabled})"

    def for_lease(self, lease: Lease) -> LeaseAuth | None:
        return None if self.secret is None else LeaseAuth(self.secret, lease.request_id, lease.lease_id)

    def for_link(self, link_id: str, *, side: str, peer: str) -> LinkAuth | None:
        return None if self.secret is None else LinkAuth(self.secret, link_id, side=side, peer=peer)
