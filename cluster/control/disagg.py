"""The disaggregated front-end: starts the prefill and decode actors and serves requests across them.

Request flow (DESIGN.md): validate + tokenize here -> pick a decode worker (most free blocks) -> ``allocate`` gives a
lease (reserved blocks, transport endpoint, deadline) -> pick a prefill worker (fewest outstanding prompt tokens) ->
``submit`` (prefill streams KV layer by layer to the lease) -> the decode worker commits the request and streams
tokens back through :meth:`DecodeActor.poll` (one message per poll for all its requests). A failed transfer or a
dead worker is retried once on another pair; otherwise the request fails with a typed error. Every wait has a deadline.

With ``spec.expert_parallel > 1`` the decode workers form expert-parallel groups before serving (they share the MoE
experts; :mod:`cluster.experts.expert_router` forms them and runs one expert router per group). Status, pool resizing and
draining, and the benchmarks' checks are in :mod:`cluster.control.cluster_ops`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.control.cluster_ops import ClusterOps, await_ref
from cluster.control.pool_healer import PoolHealer
from cluster.control.router import PrefillLoad, PrefixIndex, WorkerLoad, cached_prefix_tokens, pick_decode, pick_prefill
from cluster.control.spec import ClusterSpec
from cluster.control.timeline import RequestClock
from cluster.experts import expert_router
from engine import SamplingParams
from engine.config import DTYPES, ModelConfig
from engine.errors import DuetError, OutOfBlocksError, is_retryable
from engine.inputs import InputProcessor, image_processor_for
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer
from kv_transfer import ClusterSecret
from node_common import messages, prompt_wire

logger = logging.getLogger(__name__)

PREFILL_QUEUE_LEASE_FRACTION = 0.5  # a prefill worker's admitted work, in measured seconds, vs lease_base_s
# a decode worker's long poll: it returns as soon as there are tokens, so this only bounds how often an idle worker
# is asked (was 50 ms: 20 RPCs a second per idle worker)
POLL_S = 1.0
SPEED_EWMA = 0.2  # weight of the newest submit-to-first-token sample in a prefill worker's speed


class TransferFailedError(DuetError):
    """The request's KV could not be moved to a decode worker, even after a retry."""

    code = "transfer_failed"


class RequestTimeoutError(DuetError):
    """The request did not finish before its deadline."""

    code = "request_timeout"


@dataclass
class _Worker:
    load: WorkerLoad
    actor: Any
    inflight: int = 0  # requests placed on this worker and not yet finished (a drain waits for 0)
    # prefill workers: THE load signal (cluster.control.router): prompt tokens admitted and not yet past their first token,
    # less those predicted to come from its prefix cache
    prefill_tokens: int = 0
    s_per_token: float | None = None  # prefill workers: measured seconds from submit to first token per token queued
    prefix: PrefixIndex = field(default_factory=PrefixIndex)  # prefill workers: block hashes its cache holds
    placed_tokens: int = 0  # prefill workers: prompt tokens placed here, and those predicted cached (hit rate)
    predicted_cached_tokens: int = 0


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


class DisaggCluster(ClusterOps):
    """Owns the actors; ``generate`` (async, streaming) and ``generate_batch`` (sync) serve requests."""

    def __init__(self, spec: ClusterSpec, *, ray_address: str | None = None) -> None:
        import ray

        from decode_node.actor import DecodeActor
        from prefill_node.actor import PrefillActor

        if not ray.is_initialized():
            ray.init(address=ray_address, include_dashboard=False, ignore_reinit_error=True,
                     log_to_driver=False, configure_logging=False)
        self.spec = spec
        # the data plane's key: generated here, held by this front-end and handed to each worker as a constructor
        # argument (Ray pickles it on the control plane); never logged, never on a command line or in the environment
        self._secret = ClusterSecret.generate() if spec.data_plane_auth == "hmac" else None
        cfg = ModelConfig.from_pretrained(spec.model_dir)
        tok = Tokenizer.from_pretrained(spec.model_dir) if (Path(spec.model_dir) / "tokenizer.json").is_file() else None
        improc = image_processor_for(spec.model_dir, cfg)  # LLaVA's fixed-size or Qwen3-VL's native-resolution
        self.tokenizer = tok
        self.inputs = InputProcessor(cfg, tok, improc, spec.max_model_len or min(cfg.text.max_position_embeddings, 4096))
        self._actor_cls = {"prefill": PrefillActor, "decode": DecodeActor}
        self._next_index = {"prefill": spec.num_prefill, "decode": spec.num_decode}
        self._draining: dict[str, Any] = {}  # worker id -> concurrent future of its drain (see drain_worker)
        self._pinned = 0  # next core for a pinned worker (spec.pin_cpus)
        self.prefills = [self._spawn("prefill", f"prefill-{i}") for i in range(spec.num_prefill)]
        ep_configs = expert_router.worker_configs(spec, cfg.text)
        self._ep_configs, self._text_config = ep_configs, cfg.text  # a replacement starts with its slot's config
        self._dtype_bytes = DTYPES[spec.dtype].itemsize
        self._closing = False
        self._healer = PoolHealer(spec.heal_policy(), self)  # replaces dead workers (cluster.control.pool_healer)
        self.decodes = [self._spawn("decode", f"decode-{i}", ep_configs[i]) for i in range(spec.num_decode)]
        ray.get([w.actor.ping.remote() for w in self.prefills + self.decodes], timeout=300)
        self.inputs.max_model_len = self._agree_max_model_len()  # the front-end's limits use the workers' value
        # expert-parallel decode groups (none when spec.expert_parallel == 1): formed before any request arrives
        try:
            self.expert_routers = expert_router.form_groups(spec, cfg.text, [w.actor for w in self.decodes],
                                                            DTYPES[spec.dtype].itemsize)
        except BaseException:
            for w in self.prefills + self.decodes:
                ray.kill(w.actor)
            raise
        for r in self.expert_routers:
            r.start()
        for w in self.decodes:
            w.load.free_blocks = messages.unpack(ray.get(w.actor.stats.remote(), timeout=30))["free_blocks"]
        self.total_blocks = {w.load.worker_id: w.load.free_blocks for w in self.decodes}  # all free at start
        self._ids = itertools.count()
        self._queues: dict[str, asyncio.Queue] = {}
        self._owner: dict[str, str] = {}  # request id -> decode worker id
        self._prefill_cap = spec.max_prefill_queue_tokens or 4 * spec.max_num_batched_tokens
        self._adaptive_cap = spec.max_prefill_queue_tokens is None  # default: also bounded by measured time
        self._room_waiters: list[asyncio.Future] = []  # requests waiting for prefill room (front-end loop only)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="duet-frontend", daemon=True)
        self._thread.start()
        self._pollers = [asyncio.run_coroutine_threadsafe(self._poll(w), self._loop) for w in self.decodes]
        self._poller_of = {w.load.worker_id: f for w, f in zip(self.decodes, self._pollers, strict=True)}
        self._healing_task = asyncio.run_coroutine_threadsafe(self._healer.run(), self._loop)

    # -------------------------------------------------------------------------------------------------- public API
    async def generate(self, prompt: Any, params: SamplingParams | None = None, *, request_id: str | None = None
                       ) -> AsyncIterator[dict]:
        """Stream ``{"token_ids": [...new], "finished": bool, "finish_reason": ...}`` deltas for one request."""
        p, wire = self._prepare(prompt)  # typed errors before anything is reserved
        async for item in self._serve(p, wire, params or SamplingParams(), request_id):
            yield item

    def prepare(self, prompt: Any) -> tuple[Any, dict]:
        """Validate and tokenize ``prompt`` (CPU work: call it off any event loop); raises the typed
        :class:`~engine.errors.InvalidRequestError` subclasses. The result feeds :meth:`stream`; its first item
        (:class:`~engine.inputs.ProcessedPrompt`) has the ``token_ids``."""
        return self._prepare(prompt)

    async def stream(self, prepared: tuple[Any, dict], params: SamplingParams | None = None, *,
                     request_id: str | None = None) -> AsyncIterator[dict]:
        """:meth:`generate` for a caller on another event loop (a server's): the request runs on the cluster's loop
        and its deltas are handed over thread-safely. Closing this iterator, or cancelling the task that awaits it,
        aborts the request on its prefill and decode workers. ``prepared`` comes from :meth:`prepare`.

        The first delta that carries tokens also has ``"placement"``: ``{"accepted_at"`` (``time.monotonic()`` when
        the prefill worker took the request), ``"prefill_worker"``, ``"decode_worker"}``."""
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
            except asyncio.CancelledError:
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

    def _next_cpus(self) -> list[int]:
        """The next block of cores for a pinned worker (``ClusterSpec.pin_cpus``)."""
        width, total = max(1, int(self.spec.cpus_per_worker)), os.cpu_count() or 1
        first, self._pinned = self._pinned, self._pinned + width
        return sorted({(first + k) % total for k in range(width)})

    def _spawn(self, role: str, worker_id: str, expert_parallel: Any = None) -> _Worker:
        import ray

        spec = self.spec
        common = {"num_threads": max(1, int(spec.cpus_per_worker)), "compression": spec.compression_policy(),
                  "cpus": self._next_cpus() if spec.pin_cpus else None, "secret": self._secret}
        if role == "prefill":
            extra = {"stream_layers": spec.stream_layers}
        else:
            extra = {"lease_base_s": spec.lease_base_s, "lease_min_rate_bps": spec.lease_min_rate_bps,
                     "expert_parallel": expert_parallel, "expert_tiers": spec.tier_config()}
        actor = ray.remote(self._actor_cls[role]).options(**spec.actor_options(role), max_concurrency=16).remote(
            worker_id, spec.model_dir, spec.engine_config(role), spec.transport, **common, **extra)
        return _Worker(WorkerLoad(worker_id), actor)

    def _prepare(self, prompt: Any) -> tuple[Any, dict]:
        """Validate, tokenize, decode and preprocess the images once; returns the processed prompt and its wire
        forms (:mod:`node_common.prompt_wire`): ``{"prefill": with pixels, "decode": without any image data}``."""
        p = self.inputs.process(prompt)
        return p, {"prefill": prompt_wire.prompt_to_wire(p, for_encoder=True),
                   "decode": prompt_wire.prompt_to_wire(p, for_encoder=False)}

    async def _serve(self, p: Any, wire: dict, params: SamplingParams, request_id: str | None
                     ) -> AsyncIterator[dict]:
        base_id = request_id or f"req-{next(self._ids)}"
        tried_d: set[str] = set()
        tried_p: set[str] = set()
        deadline = time.monotonic() + self.spec.request_timeout_s
        for attempt in range(2):
            rid = base_id if attempt == 0 else f"{base_id}#retry{attempt}"
            result = self._attempt(rid, wire, params, p, frozenset(tried_d), frozenset(tried_p), deadline)
            failure = None
            try:
                async for item in result:
                    if "failed" in item:
                        failure = item
                        break
                    yield {**item, "attempt": attempt + 1}
                    if item.get("finished"):
                        return
            finally:
                await result.aclose()
            if failure is None:
                return
            tried_d.add(failure["decode"])
            tried_p.add(failure["prefill"])
            logger.warning("request %s failed on %s/%s (%s); retrying", rid, failure["prefill"], failure["decode"],
                           failure["failed"])
        if "error" in failure:  # a typed error that another pair could not avoid either: the client gets that type
            raise failure["error"]
        raise TransferFailedError(f"request {base_id} failed after a retry: {failure['failed']}")

    def generate_batch(self, prompts: list[Any], params: SamplingParams | list[SamplingParams] | None = None,
                       timeout_s: float | None = None) -> list[Completion]:
        """Run prompts concurrently to completion (sync; for the CLI, tests and benchmarks)."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        fut = asyncio.run_coroutine_threadsafe(self._batch(prompts, plist), self._loop)
        return fut.result(timeout=timeout_s or self.spec.request_timeout_s + 30)

    def shutdown(self) -> None:
        import ray

        self._closing = True  # the healer sees no members from now on and a replacement starting is killed
        self._healing_task.cancel()
        try:
            asyncio.run_coroutine_threadsafe(self._healer.stop(), self._loop).result(timeout=5)
        except Exception:  # noqa: BLE001 - a replacement mid-start is killed by _install
            logger.warning("pool healer did not stop within 5 s")
        for r in self.expert_routers:
            r.stop()
        for w in self.prefills + self.decodes:
            try:
                ray.get(w.actor.shutdown.remote(), timeout=10)
            except Exception:  # already dead
                pass
            ray.kill(w.actor)
        for w in self.decodes:
            w.load.alive = False
        for fut in self._pollers:
            fut.cancel()

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

    # -------------------------------------------------------------------------------------------------- internals
    async def _batch(self, prompts: list[Any], params: list[SamplingParams]) -> list[Completion]:
        return await asyncio.gather(*(self._collect(p, sp) for p, sp in zip(prompts, params, strict=True)))

    async def _collect(self, prompt: Any, params: SamplingParams) -> Completion:
        p, wire = self._prepare(prompt)
        c = Completion(request_id="", prompt_token_ids=p.token_ids)
        t0 = time.perf_counter()
        last = t0
        clock = RequestClock(arrival=time.monotonic())
        async for item in self._serve(p, wire, params, None):
            if item.get("index", 0):
                continue  # a Completion is one choice: the first
            now = time.perf_counter()
            clock.observe(item)
            if item["token_ids"] and c.ttft_s is None:
                c.ttft_s = now - t0
            c.token_ids.extend(item["token_ids"])
            c.request_id, c.attempts, last = item["request_id"], item["attempt"], now
            c.expert_hist = item.get("expert_hist") or c.expert_hist
            c.kv_transfer = item.get("kv_transfer") or c.kv_transfer
            if item.get("finished"):
                c.finish_reason = item["finish_reason"]
        if c.ttft_s is not None and len(c.token_ids) > 1:
            c.tpot_s = (last - t0 - c.ttft_s) / (len(c.token_ids) - 1)
        c.timeline = clock.timeline(c.kv_transfer, attempts=c.attempts)
        c.text = self.tokenizer.decode(c.token_ids) if self.tokenizer else ""
        return c

    async def _attempt(self, rid: str, wire: dict, params: SamplingParams, p, exclude_d: frozenset[str],
                       exclude_p: frozenset[str], deadline: float) -> AsyncIterator[dict]:
        blocks = -(-len(p.token_ids) // self.spec.block_size)
        self._pick_decode(blocks, exclude_d)  # fail fast when no decode worker could ever hold it
        import ray

        hashes = self._block_hashes(p)
        pw, charged = await self._admit_prefill(len(p.token_ids), hashes, rid, deadline, exclude_p)
        prefill = pw.load
        admitted = True
        try:
            decode = self._pick_decode(blocks, exclude_d)  # after the wait: free blocks may have changed
        except BaseException:
            self._release_prefill(pw, charged)
            raise

        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        self._owner[rid] = decode.load.worker_id
        decode.inflight += 1
        pw.inflight += 1
        body = dict(request_id=rid, params=messages.params_to_dict(params))
        where = {"decode": decode.load.worker_id, "prefill": prefill.worker_id}
        try:
            try:
                to_decode = messages.pack(**body, prompt=wire["decode"])  # no image data: decode never encodes
                reply = messages.unpack(await _remote(decode.actor.allocate, to_decode, deadline))
            except ray.exceptions.RayActorError:
                decode.load.alive = False
                yield {"failed": f"decode worker {decode.load.worker_id} is gone", **where}
                return
            except Exception as e:  # noqa: BLE001 - a typed error another pair may avoid is retried there
                if not is_retryable(e):
                    raise
                yield {"failed": f"{type(e).__name__}: {e}", "error": e, **where}
                return
            decode.load.free_blocks = reply["free_blocks"]
            try:
                to_prefill = messages.pack(**body, prompt=wire["prefill"], lease=reply["lease"])
                pw.prefix.add(messages.unpack(await _remote(pw.actor.submit, to_prefill, deadline))["registered"])
            except ray.exceptions.RayActorError:
                prefill.alive = False
                decode.actor.abort.remote(rid)
                yield {"failed": f"prefill worker {prefill.worker_id} is gone", **where}
                return
            except Exception as e:  # noqa: BLE001 - as for allocate: retryable ones go to another pair
                if not is_retryable(e):
                    raise
                decode.actor.abort.remote(rid)
                yield {"failed": f"{type(e).__name__}: {e}", "error": e, **where}
                return
            submitted, queued = time.monotonic(), pw.prefill_tokens  # queued: this prompt and those ahead of it
            placement: dict | None = {"accepted_at": time.monotonic(), **{f"{k}_worker": v for k, v in where.items()}}
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestTimeoutError(f"request {rid} timed out")
                item = await asyncio.wait_for(queue.get(), timeout=left)
                if "failed" in item:
                    yield {**item, **where}
                    return
                if admitted and item.get("token_ids"):
                    self._observe_prefill(pw, time.monotonic() - submitted, queued)
                    admitted = self._release_prefill(pw, charged)
                    pw.prefix.add(hashes)  # its prefill registered them (the next submit reply confirms)
                if placement is not None and item.get("token_ids"):
                    item, placement = {**item, "placement": placement}, None
                yield item
                if item.get("finished"):
                    return
        except (asyncio.TimeoutError, RequestTimeoutError):
            self._abort(rid, decode, pw)
            raise RequestTimeoutError(
                f"request {rid} did not finish within {self.spec.request_timeout_s:.0f} s") from None
        except DuetError:
            self._abort(rid, decode, pw)
            raise
        except (GeneratorExit, asyncio.CancelledError):
            self._abort(rid, decode, pw)
            raise
        finally:
            if admitted:
                self._release_prefill(pw, charged)
            self._queues.pop(rid, None)
            self._owner.pop(rid, None)
            decode.inflight -= 1
            pw.inflight -= 1

    async def _admit_prefill(self, n_prompt: int, hashes: list[bytes], rid: str, deadline: float,
                             exclude: frozenset[str]) -> tuple[_Worker, int]:
        """Place the prompt on a prefill worker once one has room for it (:func:`cluster.control.router.pick_prefill`:
        least expected time to first token, its cached prefix free), before the decode side reserves blocks: a
        lease's deadline runs from its allocation, so requests queue here, not in a prefill worker's queue holding
        one. A prompt larger than a worker's cap is admitted to it alone. Returns the worker and the tokens charged
        to it (give them back with :meth:`_release_prefill`). Workers in ``exclude`` (tried already) are used only
        when no other is live."""
        loop = asyncio.get_running_loop()
        while True:
            live = [w for w in self.prefills if w.load.alive and w.load.worker_id not in self._draining]
            pool = [w for w in live if w.load.worker_id not in exclude] or live
            if not pool:
                raise TransferFailedError("no live prefill worker")
            loads = [self._prefill_load(w, n_prompt, hashes) for w in pool]
            pick = pick_prefill(loads, n_prompt)
            if pick is not None:
                break
            fut = loop.create_future()
            self._room_waiters.append(fut)
            try:
                await asyncio.wait_for(fut, timeout=max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise RequestTimeoutError(f"request {rid} waited {self.spec.request_timeout_s:.0f} s for prefill "
                                          f"capacity") from None
        pw = next(w for w in pool if w.load.worker_id == pick.worker_id)
        charge = n_prompt - pick.cached_tokens
        pw.prefill_tokens += charge
        pw.placed_tokens += n_prompt
        pw.predicted_cached_tokens += pick.cached_tokens
        return pw, charge

    def _prefill_load(self, w: _Worker, n_prompt: int, hashes: list[bytes]) -> PrefillLoad:
        cached = cached_prefix_tokens(w.prefix, hashes, self.spec.block_size)
        room = not w.prefill_tokens or w.prefill_tokens + n_prompt - cached <= self._cap(w)
        return PrefillLoad(w.load.worker_id, w.prefill_tokens, w.s_per_token, cached, room)

    def _agree_max_model_len(self) -> int:
        """The cluster's one ``max_model_len``: the least any worker serves (each caps the configured or model
        limit by its KV pool), so a prompt the front-end admits fits every worker it may be placed on."""
        import ray

        rows = ray.get([w.actor.stats.remote() for w in self.prefills + self.decodes], timeout=60)
        return min(messages.unpack(r)["max_model_len"] for r in rows)

    def _block_hashes(self, p: Any) -> list[bytes]:
        """The prompt's block hashes a prefill worker's prefix cache would look up (the engine's own
        :meth:`~engine.sequence.Sequence.block_hash`, image content included; the last token is always computed)."""
        if not self.spec.extra_engine.get("enable_prefix_caching", True):
            return []
        seq = Sequence(0, "", list(p.token_ids), len(p.token_ids), SamplingParams(), self.spec.block_size, mm=p.mm)
        return [seq.block_hash(i) for i in range((len(p.token_ids) - 1) // self.spec.block_size)]

    def _cap(self, pw: _Worker) -> float:
        """Prompt tokens ``pw`` may hold between decode allocation and first token: ``max_prefill_queue_tokens``
        when configured; by default 4 x ``max_num_batched_tokens`` and, once the worker's speed is measured, no more
        than it gets through in half a lease (``lease_base_s``), so a queue on a slow worker (a CPU, a long prompt
        mix) never outlives the leases its requests hold. Until the first measurement, one prompt at a time."""
        if not self._adaptive_cap:
            return self._prefill_cap
        if pw.s_per_token is None:
            return 0
        return min(self._prefill_cap, PREFILL_QUEUE_LEASE_FRACTION * self.spec.lease_base_s / pw.s_per_token)

    @staticmethod
    def _observe_prefill(pw: _Worker, elapsed_s: float, queued_tokens: int) -> None:
        """Fold one request's submit-to-first-token time over the tokens queued with it into ``pw``'s speed."""
        if queued_tokens <= 0 or elapsed_s <= 0:
            return
        sample = elapsed_s / queued_tokens
        pw.s_per_token = sample if pw.s_per_token is None else (1 - SPEED_EWMA) * pw.s_per_token + SPEED_EWMA * sample

    def _release_prefill(self, pw: _Worker, tokens: int) -> bool:
        """Give back admitted prompt tokens and wake the waiters; returns False (no longer admitted)."""
        pw.prefill_tokens -= tokens
        waiters, self._room_waiters = self._room_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)
        return False

    def _pick_decode(self, blocks: int, exclude: frozenset[str]) -> _Worker:
        loads = [w.load for w in self.decodes if w.load.worker_id not in self._draining]
        load = pick_decode(loads, blocks, exclude=exclude) or pick_decode(loads, blocks)
        if load is None:
            raise OutOfBlocksError(f"no live decode worker has {blocks} free KV blocks")
        return next(w for w in self.decodes if w.load is load)

    def _abort(self, rid: str, decode: _Worker, prefill: _Worker) -> None:
        for w in (decode, prefill):
            if w.load.alive:
                w.actor.abort.remote(rid)

    async def _poll(self, w: _Worker) -> None:
        import ray

        while w.load.alive:
            try:
                msg = messages.unpack(await asyncio.wait_for(await_ref(w.actor.poll.remote(POLL_S)), timeout=30))
            except (ray.exceptions.RayActorError, asyncio.TimeoutError) as e:
                w.load.alive = False
                logger.error("decode worker %s is gone: %s", w.load.worker_id, e)
                for rid, owner in list(self._owner.items()):
                    if owner == w.load.worker_id and rid in self._queues:
                        self._queues[rid].put_nowait({"failed": f"decode worker {w.load.worker_id} died"})
                if not self._closing and w.load.worker_id not in self._draining:
                    self._healer.report_death("decode", w, f"poll failed: {type(e).__name__}")
                return
            w.load.free_blocks = msg["free_blocks"]
            for ev in msg["events"]:
                q = self._queues.get(ev["request_id"])
                if q is not None:
                    q.put_nowait(ev)


async def _remote(method, payload: bytes, deadline: float) -> bytes:
    left = max(0.1, deadline - time.monotonic())
    return await asyncio.wait_for(await_ref(method.remote(payload)), timeout=left)
