"""The lease: the decode side's promise of blocks for one request until a deadline, and the policy that sets the
deadline (re-exported by :mod:`kv_transfer.base`).

A lease bounds the transfer, not the wait for a prefill slot. Its transfer time is ``base_s + bytes /
min_rate_bps`` (:class:`LeasePolicy`), counted in one of two ways:

* from issue (``start_by_s`` None): due at ``deadline_s`` = issue time + transfer time, whatever the prefill
  worker was doing;
* from the transfer's start (``start_by_s`` set, :meth:`LeasePolicy.queued`): the request may wait for its prefill
  until ``start_by_s`` (the request's own deadline, from the front-end); the first KV layer or state frame that
  moves starts the clock, and the rest is due ``transfer_s`` seconds after it. A request queued behind long image
  prefills keeps its blocks and its lease; a prefill that stalls after starting still fails on time.

:data:`DEFAULT_LEASE` is the one source of the defaults: the decode worker and actor take it, and the cluster spec
reads its fields for its own.

Worked example: 100 MB of KV under the default policy (5 s, 50 MB/s) needs 5 + 2 = 7 s. Issued at t=0 from issue:
due at 7. Issued at t=0 with ``start_by_s`` = 600 and the first layer moving at t=42: due at 49 (and at 600 had no
layer moved by then).
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kv_transfer.errors import ProtocolError
from kv_transfer.layout import KVLayout, StateLayout

# 2 adds "state" (hybrid models' state frames), 3 "start_by_s" / "transfer_s" (the clock starts with the transfer);
# leases of earlier versions still parse
LEASE_VERSION = 3
MAX_QUEUE_S = 3600.0  # the longest a lease waits for its transfer to start, whatever the front-end asks


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

    def transfer_s(self, num_bytes: int) -> float:
        """Seconds allowed to move ``num_bytes``."""
        assert num_bytes >= 0
        return self.base_s + num_bytes / self.min_rate_bps

    def deadline(self, num_bytes: int) -> float:
        """Absolute deadline (``time.time()`` seconds) for moving ``num_bytes`` from now."""
        return time.time() + self.transfer_s(num_bytes)

    def queued(self, num_bytes: int, start_by_s: float | None) -> dict[str, float | None]:
        """The deadline fields of a lease for ``num_bytes`` whose clock starts with its transfer, which must start
        by ``start_by_s`` (wall time; capped at ``MAX_QUEUE_S`` from now). ``start_by_s`` None: the clock starts at
        issue. Returns ``Lease`` keyword arguments: ``deadline_s``, ``start_by_s``, ``transfer_s``."""
        now, transfer = time.time(), self.transfer_s(num_bytes)
        if start_by_s is None or not math.isfinite(start_by_s) or start_by_s <= now:
            return {"deadline_s": now + transfer, "start_by_s": None, "transfer_s": None}
        return {"deadline_s": now + transfer, "start_by_s": min(start_by_s, now + MAX_QUEUE_S), "transfer_s": transfer}


DEFAULT_LEASE = LeasePolicy()


def transfer_deadline(num_bytes: int, *, base_s: float = DEFAULT_LEASE.base_s,
                      min_rate_bps: float = DEFAULT_LEASE.min_rate_bps) -> float:
    """``LeasePolicy(base_s, min_rate_bps).deadline(num_bytes)``: ``now + base_s + num_bytes / min_rate_bps``."""
    return LeasePolicy(base_s, min_rate_bps).deadline(num_bytes)


@dataclass(frozen=True)
class Lease:
    """The decode side's promise: blocks are reserved for ``request_id`` until ``deadline_s`` (absolute wall time),
    or, with ``start_by_s`` set, until ``transfer_s`` seconds after the transfer started, which must be by
    ``start_by_s`` (the module docstring; :meth:`due_s`).

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
    start_by_s: float | None = None  # wall time the transfer must start by (None: the clock runs from issue)
    transfer_s: float | None = None  # with start_by_s: seconds from the transfer's start to its deadline

    def __post_init__(self) -> None:
        if (self.start_by_s is None) != (self.transfer_s is None):
            raise ValueError("Lease.start_by_s and Lease.transfer_s come together")
        if self.transfer_s is not None and not (self.transfer_s > 0 and math.isfinite(self.transfer_s)):
            raise ValueError(f"Lease.transfer_s must be a finite number > 0, got {self.transfer_s!r}")
        if not self.request_id or not isinstance(self.request_id, str):
            raise ValueError(f"Lease.request_id must be a non-empty str, got {self.request_id!r}")
        if not isinstance(self.num_blocks, int) or self.num_blocks <= 0:
            raise ValueError(f"Lease.num_blocks must be a positive int, got {self.num_blocks!r}")

    def due_s(self, started_at: float | None) -> float:
        """The deadline (wall time) of a transfer under this lease that started at ``started_at`` (None: not yet)."""
        if self.start_by_s is None:
            return self.deadline_s
        return self.start_by_s if started_at is None else started_at + self.transfer_s

    @property
    def max_payload_bytes(self) -> int:
        """The largest frame payload a transfer under this lease can carry: one layer's K and V for all its blocks,
        or one state frame, uncompressed, twice over (codec headroom) plus 1 MiB. A receiver allocates no more for
        a frame's payload before it has read and checked the frame."""
        state = 0 if self.state is None else self.state.frame_nbytes
        return 2 * max(self.layout.layer_nbytes(self.num_blocks), state) + (1 << 20)

    @property
    def latest_s(self) -> float:
        """The latest the transfer can end under this lease (bounds a transport's call)."""
        return self.deadline_s if self.start_by_s is None else self.start_by_s + self.transfer_s

    def to_dict(self) -> dict[str, Any]:
        return {"version": LEASE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Lease:
        """Inverse of :meth:`to_dict`; raises :class:`ProtocolError` for an unknown version or a malformed dict."""
        if not isinstance(d, dict) or d.get("version") not in (1, 2, LEASE_VERSION):
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
