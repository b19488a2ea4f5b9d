"""The lease: the decode side's promise of blocks for one request until a deadline, and the policy that sets the
deadline (re-exported by :mod:`kv_transfer.base`).

A lease bounds the transfer, not the wait for a prefill slot: its deadline is ``now + base_s + bytes /
min_rate_bps`` (:class:`LeasePolicy`). :data:`DEFAULT_LEASE` is the one source of the defaults: the decode worker
and actor take it, and the cluster spec reads its fields for its own.

Worked example: 100 MB of KV under the default policy (5 s, 50 MB/s) is due 5 + 2 = 7 s after the lease is issued.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kv_transfer.errors import ProtocolError
from kv_transfer.layout import KVLayout, StateLayout

LEASE_VERSION = 2  # 2 adds "state" (hybrid models' state frames); version-1 leases (no state) still parse


@dataclass(frozen=True)
class LeasePolicy:
    """How long a lease lasts: ``base_s`` seconds plus the bytes at ``min_rate_bps`` (the slowest rate, in BYTES per
    second, still considered healthy)."""

    base_s: float = 5.0
    min_rate_bps: float = 50e6

    def __post_init__(self) -> None:
        if not (self.base_s >= 0 and math.isfinite(self.base_s)):
            raise ValueError(f"LeasePolicy.base_s must be a finite number >= 0, got {self.base_s!r}")
        if not (self.min_rate_bps > 0 and math.isfinite(self.min_rate_bps)):
            raise ValueError(f"LeasePolicy.min_rate_bps must be a finite number > 0, got {self.min_rate_bps!r}")

    def deadline(self, num_bytes: int) -> float:
        """Absolute deadline (``time.time()`` seconds) for moving ``num_bytes`` from now."""
        assert num_bytes >= 0
        return time.time() + self.base_s + num_bytes / self.min_rate_bps


DEFAULT_LEASE = LeasePolicy()


def transfer_deadline(num_bytes: int, *, base_s: float = DEFAULT_LEASE.base_s,
                      min_rate_bps: float = DEFAULT_LEASE.min_rate_bps) -> float:
    """``LeasePolicy(base_s, min_rate_bps).deadline(num_bytes)``: ``now + base_s + num_bytes / min_rate_bps``."""
    return LeasePolicy(base_s, min_rate_bps).deadline(num_bytes)


@dataclass(frozen=True)
class Lease:
    """The decode side's promise: blocks are reserved for ``request_id`` until ``deadline_s`` (absolute wall time).

    Crosses processes as ``to_dict()`` (msgpack-able, with a ``"version"`` field). ``lease_id`` is fresh per lease
    (public): with the cluster secret it derives the lease's one-time token (:mod:`kv_transfer.auth`).
    """

    request_id: str
    num_blocks: int
    layout: KVLayout
    transport: str
    endpoint: str
    deadline_s: float
    lease_id: str = field(default_factory=lambda: secrets.token_hex(16))
    state: StateLayout | None = None  # state frames expected beside the KV (None: KV only)

    def __post_init__(self) -> None:
        if not self.request_id or not isinstance(self.request_id, str):
            raise ValueError(f"Lease.request_id must be a non-empty str, got {self.request_id!r}")
        if not isinstance(self.num_blocks, int) or self.num_blocks <= 0:
            raise ValueError(f"Lease.num_blocks must be a positive int, got {self.num_blocks!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"version": LEASE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Lease:
        """Inverse of :meth:`to_dict`; raises :class:`ProtocolError` for an unknown version or a malformed dict."""
        if not isinstance(d, dict) or d.get("version") not in (1, LEASE_VERSION):
            got = d.get("version") if isinstance(d, dict) else type(d).__name__
            raise ProtocolError(f"lease version {got!r} is not supported (expected <= {LEASE_VERSION})")
        try:
            fields = {k: v for k, v in d.items() if k != "version"}
            state = fields.get("state")
            if state is not None:
                state = StateLayout(**state)
            return cls(**{**fields, "layout": KVLayout(**fields["layout"]), "state": state})
        except (TypeError, KeyError, ValueError) as e:
            raise ProtocolError(f"malformed lease: {e}") from e
