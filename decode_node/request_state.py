"""What a decode worker keeps per request (one :class:`DecodeRequest`), what one loop iteration produced
(:class:`StepReport`), and how that becomes the typed events the front-end polls (:func:`step_events`).

A request's record is added by ``DecodeWorker.allocate`` and removed in one place (``DecodeWorker._forget``) when
the request finishes, is aborted or fails; nothing else about a request is kept beside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine import RequestOutput
from engine.outputs import RequestMetrics
from kv_transfer import KVReceiver, Lease
from node_common.events import DecodeEvent, RequestFailed, TokenEvent


@dataclass
class TransferClock:
    """When a request's KV arrived and how much of it (written by the sinks, on the transport's thread)."""

    started_s: float = field(default_factory=time.time)
    first_s: float | None = None
    last_s: float | None = None
    nbytes: int = 0
    layers: int = 0
    state_bytes: int = 0  # hybrid models' GDN state frames (apart from the KV bytes)
    state_frames: int = 0

    def on_layer(self, nbytes: int) -> None:
        now = time.time()
        self.first_s = self.first_s or now
        self.last_s, self.nbytes, self.layers = now, self.nbytes + nbytes, self.layers + 1

    def on_state(self, nbytes: int) -> None:
        self.state_bytes += nbytes
        self.state_frames += 1


@dataclass
class Reported:
    """What the front-end was told of a request's choices so far."""

    tokens: dict[int, int] = field(default_factory=dict)  # choice -> tokens reported
    ended: set[int] = field(default_factory=set)  # choices whose end was reported


@dataclass
class DecodeRequest:
    """One request on a decode worker, from ``allocate`` until it finishes, is aborted or fails.

    ``receiver`` is its transfer while the KV is arriving (RECEIVING) and None once committed to the batch. A
    request this worker prefills itself (``local``: ``DecodeWorker.admit_local``) has neither lease nor receiver.
    """

    request_id: str
    lease: Lease | None
    receiver: KVReceiver | None
    clock: TransferClock
    reported: Reported = field(default_factory=Reported)

    @property
    def local(self) -> bool:
        """Prefilled here (``admit_local``): no lease was issued for it."""
        return self.lease is None

    @property
    def receiving(self) -> bool:
        return self.receiver is not None


@dataclass
class StepReport:
    """What one loop iteration produced: token outputs, failures (request id -> reason), the committed requests'
    routing hints and transfer figures, and -- once the worker finished the iteration -- the events to publish."""

    outputs: list[RequestOutput] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    # request id -> reason: the request's own fault (engine.isolation; an error hand-off), which another pair would
    # meet too -- reported as not retryable
    errors: dict[str, str] = field(default_factory=dict)
    routing_hints: dict[str, list[list[int]]] = field(default_factory=dict)
    transfers: dict[str, dict] = field(default_factory=dict)  # kv_transfer stats of requests committed now
    events: list[DecodeEvent] = field(default_factory=list)


def step_events(report: StepReport, requests: dict[str, DecodeRequest]) -> list[DecodeEvent]:
    """The events of ``report``: one :class:`RequestFailed` per failure, then per output one :class:`TokenEvent`
    per choice with news, advancing each request's :class:`Reported`. Only a request's last event says
    ``finished`` (a consumer stops reading there). Pure but for the records' ``reported``."""
    events: list[DecodeEvent] = [RequestFailed(rid, why) for rid, why in report.failed.items()]
    events += [RequestFailed(rid, why, retryable=False) for rid, why in report.errors.items()]
    ended: set[str] = set()
    for out in report.outputs:
        rid = out.request_id
        if rid in ended:
            continue  # an n > 1 commit returns one finished output per choice, each holding every choice
        record = requests.get(rid)
        seen = record.reported if record is not None else Reported()
        fresh = [(c, seen.tokens.get(c.index, 0)) for c in out.outputs if c.index not in seen.ended]
        for i, (c, start) in enumerate(fresh):
            extra = {}
            if c.logprobs is not None:
                # the engine's list, which a later step of the same report may have grown: cut at the tokens
                extra["logprobs"] = [lp.to_wire() for lp in c.logprobs[start:len(c.token_ids)]]
            if c.index == 0 and start == 0 and out.prompt_logprobs is not None:
                extra["prompt_logprobs"] = [None if x is None else x.to_wire() for x in out.prompt_logprobs]
            if c.index == 0:
                extra["expert_hist"] = report.routing_hints.get(rid)
                extra["kv_transfer"] = report.transfers.get(rid)
            events.append(TokenEvent(rid, c.index, c.token_ids[start:], finished=out.finished and i == len(fresh) - 1,
                                     choice_finished=c.finished, finish_reason=c.finish_reason, **extra))
            seen.tokens[c.index] = len(c.token_ids)
            if c.finished:
                seen.ended.add(c.index)
        if out.finished:
            ended.add(rid)
    return events


def local_stats(m: RequestMetrics) -> dict:
    """The first token event's ``kv_transfer`` of a request prefilled on its decode worker: nothing moved; the
    prefill stages (:mod:`cluster.control.timeline`) on this worker's clock."""
    start = m.first_scheduled_time if m.first_scheduled_time is not None else m.arrival_time
    done = m.first_token_time if m.first_token_time is not None else time.perf_counter()
    stages = {"prefill_queue_s": max(0.0, start - m.arrival_time), "vision_encode_s": 0.0,
              "prefill_compute_s": max(0.0, done - start)}
    return {"transport": "local", "bytes": 0, "layers": 0, "seconds": 0.0, "exposed_seconds": 0.0,
            "commit_seconds": 0.0, "state_bytes": 0, "state_frames": 0, "prefill_stages": stages}
