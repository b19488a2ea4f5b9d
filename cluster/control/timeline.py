"""Where one request's time went, from the front-end's clock (``time.monotonic()``), as the client API reports it.

A request's deltas (:class:`cluster.control.delta.Delta`) carry what the front-end can see: the first delta
with tokens has ``placement`` (when the prefill worker accepted it, and which workers serve it) and the decode
worker's ``kv_transfer`` stats (bytes, layers, seconds, exposed_seconds). :class:`RequestClock` turns the arrival
time, those, and the arrival times of the first and last token into stage durations:

* ``queue_s``   arrival -> accepted by a prefill worker (validation, placement, KV lease, admission)
* ``prefill_s`` accepted -> prompt KV computed: first token minus the transfer time prefill did not hide
* ``decode_s``  first token -> last token
* ``ttft_s``, ``total_s`` arrival -> first / last token

Worked example: arrival 10.0, accepted 10.2, first token 10.9 with 0.1 s of exposed transfer, last token 11.5 ->
queue 0.2, prefill 0.6, decode 0.6, ttft 0.9, total 1.5.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.control.delta import Delta


@dataclass
class RequestClock:
    arrival: float
    preprocess_s: float = 0.0
    accepted_at: float | None = None
    first_token_at: float | None = None
    last_at: float | None = None
    workers: dict[str, str] = field(default_factory=dict)

    def observe(self, delta: Delta, now: float | None = None) -> None:
        """Record one delta of the request's stream (call as it arrives)."""
        now = time.monotonic() if now is None else now
        if delta.placement is not None:
            self.accepted_at = delta.placement.accepted_at
            self.workers = delta.placement.workers()
        if delta.token_ids and self.first_token_at is None:
            self.first_token_at = now
        self.last_at = now

    def timeline(self, kv_transfer: dict | None, *, attempts: int = 1) -> dict:
        """Stage durations in seconds (0.0 for a stage the request never reached)."""
        exposed = float((kv_transfer or {}).get("exposed_seconds", 0.0))
        accepted = self.accepted_at if self.accepted_at is not None else self.arrival
        first = self.first_token_at
        last = self.last_at if self.last_at is not None else self.arrival
        return {
            "queue_s": max(0.0, accepted - self.arrival) if self.accepted_at is not None else 0.0,
            "preprocess_s": self.preprocess_s,
            "prefill_s": max(0.0, first - accepted - exposed) if first is not None else 0.0,
            "decode_s": max(0.0, last - first) if first is not None else 0.0,
            "ttft_s": first - self.arrival if first is not None else 0.0,
            "total_s": max(0.0, last - self.arrival),
            "attempts": attempts,
            **self.workers,
        }
