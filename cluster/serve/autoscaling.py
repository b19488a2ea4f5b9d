"""``duet serve``'s autoscaling loop: :class:`cluster.control.autoscale.Autoscaler` fed by the server's own metrics and
applying its decisions to the :class:`~cluster.control.disagg.DisaggCluster` it serves.

Each step (every ``policy.interval_s``, on its own thread) appends one sample to the window
:func:`cluster.control.autoscale.decide` reads:

* ``ttft_p90_s``, ``tpot_p90_s``: p90 over the requests that finished in the last ``horizon_s``; ``0.0`` when none
  finished and none is in flight (an idle pool is under every latency target), ``None`` (no signal) when requests
  are in flight but none finished yet;
* ``queued_prefill_tokens``: prompt tokens admitted to prefill workers and not yet past their first token (the
  front-end's own counters: no remote call);
* ``kv_utilization``: mean fraction of KV blocks in use over the live decode workers (front-end counters).

Samples older than the longest stabilization window (plus one interval) are dropped. A step that raises (a worker
that cannot start, the last worker of a pool) is logged and the loop goes on; it is retried at the next interval.
Every decision that changes a pool is counted in ``duet_autoscale_decisions_total{pool, direction}``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from cluster.control.autoscale import Action, Autoscaler, Decision, Policy
from cluster.serve.metrics import Metrics

logger = logging.getLogger(__name__)


def p90(values: list[float]) -> float:
    """The nearest-rank 90th percentile (``values`` not empty). Example: 1..10 -> 9."""
    assert values, "p90 of nothing"
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


class MetricsWindow:
    """The autoscaler's metrics source: call it to append a sample for now and get the window (time order)."""

    def __init__(self, cluster: Any, metrics: Metrics, policy: Policy, in_flight: Callable[[], int], *,
                 horizon_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster, self.metrics, self.in_flight, self.clock = cluster, metrics, in_flight, clock
        self.horizon_s = horizon_s
        self.keep_s = max(policy.prefill.stabilization_window_s, policy.decode.stabilization_window_s) + \
            policy.interval_s
        self.samples: list[dict] = []

    def __call__(self) -> list[dict]:
        now = self.clock()
        self.samples.append(self.sample(now))
        self.samples = [s for s in self.samples if s["t"] >= now - self.keep_s]
        return list(self.samples)

    def sample(self, now: float) -> dict:
        rows = self.metrics.recent.since(now - self.horizon_s)
        idle = not rows and self.in_flight() == 0
        ttfts = [r[1] for r in rows if r[1] is not None]
        tpots = [r[2] for r in rows if r[2] is not None]
        return {"t": now,
                "ttft_p90_s": p90(ttfts) if ttfts else (0.0 if idle else None),
                "tpot_p90_s": p90(tpots) if tpots else (0.0 if idle else None),
                "queued_prefill_tokens": sum(w.prefill_tokens for w in self.cluster.prefills if w.load.alive),
                "kv_utilization": self._kv_utilization()}

    def _kv_utilization(self) -> float | None:
        fractions = [1.0 - w.load.free_blocks / total for w in self.cluster.decodes
                     if w.load.alive and (total := self.cluster.total_blocks.get(w.load.worker_id, 0))]
        return sum(fractions) / len(fractions) if fractions else None


class AutoscaleLoop:
    """Runs an :class:`Autoscaler` over ``cluster`` on a daemon thread between :meth:`start` and :meth:`stop`."""

    def __init__(self, cluster: Any, policy: Policy, metrics: Metrics, in_flight: Callable[[], int], *,
                 horizon_s: float = 30.0) -> None:
        self.metrics = metrics
        self.window = MetricsWindow(cluster, metrics, policy, in_flight, horizon_s=horizon_s)
        self.autoscaler = Autoscaler(policy, cluster, self.window)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        assert self._thread is None, "already started"
        self._thread = threading.Thread(target=self._run, name="duet-autoscale", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop deciding. A worker start in progress (up to 300 s) is not interrupted; the thread is a daemon."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def step(self) -> Decision:
        decision = self.autoscaler.step()
        for d in decision.pools():
            if d.action is not Action.HOLD:
                logger.info("autoscale %s %+d: %s", d.role, d.delta, d.reason)
                self.metrics.observe_decision(d.role, d.delta)
        return decision

    def _run(self) -> None:
        while not self._stop.wait(self.autoscaler.policy.interval_s):
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - keep deciding; the next interval retries
                logger.warning("autoscaling step failed: %s", e)
