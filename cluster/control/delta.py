"""What the cluster streams to its consumers for one request: typed deltas.

A decode worker's :class:`~node_common.events.TokenEvent` (new tokens of one choice) becomes a :class:`Delta` on its
way out of :meth:`DisaggCluster.generate / stream <cluster.control.disagg.DisaggCluster.stream>`: the same fields,
plus the attempt that produced it and, on the request's first delta with tokens, where it runs
(:class:`WorkerPair`). Consumers (:mod:`cluster.serve.service`, :mod:`cluster.control.completion`,
:mod:`cluster.control.timeline`) read the fields; nothing is looked up by key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from node_common.events import TokenEvent


@dataclass(frozen=True)
class WorkerPair:
    """Where a request runs, and when (``time.monotonic()``) its attempt got there: ``admitted_at`` admitted to
    the prefill worker, ``allocated_at`` its decode lease granted, ``accepted_at`` the prefill worker took it."""

    accepted_at: float
    prefill_worker: str
    decode_worker: str
    admitted_at: float | None = None
    allocated_at: float | None = None

    def workers(self) -> dict[str, str]:
        """``{"prefill_worker": ..., "decode_worker": ...}`` (the timeline's worker fields)."""
        return {"prefill_worker": self.prefill_worker, "decode_worker": self.decode_worker}


@dataclass(frozen=True)
class Delta(TokenEvent):
    """A :class:`~node_common.events.TokenEvent` as the cluster yields it. ``attempt``: 1, or 2 for a retry on
    another pair (only before any token was streamed). ``placement``: on the first delta that carries tokens, else
    None."""

    attempt: int = 1
    placement: WorkerPair | None = None

    @classmethod
    def of(cls, event: TokenEvent, *, attempt: int, placement: WorkerPair | None = None) -> Delta:
        return cls(**{f.name: getattr(event, f.name) for f in fields(TokenEvent)}, attempt=attempt,
                   placement=placement)
