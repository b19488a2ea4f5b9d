"""The disaggregated front-end: serves requests across a pool of prefill and decode actors.

Request flow (DESIGN.md), one attempt (:meth:`DisaggCluster._attempt`): validate + tokenize here -> admission to a
prefill worker (:mod:`cluster.control.admission`: least expected time to first token, its cached prefix free) ->
pick a decode worker (most free blocks) -> ``allocate`` gives a lease (reserved blocks, transport endpoint,
deadline) -> ``submit`` to the prefill worker (prefill streams KV layer by layer to the lease) -> the decode worker
commits the request and streams its events back through its poller (:mod:`cluster.control.streams`: one message per
poll for all its requests) -> :class:`~cluster.control.delta.Delta` s to the caller. What the attempt holds (the
admission charge, in-flight counts) is one :class:`~cluster.control.worker.Assignment`, given back once however
the attempt ends. An attempt that fails on its pair (:class:`~cluster.control.errors.AttemptFailed`) is retried once
on another pair when no token was streamed yet; otherwise the request fails with a typed error. Every wait has a
deadline.

The workers, their pollers, healing and resizing are the composed :class:`~cluster.control.worker_pool.WorkerPool`;
status and the benches' checks are :mod:`cluster.control.cluster_ops`; the batch API's :class:`Completion` is
:mod:`cluster.control.completion`. With ``spec.expert_parallel > 1`` the decode workers form expert-parallel groups
before serving (:mod:`cluster.control.expert_groups`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from cluster.control import cluster_ops, reattach
from cluster.control.admission import PrefillAdmission, apply_prefix_report
from cluster.control.completion import Completion, collect
from cluster.control.delta import Delta, WorkerPair
from cluster.control.errors import AttemptFailed, ClusterUnavailableError, DecodeInterruptedError
from cluster.control.errors import RequestTimeoutError, TransferFailedError
from cluster.control.spec import ClusterSpec
from cluster.control.streams import DecodeStreams
from cluster.control.worker import Assignment, LocalHold, Worker, call, call_decode, call_failure
from cluster.control.worker_pool import WorkerPool
from engine import SamplingParams
from engine.config import ModelConfig
from engine.errors import DuetError
from engine.inputs import InputProcessor, image_processor_for
from engine.isolation import RequestFailedError
from engine.tokenizer import Tokenizer
from kv_transfer import ClusterSecret
from node_common import messages, prompt_wire
from node_common.events import RequestFailed

__all__ = ["DisaggCluster", "TransferFailedError"]

logger = logging.getLogger(__name__)


class DisaggCluster:
    """Owns the worker pool; ``generate`` / ``stream`` (async, streaming) and ``generate_batch`` (sync) serve
    requests."""

    def __init__(self, spec: ClusterSpec, *, ray_address: str | None = None) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=ray_address, include_dashboard=False, ignore_reinit_error=True,
                     log_to_driver=False, configure_logging=False)
        self.spec = spec
        # the data plane's key: generated here, held by this front-end and handed to each worker as a constructor
        # argument (Ray pickles it on the control plane); never logged, never on a command line or in the environment
        self._secret = None
        if spec.data_plane_auth == "hmac":  # detached workers that may be reattached keep the key they have
            self._secret = (spec.detached_name and reattach.recorded_secret(spec.detached_name)) \
                or ClusterSecret.generate()
        cfg = ModelConfig.from_pretrained(spec.model_dir)
        tok = Tokenizer.from_pretrained(spec.model_dir) if (Path(spec.model_dir) / "tokenizer.json").is_file() else None
        improc = image_processor_for(spec.model_dir, cfg)  # LLaVA's fixed-size or Qwen3-VL's native-resolution
        self.tokenizer = tok
        self.inputs = InputProcessor(cfg, tok, improc, spec.max_model_len or min(cfg.text.max_position_embeddings, 4096))
        self._loop = asyncio.new_event_loop()
        self.streams = DecodeStreams(coalesce_s=spec.stream_interval_s, lane=spec.fast_lane)
        self.pool = WorkerPool(spec, cfg.text, self._secret, self.streams, self._loop)  # starts every actor
        self.inputs.max_model_len = self.pool.max_model_len  # the front-end's limits use the workers' value
        self.admission = PrefillAdmission(spec, self.pool.share.local_prefill)  # prefill admission and its waiters (front-end loop only)
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop.run_forever, name="duet-frontend", daemon=True)
        self._thread.start()
        self.pool.start()
        self._prefix_task = asyncio.run_coroutine_threadsafe(
            self.admission.reports(self.pool.open_prefills, self._apply_report), self._loop)

    # ------------------------------------------------------------------------------------------ the pool, read
    @property
    def prefills(self) -> list[Worker]:
        return self.pool.prefills

    @property
    def decodes(self) -> list[Worker]:
        return self.pool.decodes

    @property
    def total_blocks(self) -> dict[str, int]:
        return self.pool.total_blocks

    @property
    def expert_routers(self) -> list[Any]:
        return self.pool.expert_routers

    # -------------------------------------------------------------------------------------------------- public API
    async def generate(self, prompt: Any, params: SamplingParams | None = None, *, request_id: str | None = None
                       ) -> AsyncIterator[Delta]:
        """Stream one request's :class:`~cluster.control.delta.Delta` s (on the cluster's own loop)."""
        p, wire = self._prepare(prompt)  # typed errors before anything is reserved
        async for item in self._serve(p, wire, params or SamplingParams(), request_id):
            yield item

    def prepare(self, prompt: Any) -> tuple[Any, dict]:
        """Validate and tokenize ``prompt`` (CPU work: call it off any event loop); raises the typed
        :class:`~engine.errors.InvalidRequestError` subclasses. The result feeds :meth:`stream`; its first item
        (:class:`~engine.inputs.ProcessedPrompt`) has the ``token_ids``."""
        return self._prepare(prompt)

    async def stream(self, prepared: tuple[Any, dict], params: SamplingParams | None = None, *,
                     request_id: str | None = None) -> AsyncIterator[Delta]:
        """:meth:`generate` for a caller on another event loop (a server's): the request runs on the cluster's loop
        and its deltas are handed over thread-safely. Closing this iterator, or cancelling the task that awaits it,
        aborts the request on its prefill and decode workers. ``prepared`` comes from :meth:`prepare`. The first
        delta that carries tokens also has ``placement`` (:class:`~cluster.control.delta.WorkerPair`)."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()

        def hand_over(kind: str, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(out.put_nowait, (kind, value))
            except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
                pass

        async def pump() -> None:
            try:
                async for item in self._serve(*prepared, params or SamplingParams(), request_id):
                    hand_over("item", item)
            except asyncio.CancelledError:  # the consumer left, or this cluster is stopping under it: an error
                hand_over("error", ClusterUnavailableError("the cluster stopped while the request ran; retry"))
                raise
            except BaseException as e:  # noqa: BLE001 - every failure goes to the consumer
                hand_over("error", e)
            else:
                hand_over("done", None)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while True:
                kind, value = await out.get()
                if kind == "done":
                    return
                if kind == "error":
                    raise value
                yield value
        finally:
            if not fut.done():
                fut.cancel()  # cancels the request's await on the cluster loop, which aborts it on both workers

    def generate_batch(self, prompts: list[Any], params: SamplingParams | list[SamplingParams] | None = None,
                       timeout_s: float | None = None) -> list[Completion]:
        """Run prompts concurrently to completion (sync; for the CLI, tests and benchmarks)."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        fut = asyncio.run_coroutine_threadsafe(self._batch(prompts, plist), self._loop)
        return fut.result(timeout=timeout_s or self.spec.request_timeout_s + 30)

    def abandon(self) -> None:
        """Stop this front-end and leave its workers running, as a front-end that dies does (detached workers: the
        next front-end of the same ``detached_name`` reattaches to them; :mod:`cluster.control.reattach`)."""
        self._prefix_task.cancel()
        try:
            asyncio.run_coroutine_threadsafe(self.pool.stop_healing(), self._loop).result(timeout=5)
        except Exception:  # noqa: BLE001 - best effort: the loop stops below
            logger.warning("pool healer did not stop within 5 s")
        self.pool.abandon()
        self._stop_loop()

    def shutdown(self) -> None:
        self._prefix_task.cancel()
        try:
            asyncio.run_coroutine_threadsafe(self.pool.stop_healing(), self._loop).result(timeout=5)
        except Exception:  # noqa: BLE001 - a replacement mid-start is killed when it is installed
            logger.warning("pool healer did not stop within 5 s")
        self.pool.close()
        self._stop_loop()

    def _stop_loop(self) -> None:
        async def cancel_rest() -> None:  # let every task see its cancellation before the loop stops
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_rest(), self._loop).result(timeout=5)
        except Exception:  # noqa: BLE001 - a task that ignores cancellation must not block shutdown
            logger.warning("front-end tasks did not stop within 5 s")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------------- status, resizing (the pool's)
    def status(self, timeout_s: float = 5.0) -> list[dict]:
        """Per-worker rows (:func:`cluster.control.cluster_ops.status`)."""
        return cluster_ops.status(self.pool, timeout_s)

    prefix_summary = staticmethod(cluster_ops.prefix_summary)
    kv_memory_summary = staticmethod(cluster_ops.kv_memory_summary)

    def expert_summary(self) -> dict | None:
        """:func:`cluster.control.cluster_ops.expert_summary` of this cluster's expert routers and (with tiered
        expert memory, ``spec.expert_resident``) its decode workers."""
        tiers = None if self.spec.expert_resident is None else \
            [r for r in self.status() if r["role"] == "decode"]
        return cluster_ops.expert_summary([r.summary() for r in self.pool.expert_routers], tiers)

    def clear_vision_caches(self, timeout_s: float = 30.0) -> int:
        return cluster_ops.clear_vision_caches(self.pool, timeout_s)

    def check_no_leaks(self, timeout_s: float = 10.0) -> dict[str, int]:
        return cluster_ops.check_no_leaks(self.pool, timeout_s)

    def healing(self) -> dict:
        """``{"respawns": {role: n}, "given_up": {role: [worker ids]}, "respawning": [worker ids]}``."""
        return self.pool.healer.summary()

    def pool_sizes(self) -> dict[str, int]:
        return self.pool.pool_sizes()

    def add_worker(self, role: str) -> str:
        return self.pool.add_worker(role)

    def drain_worker(self, role: str, worker_id: str | None = None) -> str:
        return self.pool.drain_worker(role, worker_id)

    def wait_drained(self, worker_id: str, timeout_s: float | None = None) -> None:
        self.pool.wait_drained(worker_id, timeout_s)

    # -------------------------------------------------------------------------------------------------- internals
    def _prepare(self, prompt: Any) -> tuple[Any, dict]:
        """Validate, tokenize, decode and preprocess the images once; returns the processed prompt and its wire
        forms (:mod:`node_common.prompt_wire`): ``{"prefill": with pixels, "decode": without any image data}``."""
        p = self.inputs.process(prompt)
        return p, {"prefill": prompt_wire.prompt_to_wire(p, for_encoder=True),
                   "decode": prompt_wire.prompt_to_wire(p, for_encoder=False)}

    async def _batch(self, prompts: list[Any], params: list[SamplingParams]) -> list[Completion]:
        return await asyncio.gather(*(self._collect(p, sp) for p, sp in zip(prompts, params, strict=True)))

    async def _collect(self, prompt: Any, params: SamplingParams) -> Completion:
        p, wire = self._prepare(prompt)
        return await collect(self._serve(p, wire, params, None), p.token_ids, self.tokenizer)

    def _apply_report(self, pw: Worker, report: dict) -> int:
        """A prefill worker's report (a submit reply or a periodic one): its prefix changes go to its index, and each
        request it gave up (its transfer failed) ends that attempt now, whatever the decode side knows. Returns
        the report's number."""
        for rid, why in report.get("dropped", []):
            self.streams.fail(rid, f"prefill worker {pw.worker_id} gave it up ({why})")
        return apply_prefix_report(pw, report)

    async def _serve(self, p: Any, wire: dict, params: SamplingParams, request_id: str | None
                     ) -> AsyncIterator[Delta]:
        """One request: an attempt, and one retry on another pair when it failed before any token streamed."""
        base_id = request_id or f"req-{next(self._ids)}"
        tried_d: set[str] = set()
        tried_p: set[str] = set()
        deadline = time.monotonic() + self.spec.request_timeout_s
        failure: AttemptFailed | None = None
        for attempt in (1, 2):
            rid = base_id if attempt == 1 else f"{base_id}#retry{attempt - 1}"
            deltas = self._attempt(rid, wire, params, p, frozenset(tried_d), frozenset(tried_p), deadline, attempt)
            streamed = False
            try:
                async for delta in deltas:
                    streamed = True
                    yield delta
                return
            except AttemptFailed as f:
                failure = f
            finally:
                await deltas.aclose()
            if streamed:  # the caller has tokens of this attempt: a retry would send them again
                logger.warning("request %s failed on %s after streaming tokens (%s)", rid, failure.decode_worker,
                               failure.reason)
                raise DecodeInterruptedError(f"request {base_id} failed on decode worker {failure.decode_worker} "
                                             f"after its first tokens: {failure.reason}")
            tried_d.add(failure.decode_worker)
            tried_p.add(failure.prefill_worker)
            logger.warning("request %s failed on %s/%s (%s); retrying", rid, failure.prefill_worker,
                           failure.decode_worker, failure.reason)
        assert failure is not None
        if failure.error is not None:  # a typed error another pair could not avoid either: the client gets that type
            raise failure.error
        raise TransferFailedError(f"request {base_id} failed after a retry: {failure.reason}")

    async def _attempt(self, rid: str, wire: dict, params: SamplingParams, p: Any, exclude_d: frozenset[str],
                       exclude_p: frozenset[str], deadline: float, attempt: int) -> AsyncIterator[Delta]:
        """One attempt on one (prefill, decode) pair; raises :class:`AttemptFailed` when another pair may do
        better, a typed error otherwise."""
        # a short text prompt, on a host whose cores the workers share: its decode worker prefills it itself
        local = None if p.num_visual_tokens else self.pool.pick_local_decode(len(p.token_ids), exclude_d)
        if local is not None:
            async for delta in self._attempt_local(rid, wire, params, p, local, deadline, attempt):
                yield delta
            return
        blocks = -(-len(p.token_ids) // self.spec.block_size)
        self.pool.pick_decode(blocks, exclude_d)  # fail fast when no decode worker could ever hold it
        hashes = self.admission.block_hashes(p)
        pw, charge = await self.admission.admit(self.pool.open_prefills, len(p.token_ids), hashes, rid, deadline,
                                                exclude_p, n_visual=p.num_visual_tokens,
                                                visual_positions=() if p.mm is None else p.mm.positions)
        admitted_at = time.monotonic()
        with Assignment(self.admission, pw, charge, hashes, images=p.num_visual_tokens > 0) as a:
            decode = a.bind(self.pool.pick_decode(blocks, exclude_d))  # after the wait: free blocks may have changed
            pair = {"prefill_worker": pw.worker_id, "decode_worker": decode.worker_id}
            body = dict(request_id=rid, params=messages.params_to_dict(params))
            with self.streams.inbox(rid, decode.worker_id) as inbox, self._ending(a, rid):
                try:  # no image data to decode: it never encodes
                    start_by = time.time() + (deadline - time.monotonic())  # the lease waits for prefill
                    to_decode = messages.pack(**body, prompt=wire["decode"], start_by_s=start_by)
                    reply = messages.unpack(await call_decode(decode, "allocate", to_decode, deadline))
                except Exception as e:  # noqa: BLE001 - sorted by call_failure
                    raise call_failure(e, "decode", decode, pair) from None
                decode.load.free_blocks = reply["free_blocks"]
                allocated_at = time.monotonic()
                try:
                    to_prefill = messages.pack(**body, prompt=wire["prefill"], lease=reply["lease"])
                    reply = messages.unpack(await call(pw.actor.submit, to_prefill, deadline))
                    a.submitted(self._apply_report(pw, reply),
                                self.admission.queued_ahead(pw, p.num_visual_tokens > 0))
                except Exception as e:  # noqa: BLE001 - sorted by call_failure
                    if decode.alive:
                        decode.actor.abort.remote(rid)
                    raise call_failure(e, "prefill", pw, pair) from None
                placement = WorkerPair(time.monotonic(), **pair, admitted_at=admitted_at,
                                       allocated_at=allocated_at)
                async for delta in self._relay(a, inbox, rid, deadline, attempt, placement, p):
                    yield delta

    async def _attempt_local(self, rid: str, wire: dict, params: SamplingParams, p: Any, decode: Worker,
                             deadline: float, attempt: int) -> AsyncIterator[Delta]:
        """One attempt on ``decode`` alone: it prefills the prompt in its own batch
        (:meth:`~cluster.control.worker_pool.WorkerPool.pick_local_decode`); raises
        :class:`AttemptFailed` when another worker may do better, a typed error otherwise."""
        pair = {"prefill_worker": decode.worker_id, "decode_worker": decode.worker_id}
        with LocalHold(decode, len(p.token_ids)) as hold, self.streams.inbox(rid, decode.worker_id) as inbox, \
                self._ending(hold, rid):
            admitted_at = time.monotonic()
            try:
                msg = messages.pack(request_id=rid, params=messages.params_to_dict(params), prompt=wire["decode"])
                reply = messages.unpack(await call_decode(decode, "admit_local", msg, deadline))
            except Exception as e:  # noqa: BLE001 - sorted by call_failure
                raise call_failure(e, "decode", decode, pair) from None
            decode.load.free_blocks = reply["free_blocks"]
            placement = WorkerPair(time.monotonic(), **pair, admitted_at=admitted_at, allocated_at=admitted_at)
            async for delta in self._relay(hold, inbox, rid, deadline, attempt, placement, None):
                yield delta

    @contextlib.contextmanager
    def _ending(self, hold: Assignment | LocalHold, rid: str) -> Iterator[None]:
        """How an attempt ends abnormally: its deadline as :class:`RequestTimeoutError`, a typed error, the caller
        gone or cancelled -- each after asking its workers to drop the request."""
        try:
            yield
        except (asyncio.TimeoutError, RequestTimeoutError):
            hold.abort(rid)
            raise RequestTimeoutError(
                f"request {rid} did not finish within {self.spec.request_timeout_s:.0f} s") from None
        except (DuetError, GeneratorExit, asyncio.CancelledError):
            hold.abort(rid)
            raise

    async def _relay(self, hold: Assignment | LocalHold, inbox: Any, rid: str, deadline: float, attempt: int,
                     placement: WorkerPair | None, p: Any) -> AsyncIterator[Delta]:
        """The attempt's events as deltas until its last (``p``: the prompt whose prefill-worker stages admission
        learns from; None for a local prefill). A failure event raises :class:`AttemptFailed` (or, the request's own
        fault, :class:`RequestFailedError`); the caller maps the deadline's errors."""
        pair = placement.workers()
        while True:
            ev = await self.streams.next(inbox, rid, deadline, gone=hold.prefill_gone)
            if isinstance(ev, RequestFailed):  # decode dropped it, or its prefill worker died first
                hold.abort(rid)
                if not ev.retryable:  # its own fault in a worker step: another pair would meet it too
                    raise RequestFailedError(f"request {rid} failed: {ev.reason}")
                raise AttemptFailed(ev.reason, **pair)
            if ev.token_ids:
                if placement is not None and p is not None:  # the first: what its prefill cost, stage by stage
                    self.admission.observe_stages(len(p.token_ids), p.num_visual_tokens,
                                                  (ev.kv_transfer or {}).get("prefill_stages"))
                hold.first_token()
                yield Delta.of(ev, attempt=attempt, placement=placement)
                placement = None
            else:
                yield Delta.of(ev, attempt=attempt)
            if ev.finished:
                return

