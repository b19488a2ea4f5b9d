"""Where one request's time went, from the front-end's clock (``time.monotonic()``), as the client API reports it.

A request's deltas (:class:`cluster.control.delta.Delta`) carry what the front-end can see: the first delta
with tokens has ``placement`` (when the attempt was admitted, got its decode lease and was accepted by the prefill
worker, and which workers serve it) and the decode worker's ``kv_transfer`` figures (bytes, layers, seconds,
exposed_seconds, commit_seconds, and the prefill worker's ``prefill_stages`` from the hand-off).
:class:`RequestClock` turns the arrival time, those, and the arrival times of the first and last token into stage
durations:

* ``queue_s``   arrival -> accepted by a prefill worker (validation, placement, KV lease, admission)
* ``prefill_s`` accepted -> prompt KV computed: first token minus the transfer time prefill did not hide
* ``vision_encode_s`` the vision-tower calls the request waited for on its prefill worker (part of ``prefill_s``)
* ``decode_s``  first token -> last token
* ``ttft_s``, ``total_s`` arrival -> first / last token

and ``ttft_breakdown``, the time to first token in consecutive stages that add up to ``ttft_s``:

* ``frontend_queue_s``     arrival -> admitted to a prefill worker (preprocessing, the wait for prefill room, and
  a failed first attempt)
* ``decode_allocate_s``    admitted -> decode lease granted (the ``allocate`` call)
* ``prefill_submit_s``     lease -> the prefill worker took the request (the ``submit`` call, less its reply's
  overlap with the prefill stages: the prefill worker's clock starts when it queues the request)
* ``prefill_queue_s``      taken -> first scheduled by the prefill engine (prefill worker's clock)
* ``vision_encode_s``      the vision-tower calls it waited for (prefill worker's clock)
* ``prefill_compute_s``    the rest of first scheduled -> last layer's KV computed (prefill worker's clock)
* ``transfer_exposed_s``   last layer computed -> last layer received by the decode worker
* ``decode_commit_s``      last layer received -> first token published by the decode worker (the hand-off frame,
  the decode loop's turn)
* ``first_token_streamed_s`` the rest of ``ttft_s``: the decode poll's reply and the hand-over to the API (also the
  prefill stages when a worker does not report them)

Worked example: arrival 10.0, admitted 10.05, lease 10.07, accepted 10.2, first token 10.9; the prefill worker
reports queue 0.1, vision 0.2, compute 0.25 and the decode worker 0.1 s exposed and 0.05 s commit -> queue 0.2,
prefill 0.6, decode 0.6 (last token 11.5), ttft 0.9, total 1.5; breakdown 0.05 + 0.02 + 0.13 + 0.1 + 0.2 + 0.25 + 0.1 +
0.05 + the rest 0.0 = 0.9. Had the prefill worker reported compute 0.3 (the submit reply overlapping its first
0.05 s), submit would be 0.08 and the sum still 0.9; the rest is never below 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.control.delta import Delta

PREFILL_STAGES = ("prefill_queue_s", "vision_encode_s", "prefill_compute_s")  # the prefill worker's, in order
BREAKDOWN = ("frontend_queue_s", "decode_allocate_s", "prefill_submit_s", *PREFILL_STAGES, "transfer_exposed_s",
             "decode_commit_s", "first_token_streamed_s")  # ttft_breakdown's keys, in order


@dataclass
class RequestClock:
    arrival: float
    preprocess_s: float = 0.0
    accepted_at: float | None = None
    admitted_at: float | None = None
    allocated_at: float | None = None
    first_token_at: float | None = None
    last_at: float | None = None
    workers: dict[str, str] = field(default_factory=dict)

    def observe(self, delta: Delta, now: float | None = None) -> None:
        """Record one delta of the request's stream (call as it arrives)."""
        now = time.monotonic() if now is None else now
        if delta.placement is not None:
            self.accepted_at = delta.placement.accepted_at
            self.admitted_at, self.allocated_at = delta.placement.admitted_at, delta.placement.allocated_at
            self.workers = delta.placement.workers()
        if delta.token_ids and self.first_token_at is None:
            self.first_token_at = now
        self.last_at = now

    def timeline(self, kv_transfer: dict | None, *, attempts: int = 1) -> dict:
        """Stage durations in seconds (0.0 for a stage the request never reached)."""
        kv = kv_transfer or {}
        exposed = float(kv.get("exposed_seconds", 0.0))
        stages = kv.get("prefill_stages") or {}
        accepted = self.accepted_at if self.accepted_at is not None else self.arrival
        first = self.first_token_at
        last = self.last_at if self.last_at is not None else self.arrival
        return {
            "queue_s": max(0.0, accepted - self.arrival) if self.accepted_at is not None else 0.0,
            "preprocess_s": self.preprocess_s,
            "prefill_s": max(0.0, first - accepted - exposed) if first is not None else 0.0,
            "vision_encode_s": float(stages.get("vision_encode_s", 0.0)),
            "decode_s": max(0.0, last - first) if first is not None else 0.0,
            "ttft_s": first - self.arrival if first is not None else 0.0,
            "total_s": max(0.0, last - self.arrival),
            "attempts": attempts,
            "ttft_breakdown": self._breakdown(kv, stages),
            **self.workers,
        }

    def _breakdown(self, kv: dict, stages: dict) -> dict[str, float]:
        """``ttft_breakdown`` (see the module docstring); empty until the first token and placement arrived."""
        if self.first_token_at is None or self.accepted_at is None:
            return {}
        admitted = self.admitted_at if self.admitted_at is not None else self.accepted_at
        allocated = self.allocated_at if self.allocated_at is not None else admitted
        parts = {
            "frontend_queue_s": max(0.0, admitted - self.arrival),
            "decode_allocate_s": max(0.0, allocated - admitted),
            "prefill_submit_s": max(0.0, self.accepted_at - allocated),
            **{k: max(0.0, float(stages.get(k, 0.0))) for k in PREFILL_STAGES},
            "transfer_exposed_s": max(0.0, float(kv.get("exposed_seconds", 0.0))),
            "decode_commit_s": max(0.0, float(kv.get("commit_seconds", 0.0))),
        }
        rest = (self.first_token_at - self.arrival) - sum(parts.values())
        if rest < 0:  # the prefill worker's clock starts inside the submit call: that overlap is the submit's
            parts["prefill_submit_s"] = max(0.0, parts["prefill_submit_s"] + rest)
        parts["first_token_streamed_s"] = max(0.0, (self.first_token_at - self.arrival) - sum(parts.values()))
        return parts
