"""The batch API's result (:meth:`DisaggCluster.generate_batch <cluster.control.disagg.DisaggCluster.generate_batch>`):
one request's deltas folded into a :class:`Completion` with its timings."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from cluster.control.delta import Delta
from cluster.control.timeline import RequestClock


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    attempts: int = 1
    expert_hist: list[list[int]] | None = None
    kv_transfer: dict | None = None  # transport, bytes, layers, seconds, exposed_seconds
    timeline: dict | None = None  # cluster.control.timeline.RequestClock.timeline: queue_s, prefill_s, decode_s, workers, ...


async def collect(items: AsyncIterator[Delta], prompt_token_ids: list[int], tokenizer: Any | None) -> Completion:
    """Consume one request's deltas (the cluster's ``_serve`` stream) into its :class:`Completion` (choice 0 only);
    TTFT and TPOT are timed from this call. Errors of the stream propagate."""
    c = Completion(request_id="", prompt_token_ids=prompt_token_ids)
    t0 = time.perf_counter()
    last = t0
    clock = RequestClock(arrival=time.monotonic())
    async for d in items:
        if d.index:
            continue  # a Completion is one choice: the first
        now = time.perf_counter()
        clock.observe(d)
        if d.token_ids and c.ttft_s is None:
            c.ttft_s = now - t0
        c.token_ids.extend(d.token_ids)
        c.request_id, c.attempts, last = d.request_id, d.attempt, now
        c.expert_hist = d.expert_hist or c.expert_hist
        c.kv_transfer = d.kv_transfer or c.kv_transfer
        if d.finished:
            c.finish_reason = d.finish_reason
    if c.ttft_s is not None and len(c.token_ids) > 1:
        c.tpot_s = (last - t0 - c.ttft_s) / (len(c.token_ids) - 1)
    c.timeline = clock.timeline(c.kv_transfer, attempts=c.attempts)
    c.text = tokenizer.decode(c.token_ids) if tokenizer else ""
    return c
