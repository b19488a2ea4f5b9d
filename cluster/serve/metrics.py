"""Prometheus metrics of the serving front-end (one registry per server, served at ``/metrics``).

Request outcomes are counted per API (``grpc``, ``http``) and outcome (``ok``, ``invalid``, ``unauthenticated``,
``overloaded``, ``unavailable``, ``timeout``, ``cancelled``, ``aborted``, ``error``); latencies are histograms
from the request timeline; KV blocks and in-flight requests are read when scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, kv_blocks: Callable[[], Iterable[tuple[str, int, int]]], in_flight: Callable[[], int]) -> None:
        """``kv_blocks()`` yields ``(decode worker id, free blocks, total blocks)``; ``in_flight()`` counts
        requests being served."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("duet_requests", "Generate requests by API and outcome", ["api", "outcome"],
                                registry=r)
        self.prompt_tokens = Counter("duet_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("duet_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("duet_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("duet_request_duration_seconds", "Arrival to last token", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.queue = Histogram("duet_queue_seconds", "Arrival to accepted by a prefill worker", registry=r,
                               buckets=_LATENCY_BUCKETS)
        self.kv_bytes = Counter("duet_kv_transfer_bytes", "KV bytes moved prefill -> decode (after decoding)",
                                registry=r)
        self.kv_seconds = Histogram("duet_kv_transfer_seconds", "KV transfer time per request", registry=r,
                                    buckets=_LATENCY_BUCKETS)
        self.in_flight = Gauge("duet_requests_in_flight", "Requests being served", registry=r)
        self.in_flight.set_function(in_flight)
        r.register(_KVCollector(kv_blocks))

    def observe_finished(self, timeline: dict, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if timeline.get("ttft_s"):
            self.ttft.observe(timeline["ttft_s"])
        self.e2e.observe(timeline.get("total_s", 0.0))
        self.queue.observe(timeline.get("queue_s", 0.0))
        kv = timeline.get("kv_transfer") or {}
        if kv.get("bytes"):
            self.kv_bytes.inc(kv["bytes"])
            self.kv_seconds.observe(kv.get("seconds", 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


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
