"""The decode worker: reserves blocks for incoming requests, receives their KV, and decodes them in one continuous
batch.

Queues a request moves through: ``allocate`` (blocks reserved, lease issued, receiver registered) -> receiving
(layers land in the reserved blocks on the transport's thread, each verified first) -> committed when the receiver
reports SUCCESS and its hand-off (:mod:`kv_transfer.handoff`) checks out (the first token from prefill joins the
running batch; generated positions continue from the M-RoPE delta it carries) -> running (one token per step) ->
finished. A receiver that FAILS (checksum, missing layer, abort, expired lease, dead peer), or a hand-off that does not
parse or disagrees with the prompt, releases the blocks and the request surfaces as a failure for the router to
retry or report; no partially written cache is ever decoded.

With ``expert_parallel`` the worker is one rank of an expert-parallel group (:mod:`decode_node.expert_parallel`):
its loop calls :meth:`DecodeWorker.group_step` (one lockstep tick of the group) instead of :meth:`DecodeWorker.step`.
With ``expert_tiers`` (not with ``expert_parallel``) only some experts stay on the device
(:mod:`decode_node.expert_tiers`): committed requests' routing hints, and their departures, go to its pre-warm policy.

Prompts arrive processed (:mod:`node_common.prompt_wire`) and carry no image data: token ids, the images' content
hashes (this pool's prefix-cache block hashes key images by content, as the prefill side's do) and placeholder
positions, and the M-RoPE delta. So the decode side never recomputes an image prompt: when a preemption (pool full)
evicts a running request whose prompt has images, the engine drops it (``LLMEngine.cannot_recompute``) and this
worker fails it with :class:`PromptRecomputeUnavailable` -- a failure the front-end retries on another pair, like a
failed transfer. Keeping the pixels (or a reference to the prefill worker's) for a rare preemption would put image
data back on the decode wire for every request. Text-only prompts recompute here as before.

Per request the worker keeps one :class:`~decode_node.request_state.DecodeRequest` in ``requests`` (its lease, its
receiver while receiving, its transfer clock, what was reported of it), added by :meth:`DecodeWorker.allocate` and
removed by ``_forget`` when it finishes, is aborted or fails. Each ``step``/``group_step`` report ends with the typed
events of that iteration (:func:`~decode_node.request_state.step_events`), which the actor publishes.

Threading: ``poll_transfers``/``step``/``group_step`` run on the worker's loop; the transport's thread only calls the
sink, which writes under ``recv_lock`` and only while the request is still receiving, so a released block is never
written.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from decode_node.expert_group import GroupUnavailable, TickPlan
from decode_node.expert_parallel import ExpertParallel, ExpertParallelConfig
from decode_node.expert_tiers import ExpertTiers, TierConfig
from decode_node.request_state import DecodeRequest, StepReport, TransferClock, local_stats, step_events
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import DuetError, InvalidRequestError
from engine.sequence import Sequence
from engine.outputs import TokenLogprobs
from kv_transfer import (
    DEFAULT_LEASE,
    KVLayout,
    KVManager,
    KVPoll,
    KVReceiver,
    Lease,
    LeasePolicy,
    ProtocolError,
    StateLayout,
    TensorSpec,
)
from kv_transfer.compression import CompressionPolicy, resolve_policy
from kv_transfer.handoff import Handoff, check_mrope_delta, generator_from_state
from node_common.events import DecodeEvent

logger = logging.getLogger(__name__)


class PromptRecomputeUnavailable(DuetError):
    """A preempted image prompt cannot be recomputed on the decode side (it holds no pixels); retry elsewhere."""


def _first_tokens(handoff: Handoff) -> dict:
    """:meth:`LLMEngine.commit_prefilled`'s ``first_logprobs`` and ``choices`` from the hand-off's wire forms."""
    lp = lambda w: None if w is None else TokenLogprobs.from_wire(w)  # noqa: E731
    prompt = handoff.prompt_logprobs
    return {"first_logprobs": lp(handoff.first_logprobs),
            "prompt_logprobs": None if prompt is None else [lp(w) for w in prompt],
            "choices": [(c["token"], lp(c.get("logprobs")), generator_from_state(c.get("generator_state")))
                        for c in handoff.choices]}


class DecodeWorker:
    def __init__(self, model_dir: str | Path, config: EngineConfig, manager: KVManager, *,
                 lease: LeasePolicy = DEFAULT_LEASE, compression: str | dict | CompressionPolicy | None = None,
                 expert_parallel: ExpertParallelConfig | None = None, expert_tiers: TierConfig | None = None) -> None:
        if expert_parallel is not None and expert_tiers is not None:
            raise InvalidRequestError("tiered expert memory is not supported on expert-parallel decode workers yet")
        self.lease_policy = lease
        # the cluster's policy: with one, received KV is approximate and stays out of the prefix cache (how each
        # frame was encoded is read from its header, not from here)
        self.lossy = resolve_policy(compression) is not None
        self.engine = LLMEngine(model_dir, config)
        self.manager = manager
        t = self.engine.model_config.text
        dtype = str(self.engine.dtype).removeprefix("torch.")
        # the wire numbers KV layers 0..n-1 over the decoder layers that have KV, state frames over the GDN layers
        self.layout = KVLayout(len(t.kv_layers), config.block_size, t.num_kv_heads, t.head_dim, dtype)
        self.kv_layers, self.state_layers = t.kv_layers, t.state_layers
        specs = self.engine.runner.state_specs()
        self.state_layout = StateLayout(len(t.state_layers), tuple(
            TensorSpec(name, shape, str(dt).removeprefix("torch.")) for name, shape, dt in specs)) if specs else None
        self.requests: dict[str, DecodeRequest] = {}  # every request from allocate until it ends (module docstring)
        self.recv_lock = threading.Lock()
        self.step_s = 0.0  # seconds in decode steps (the rest of the process's CPU time is intake, KV, polls)
        self.on_transfer_done: Callable[[], None] | None = None  # called on the transport thread as a transfer lands
        self.ep = None if expert_parallel is None else ExpertParallel(self.engine, model_dir, expert_parallel)
        self.tiers = None if expert_tiers is None else ExpertTiers(self.engine, expert_tiers)

    @property
    def free_blocks(self) -> int:
        return self.engine.block_manager.num_free_blocks

    @property
    def receiving(self) -> int:
        """Requests whose KV is still arriving."""
        return sum(r.receiving for r in self.requests.values())

    @property
    def receivers(self) -> dict[str, KVReceiver]:
        """The receiving requests' receivers by request id (a view of ``requests``, for tests and tools)."""
        return {rid: r.receiver for rid, r in self.requests.items() if r.receiver is not None}

    def allocate(self, request_id: str, prompt: Any, params: SamplingParams, *, start_by_s: float | None = None
                 ) -> Lease:
        """Reserve blocks and issue a lease. ``start_by_s`` (wall time; the request's own deadline): the lease's
        clock starts with the transfer, which may wait for its prefill until then (:mod:`kv_transfer.lease`); None:
        it runs from now. Raises the engine's typed errors (OutOfBlocksError when full), and GroupUnavailable once
        this worker's expert-parallel group is broken."""
        if self.ep is not None and self.ep.broken:
            raise GroupUnavailable(f"decode worker cannot decode: {self.ep.broken}")
        with self.recv_lock:
            blocks = self.engine.preallocate(request_id, prompt, params)
        nbytes = len(blocks) * self.engine.runner.kv_bytes_per_token * self.layout.block_size
        nbytes += 0 if self.state_layout is None else self.state_layout.transfer_nbytes
        lease = Lease(request_id=request_id, num_blocks=len(blocks), layout=self.layout,
                      transport=self.manager.name, endpoint=self.manager.endpoint,
                      state=self.state_layout, **self.lease_policy.queued(nbytes, start_by_s))
        clock = TransferClock()
        try:
            receiver = self.manager.expect(lease, self._sink(request_id, clock), on_done=self._transfer_done)
            receiver.decode_device = self.engine.runner.device  # decode compressed layers where the pool is
            if self.state_layout is not None:
                receiver.state_sink = self._state_sink(request_id, clock)
        except Exception:
            self._release(request_id)
            raise
        self.requests[request_id] = DecodeRequest(request_id, lease, receiver, clock)
        return lease

    def admit_local(self, request_id: str, prompt: Any, params: SamplingParams) -> None:
        """Prefill a text prompt here, in this worker's own batch, instead of receiving its KV: for a host whose
        cores the prefill and decode workers share, where a short prompt's transfer, commit and the two processes'
        contention cost more than the prefill step itself (``ClusterSpec.local_prefill_tokens``). The request then
        decodes like any other; its first token event carries ``kv_transfer`` with ``transport: "local"`` and the
        prefill stages measured here. Raises InvalidRequestError for a prompt with images (this side holds no
        pixels) or on an expert-parallel or tiered worker, and the engine's typed errors; nothing is kept then.
        :meth:`check_local` then :meth:`add_local` do the same in two parts (the check off the stepping thread)."""
        self.add_local(self.check_local(request_id, prompt, params))

    def check_local(self, request_id: str, prompt: Any, params: SamplingParams) -> Sequence:
        """:meth:`admit_local`'s checks (any thread; nothing changes): the request's new sequence."""
        if self.ep is not None or self.tiers is not None:
            raise InvalidRequestError("an expert-parallel or tiered decode worker does not prefill prompts itself")
        seq = self.engine.make_sequence(request_id, prompt, params)  # refuses images without pixels itself
        if seq.mm is not None and len(seq.mm.positions):
            raise InvalidRequestError("a decode worker holds no pixels: prompts with images are prefilled by a "
                                      "prefill worker")
        return seq

    def add_local(self, seq: Sequence) -> None:
        """Queue a sequence from :meth:`check_local` (the stepping thread)."""
        with self.recv_lock:
            self.engine.add_sequence(seq)
        self.requests[seq.request_id] = DecodeRequest(seq.request_id, None, None, TransferClock())

    @property
    def local_prefilling(self) -> bool:
        """A prompt admitted by :meth:`admit_local` is waiting for, or in, its prefill."""
        return bool(self.engine.scheduler.waiting) or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in self.engine.scheduler.running)

    def _sink(self, request_id: str, clock: TransferClock):
        def write(layer: int, k: torch.Tensor, v: torch.Tensor, dropped: torch.Tensor | None = None) -> None:
            with self.recv_lock:
                if request_id in self.engine.receiving:
                    self.engine.write_layer(request_id, self.kv_layers[layer], k, v, dropped)
                    clock.on_layer(k.nbytes + v.nbytes)
        return write

    def _state_sink(self, request_id: str, clock: TransferClock):
        def write(index: int, tensors: dict[str, torch.Tensor]) -> None:
            with self.recv_lock:
                if request_id in self.engine.receiving:
                    self.engine.write_state(request_id, self.state_layers[index], tensors)
                    clock.on_state(sum(t.nbytes for t in tensors.values()))
        return write

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        record = self._forget(request_id)
        if self.tiers is not None:
            self.tiers.on_requests([], [request_id])
        if record is not None and record.receiver is not None:
            record.receiver.abort(reason)
            return self._release(request_id)
        return self.engine.abort_request(request_id)

    def _forget(self, request_id: str) -> DecodeRequest | None:
        """The one place a request's record goes: it finished, was aborted or failed."""
        return self.requests.pop(request_id, None)

    def _release(self, request_id: str) -> bool:
        with self.recv_lock:
            return self.engine.release_prefill(request_id)

    def _fail_transfer(self, report: StepReport, request_id: str, reason: str, *, own_fault: bool = False) -> None:
        """A receiving request whose KV or hand-off cannot be decoded, or whose prefill failed (``own_fault``: not
        retryable): free its blocks and report it."""
        self._forget(request_id)
        self._release(request_id)  # no-op when the engine released it already
        (report.errors if own_fault else report.failed)[request_id] = reason

    def _transfer_done(self, meta: dict) -> None:
        """A transfer is complete (transport thread): the owner's loop may commit it now (``on_transfer_done``)."""
        if self.on_transfer_done is not None:
            self.on_transfer_done()

    def poll_transfers(self, report: StepReport) -> None:
        """Commit finished transfers, release failed ones."""
        for rid, record in list(self.requests.items()):
            receiver = record.receiver
            state = KVPoll.WAITING if receiver is None else receiver.poll()
            if state == KVPoll.SUCCESS:
                record.receiver = None  # committed (or failed below): no longer receiving
                try:
                    handoff = self._accept_handoff(rid, receiver.meta)
                except ProtocolError as e:  # a hand-off this side cannot trust: never decode from it
                    logger.error("request %s: %s", rid, e)
                    self._fail_transfer(report, rid, f"{type(e).__name__}: {e}")
                    continue
                if handoff.error is not None:  # its prefill step failed (engine.isolation): its own fault
                    self._fail_transfer(report, rid, handoff.error, own_fault=True)
                    continue
                try:
                    outs = self.engine.commit_prefilled(rid, handoff.first_token, handoff.generator(),
                                                        lossy=self.lossy, **_first_tokens(handoff))
                except (InvalidRequestError, TypeError, ValueError) as e:  # choices that do not match the request
                    logger.error("request %s: bad hand-off: %s", rid, e)
                    self._fail_transfer(report, rid, f"ProtocolError: malformed hand-off: {e}")
                    continue
                if handoff.expert_hist is not None:
                    report.routing_hints[rid] = handoff.expert_hist
                    if self.tiers is not None:  # pre-warm this request's experts before its first decode step
                        self.tiers.on_requests([(rid, handoff.expert_hist)], [])
                stats = report.transfers[rid] = self._transfer_stats(record.clock, handoff)
                stats["wire_bytes"] = stats["bytes"] if receiver.wire_bytes is None else receiver.wire_bytes
                report.outputs.extend(outs)
            elif state == KVPoll.FAILED:
                e = receiver.failure_exception()
                self._fail_transfer(report, rid, "transfer failed" if e is None else f"{type(e).__name__}: {e}")

    def _accept_handoff(self, request_id: str, meta: dict | None) -> Handoff:
        """Parse a receiving request's hand-off and set what decode continues from: generated tokens' M-RoPE
        positions use the delta prefill sent, after checking it against this side's own computation from the
        prompt (image sizes only: the decode side never runs the vision tower). Raises ProtocolError
        (:class:`~kv_transfer.handoff.HandoffMismatch` on disagreement); the request is then unchanged."""
        handoff = Handoff.from_meta(meta)
        seq = self.engine.receiving[request_id]
        check_mrope_delta(handoff, 0 if seq.mm is None else seq.mm.mrope_delta, request_id)
        if seq.mm is not None:
            seq.mm.mrope_delta = handoff.mrope_delta
        return handoff

    def _transfer_stats(self, c: TransferClock, handoff: Handoff) -> dict:
        """The committed request's transfer figures (the first token event's ``kv_transfer``): bytes, layers,
        seconds (first -> last layer received), ``exposed_seconds`` (last layer received after prefill computed it),
        ``commit_seconds`` (last layer received -> committed: the hand-off frame and this loop's turn; the first
        token is published right after) and the prefill worker's ``prefill_stages`` (the hand-off's ``stages``)."""
        now = time.time()
        extra = {"state_bytes": c.state_bytes, "state_frames": c.state_frames, "prefill_stages": handoff.stages or {}}
        if c.first_s is None:
            return {"transport": self.manager.name, "bytes": 0, "layers": 0, "seconds": 0.0, "exposed_seconds": 0.0,
                    "commit_seconds": 0.0, **extra}
        done = c.last_s if handoff.compute_done_s is None else handoff.compute_done_s
        # "bytes" counts KV only; hybrid models' GDN state moves apart ("state_bytes", always raw)
        return {"transport": self.manager.name, "bytes": c.nbytes, "layers": c.layers,
                "seconds": c.last_s - c.first_s, "exposed_seconds": max(0.0, c.last_s - done),
                "commit_seconds": max(0.0, now - c.last_s), **extra}

    def step(self, publish: Callable[[list[DecodeEvent]], None] | None = None) -> StepReport:
        """Commit finished transfers, then one engine step. With ``publish``, the commits' events (first tokens,
        failed transfers) go to it before the step runs, so a first token does not wait for the running batch's
        step; the returned report then has the step's events only."""
        report = StepReport()
        self.poll_transfers(report)
        self._fail_unrecomputable(report)  # an n > 1 commit may drop an image prompt it had no block to fork
        if publish is not None and (report.outputs or report.failed):
            publish(self._end_step(report).events)
            report = StepReport()
        if self.engine.has_unfinished_requests():
            t0 = time.perf_counter()
            self._take_outputs(report, self.engine.step())
            self.step_s += time.perf_counter() - t0
            self._fail_unrecomputable(report)
        return self._end_step(report)

    def _take_outputs(self, report: StepReport, outputs: list) -> None:
        """An engine step's outputs into ``report``; a request that failed in the step (its own fault:
        :mod:`engine.isolation`; the engine freed it) becomes a not-retryable failure instead."""
        for out in outputs:
            if out.error is None:
                record = self.requests.get(out.request_id)
                if record is not None and record.local and not record.reported.tokens:  # its first token
                    report.transfers[out.request_id] = local_stats(out.metrics)
                report.outputs.append(out)
                continue
            self._forget(out.request_id)
            report.errors[out.request_id] = out.error
            if self.tiers is not None:
                self.tiers.on_requests([], [out.request_id])

    def _end_step(self, report: StepReport) -> StepReport:
        done = [o.request_id for o in report.outputs if o.finished]
        if self.tiers is not None and done:
            self.tiers.on_requests([], done)
        return self._close_report(report)

    def group_step(self, *, stop: bool = False) -> tuple[StepReport, TickPlan | None]:
        """One tick of the expert-parallel group (every rank calls it in a loop; see :mod:`decode_node.expert_group`):
        commit finished transfers, agree on the tick with the group, then -- when any rank has work -- run this
        rank's engine step (or an empty pass). Returns the report and the plan (None once the group is broken:
        the worker then fails its requests instead of decoding)."""
        report = StepReport()
        self.poll_transfers(report)
        for hist in report.routing_hints.values():
            self.ep.note_hint(hist)
        if self.ep.broken:
            self._fail_all(report, self.ep.broken)
            return self._close_report(report), None
        running = len(self.engine.scheduler.running)
        try:
            plan = self.ep.begin_tick(has_work=self.engine.has_unfinished_requests(), stop=stop, running=running)
            if plan.any_work and not plan.stop:
                if self.engine.has_unfinished_requests():
                    self._take_outputs(report, self.engine.step())
                    self._fail_unrecomputable(report)
                self.ep.end_tick()
        except Exception as e:  # any failure mid-tick desynchronises the group for good
            logger.exception("expert-parallel tick failed")
            self.ep.broken = f"expert-parallel group broke: {e}"
            self._fail_all(report, self.ep.broken)
            return self._close_report(report), None
        return self._close_report(report), plan

    def fail_all(self, reason: str) -> StepReport:
        """Abort every request (a step raised: fail the batch rather than the worker); their failure events."""
        report = StepReport()
        self._fail_all(report, reason)
        return self._close_report(report)

    def _close_report(self, report: StepReport) -> StepReport:
        """End an iteration: the report's events, then forget the requests that finished (failed ones are gone)."""
        report.events = step_events(report, self.requests)
        for out in report.outputs:
            if out.finished:
                self._forget(out.request_id)
        return report

    def _fail_unrecomputable(self, report: StepReport) -> None:
        """Fail the image prompts the engine dropped on preemption (see the module docstring)."""
        dropped, self.engine.cannot_recompute = self.engine.cannot_recompute, []
        if dropped:
            report.outputs = [o for o in report.outputs if o.request_id not in dropped]
        for rid in dropped:
            e = PromptRecomputeUnavailable(f"request {rid} was preempted on the decode worker, which holds no pixels "
                                           "to recompute its image prompt")
            logger.warning("%s", e)
            self._forget(rid)
            report.failed[rid] = f"{type(e).__name__}: {e}"
        if dropped and self.tiers is not None:
            self.tiers.on_requests([], dropped)

    def _fail_all(self, report: StepReport, reason: str) -> None:
        done = {o.request_id for o in report.outputs if o.finished}
        report.outputs = [o for o in report.outputs if o.finished]
        for rid in list(self.engine.requests):
            if rid not in done:
                self.abort(rid, reason)
                report.failed[rid] = reason

    def has_work(self) -> bool:
        return self.receiving > 0 or self.engine.has_unfinished_requests()
