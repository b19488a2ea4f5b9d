"""Prometheus metrics of the serving front-end (one registry per server, served at ``/metrics``).

Request outcomes are counted per API (``grpc``, ``http``) and outcome (``ok``, ``invalid``, ``unauthenticated``,
``overloaded``, ``unavailable``, ``timeout``, ``cancelled``, ``aborted``, ``error``), and requests refused up front
(429 / RESOURCE_EXHAUSTED, :meth:`Metrics.observe_error`) also by reason (``rate_limit_exceeded``: the concurrency
cap, ``out_of_kv_blocks``, ``prefill_overloaded``: the prefill pool would not reach it before its timeout); latencies
are histograms from the request timeline; KV blocks and in-flight requests are read when scraped.

Where each family comes from:

* per request (:meth:`Metrics.observe_finished`, on the server's loop): TTFT / TPOT / latency / queue histograms,
  KV transfer bytes, wire bytes and seconds per transport; GB/s and compression ratio (bytes / wire bytes) are
  derived from those sums when scraped;
* the cluster (:meth:`Metrics.attach_cluster`): pool sizes, respawns and workers given up by the pool healer
  when scraped (front-end counters, no remote call);
  per-worker queue depths, KV use and KV bytes (pool and decode mirror apart; their sum over workers), expert
  balancedness and pre-warm hits from a :class:`ClusterSampler` snapshot
  that a background thread refreshes every ``refresh_s`` (``status()`` is a blocking Ray call, never made on a
  scrape);
* the autoscaler (:meth:`Metrics.observe_decision`): decisions by pool and direction;
* the GPUs (:class:`~cluster.serve.gpu_metrics.GPUCollector`): memory and utilisation via pynvml when scraped; without pynvml or a GPU, no
  series and no error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cluster.control import cluster_ops
from cluster.serve.gpu_metrics import GPUCollector

if TYPE_CHECKING:
    from cluster.serve.errors import ErrorInfo

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
RECENT_REQUESTS = 4096  # finished requests kept for the autoscaler's latency percentiles


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, kv_blocks: Callable[[], Iterable[tuple[str, int, int]]], in_flight: Callable[[], int]) -> None:
        """``kv_blocks()`` yields ``(decode worker id, free blocks, total blocks)``; ``in_flight()`` counts
        requests being served."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("duet_requests", "Generate requests by API and outcome", ["api", "outcome"],
                                registry=r)
        self.refused = Counter("duet_requests_refused", "Requests refused up front (429 / RESOURCE_EXHAUSTED) by "
                               "reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("duet_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("duet_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("duet_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram("duet_time_per_output_token_seconds", "First to last token / (tokens - 1)",
                              registry=r, buckets=_TPOT_BUCKETS)
        self.e2e = Histogram("duet_request_duration_seconds", "Arrival to last token", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.queue = Histogram("duet_queue_seconds", "Arrival to accepted by a prefill worker", registry=r,
                               buckets=_LATENCY_BUCKETS)
        self.ttft_stage = Histogram("duet_ttft_stage_seconds", "Time to first token by stage (the request timeline's "
                                    "ttft_breakdown; stages add up to the TTFT)", ["stage"], registry=r,
                                    buckets=_STAGE_BUCKETS)
        self.kv_bytes = Counter("duet_kv_transfer_bytes", "KV bytes moved prefill -> decode (after decoding)",
                                registry=r)
        self.kv_seconds = Histogram("duet_kv_transfer_seconds", "KV transfer time per request", registry=r,
                                    buckets=_LATENCY_BUCKETS)
        self.decisions = Counter("duet_autoscale_decisions", "Autoscaling decisions that changed a pool",
                                 ["pool", "direction"], registry=r)
        self.head_events = Counter("duet_ray_head_events", "Ray head losses and rebuilds on fresh workers "
                                   "(cluster.serve.head_watch)", ["event"], registry=r)
        self.available = Gauge("duet_cluster_available", "1 while the cluster takes requests, 0 while its Ray head is "
                               "lost or being replaced", registry=r)
        self.available.set(1)
        self.in_flight = Gauge("duet_requests_in_flight", "Requests being served", registry=r)
        self.in_flight.set_function(in_flight)
        self.transfers = _TransferCollector()
        self.recent = RecentRequests()
        self.sampler: ClusterSampler | None = None
        r.register(_KVCollector(kv_blocks))
        r.register(self.transfers)
        r.register(GPUCollector())

    def attach_cluster(self, cluster: Any, refresh_s: float = 5.0) -> ClusterSampler:
        """Export the cluster's pool sizes, worker queues, KV use and expert summary; returns the sampler (its
        thread is the caller's to :meth:`~ClusterSampler.start` and :meth:`~ClusterSampler.stop`)."""
        assert self.sampler is None, "a cluster is already attached"
        self.sampler = ClusterSampler(cluster, refresh_s)
        self._collector = _ClusterCollector(cluster, self.sampler)
        self.registry.register(self._collector)
        return self.sampler

    def swap_cluster(self, cluster: Any) -> None:
        """Export ``cluster`` instead of the attached one (the same sampler thread; its snapshot starts empty)."""
        assert self.sampler is not None, "no cluster attached"
        self.sampler.cluster = self._collector.cluster = cluster
        self.sampler.workers, self.sampler.experts = [], None

    def observe_finished(self, timeline: dict, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        ttft = timeline.get("ttft_s") or None
        tpot = timeline.get("decode_s", 0.0) / (completion_tokens - 1) if completion_tokens > 1 else None
        if ttft:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
        self.recent.add(ttft, tpot)
        self.e2e.observe(timeline.get("total_s", 0.0))
        self.queue.observe(timeline.get("queue_s", 0.0))
        for stage, seconds in (timeline.get("ttft_breakdown") or {}).items():
            self.ttft_stage.labels(stage.removesuffix("_s")).observe(seconds)
        kv = timeline.get("kv_transfer") or {}
        if kv.get("bytes"):
            self.kv_bytes.inc(kv["bytes"])
            self.kv_seconds.observe(kv.get("seconds", 0.0))
            self.transfers.add(kv)

    def observe_decision(self, pool: str, delta: int) -> None:
        """One autoscaling decision that added (``delta > 0``) or drained (``< 0``) workers of ``pool``."""
        if delta:
            self.decisions.labels(pool, "up" if delta > 0 else "down").inc()

    def observe_error(self, info: ErrorInfo) -> None:
        """A failed request's report (:func:`cluster.serve.errors.classify`): a refusal (429) counts under its
        reason, the report's code."""
        if info.http_status == 429:
            self.refused.labels(info.openai_code or info.outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RecentRequests:
    """The TTFT and TPOT of recently finished requests, with their finish times (``time.monotonic()``); written on
    the server's loop, read by the autoscaler's thread."""

    def __init__(self, maxlen: int = RECENT_REQUESTS) -> None:
        self._rows: deque[tuple[float, float | None, float | None]] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def add(self, ttft_s: float | None, tpot_s: float | None, now: float | None = None) -> None:
        with self._lock:
            self._rows.append((time.monotonic() if now is None else now, ttft_s, tpot_s))

    def since(self, t: float) -> list[tuple[float, float | None, float | None]]:
        """``(finished_at, ttft_s, tpot_s)`` of the requests finished at or after ``t``."""
        with self._lock:
            return [row for row in self._rows if row[0] >= t]


class _TransferCollector:
    """KV transfer sums per transport; GB/s (bytes / seconds) and compression ratio (bytes / wire bytes) derived."""

    def __init__(self) -> None:
        self._sums: dict[str, list[float]] = {}  # transport -> [bytes, wire bytes, seconds, transfers]
        self._lock = threading.Lock()

    def add(self, kv: dict) -> None:
        nbytes = float(kv.get("bytes", 0))
        wire = float(kv.get("wire_bytes", nbytes))
        with self._lock:
            s = self._sums.setdefault(str(kv.get("transport", "unknown")), [0.0, 0.0, 0.0, 0.0])
            s[0] += nbytes
            s[1] += wire
            s[2] += float(kv.get("seconds", 0.0))
            s[3] += 1

    def collect(self):
        with self._lock:
            sums = {k: list(v) for k, v in self._sums.items()}
        labels = ["transport"]
        fams = {
            "bytes": CounterMetricFamily("duet_kv_transport_bytes", "KV bytes moved (decoded size) by transport",
                                         labels=labels),
            "wire": CounterMetricFamily("duet_kv_transport_wire_bytes", "KV bytes on the wire (after compression)",
                                        labels=labels),
            "seconds": CounterMetricFamily("duet_kv_transport_seconds", "KV transfer time by transport",
                                           labels=labels),
            "count": CounterMetricFamily("duet_kv_transport_transfers", "KV transfers by transport", labels=labels),
            "gbps": GaugeMetricFamily("duet_kv_transfer_gbps", "Mean KV transfer rate, GB/s (bytes / seconds)",
                                      labels=labels),
            "ratio": GaugeMetricFamily("duet_kv_compression_ratio", "KV bytes / wire bytes (1 = uncompressed)",
                                       labels=labels),
        }
        for transport, (nbytes, wire, seconds, count) in sorted(sums.items()):
            fams["bytes"].add_metric([transport], nbytes)
            fams["wire"].add_metric([transport], wire)
            fams["seconds"].add_metric([transport], seconds)
            fams["count"].add_metric([transport], count)
            if seconds > 0:
                fams["gbps"].add_metric([transport], nbytes / seconds / 1e9)
            if wire > 0:
                fams["ratio"].add_metric([transport], nbytes / wire)
        yield from fams.values()


class ClusterSampler:
    """A snapshot of ``cluster.status()`` and ``cluster.expert_summary()``, refreshed every ``refresh_s`` on its own
    thread between :meth:`start` and :meth:`stop` (or by hand with :meth:`refresh`). A failing refresh keeps the
    previous snapshot and logs at debug level (the cluster may be shutting down)."""

    def __init__(self, cluster: Any, refresh_s: float = 5.0) -> None:
        assert refresh_s > 0, refresh_s
        self.cluster, self.refresh_s = cluster, refresh_s
        self.workers: list[dict] = []
        self.experts: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> None:
        try:
            workers = self.cluster.status()
            experts = self.cluster.expert_summary()
        except Exception as e:  # noqa: BLE001 - metrics must never take the server down
            logger.debug("cluster metrics refresh failed: %s", e)
            return
        self.workers, self.experts = workers, experts

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="duet-metrics", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        self.refresh()
        while not self._stop.wait(self.refresh_s):
            self.refresh()


_WORKER_GAUGES = (  # stats field, metric, help, roles that report it
    ("waiting", "duet_worker_waiting", "Requests waiting on the worker", ("prefill",)),
    ("running", "duet_worker_running", "Requests running on the worker", ("prefill", "decode")),
    ("receiving", "duet_worker_receiving", "Requests whose KV is being received", ("decode",)),
    ("outstanding_tokens", "duet_prefill_outstanding_tokens",
     "Prompt tokens admitted and not yet past their first token (the router's load signal)", ("prefill",)),
    ("prompt_tokens", "duet_prefill_prompt_tokens", "Prompt tokens of the prompts the worker finished", ("prefill",)),
    ("cached_tokens", "duet_prefill_cached_tokens", "Of those, tokens found in its prefix cache", ("prefill",)),
    ("kv_pool_bytes", "duet_kv_pool_bytes", "Bytes of the worker's paged KV pool", ("prefill", "decode")),
    ("kv_mirror_bytes", "duet_kv_mirror_bytes",
     "Bytes of the worker's decode KV mirror (a second, contiguous copy of decoding sequences' KV)",
     ("prefill", "decode")),
    ("kv_state_bytes", "duet_kv_state_bytes", "Bytes of the worker's GDN state slots (hybrid models; 0 otherwise)",
     ("prefill", "decode")),
    ("vision_cache_bytes", "duet_vision_cache_bytes",
     "Bytes of the encoded images the worker keeps for reuse (bounded by vision_cache_mb)", ("prefill",)),
    ("vision_cache_entries", "duet_vision_cache_entries", "Encoded images the worker keeps for reuse", ("prefill",)),
    ("kv_text_bytes", "duet_kv_text_bytes", "Bytes of the pool's blocks sequences hold, plain (the static region)",
     ("prefill", "decode")),
    ("kv_visual_bytes", "duet_kv_visual_bytes",
     "Bytes of the pool lent as pages of coded image KV (visual_kv_cache int8; the elastic region)", ("decode",)),
    ("encoder_workspace_bytes", "duet_encoder_workspace_bytes",
     "Bytes of the budget kept for the vision tower's workspace (encoder_workspace_mb)", ("prefill",)),
)


class _ClusterCollector:
    def __init__(self, cluster: Any, sampler: ClusterSampler) -> None:
        self.cluster, self.sampler = cluster, sampler

    def collect(self):
        pools = GaugeMetricFamily("duet_pool_workers", "Workers taking requests per pool", labels=["pool"])
        for pool, n in self.cluster.pool_sizes().items():
            pools.add_metric([pool], n)
        yield pools
        yield from self._healing(self.cluster.healing())
        yield from self._workers(self.sampler.workers)
        yield from self._prefix(self.sampler.workers)
        if self.sampler.workers:
            kv = cluster_ops.kv_memory_summary(self.sampler.workers)
            yield GaugeMetricFamily("duet_kv_memory_bytes", "KV bytes attention reads, all alive workers: paged "
                                    "pools plus decode mirrors", value=kv["total_bytes"])
        yield from self._experts(self.sampler.experts)

    @staticmethod
    def _prefix(rows: list[dict]):
        summary = cluster_ops.prefix_summary([r for r in rows if r["alive"]])
        if summary["hit_rate"] is not None:
            yield GaugeMetricFamily("duet_prefix_cache_hit_rate", "Prefill workers' prefix-cache hits: cached / "
                                    "prompt tokens of the prompts they finished", value=summary["hit_rate"])
        if summary["predicted_hit_rate"] is not None:
            yield GaugeMetricFamily("duet_prefix_cache_predicted_hit_rate", "The router's predicted cached / "
                                    "placed prompt tokens", value=summary["predicted_hit_rate"])

    @staticmethod
    def _healing(h: dict):
        """The pool healer's counts (:meth:`cluster.control.cluster_ops.cluster_ops.healing`; front-end state, no remote call)."""
        respawns = CounterMetricFamily("duet_worker_respawns", "Dead workers replaced by a fresh actor",
                                       labels=["role"])
        given_up = GaugeMetricFamily("duet_workers_given_up", "Workers that kept dying and are no longer respawned "
                                     "(> 0: the pool runs short)", labels=["role"])
        for role, n in h["respawns"].items():
            respawns.add_metric([role], n)
        for role, ids in h["given_up"].items():
            given_up.add_metric([role], len(ids))
        yield respawns
        yield given_up

    @staticmethod
    def _workers(rows: list[dict]):
        alive = GaugeMetricFamily("duet_worker_alive", "1 if the worker answered its last status call",
                                  labels=["worker", "role"])
        fams = {field: GaugeMetricFamily(name, doc, labels=["worker", "role"])
                for field, name, doc, _ in _WORKER_GAUGES}
        kv_used = GaugeMetricFamily("duet_kv_used_blocks", "KV blocks in use per decode worker", labels=["worker"])
        kv_util = GaugeMetricFamily("duet_kv_utilization", "Fraction of KV blocks in use per decode worker",
                                    labels=["worker"])
        for row in rows:
            wid, role = row["worker_id"], row["role"]
            alive.add_metric([wid, role], 1.0 if row["alive"] else 0.0)
            if not row["alive"]:
                continue
            for field, _, _, roles in _WORKER_GAUGES:
                if role in roles and field in row:
                    fams[field].add_metric([wid, role], row[field])
            total = row.get("total_blocks", 0)
            if role == "decode" and total:
                used = total - row.get("free_blocks", total)
                kv_used.add_metric([wid], used)
                kv_util.add_metric([wid], used / total)
        yield alive
        yield from fams.values()
        yield kv_used
        yield kv_util

    @staticmethod
    def _experts(summary: dict | None):
        if summary is None:
            return  # no expert parallelism nor tiered expert memory: nothing to say
        if summary.get("balancedness") is not None:
            yield GaugeMetricFamily("duet_expert_balancedness", "Mean / max expert load, mean over EP groups "
                                    "(1 = even)", value=summary["balancedness"])
        yield CounterMetricFamily("duet_expert_placement_changes", "Expert placement changes",
                                  value=summary.get("placement_changes", 0))
        hits, misses = summary.get("prewarm_hits"), summary.get("prewarm_misses")
        if hits is not None and misses is not None:
            yield CounterMetricFamily("duet_expert_prewarm_hits", "Expert accesses that found the expert resident",
                                      value=hits)
            yield CounterMetricFamily("duet_expert_prewarm_misses", "Expert accesses that stalled on a load",
                                      value=misses)
            if hits + misses:
                yield GaugeMetricFamily("duet_expert_prewarm_hit_rate", "hits / (hits + misses)",
                                        value=hits / (hits + misses))


class _KVCollector:
    def __init__(self, kv_blocks: Callable[[], Iterable[tuple[str, int, int]]]) -> None:
        self.kv_blocks = kv_blocks

    def collect(self):
        free = GaugeMetricFamily("duet_kv_free_blocks", "Free KV blocks per decode worker", labels=["worker"])
        total = GaugeMetricFamily("duet_kv_total_blocks", "KV blocks per decode worker", labels=["worker"])
        for worker, n_free, n_total in self.kv_blocks():
            free.add_metric([worker], n_free)
            total.add_metric([worker], n_total)
        yield free
        yield total
