"""The disaggregated front-end: starts the prefill and decode actors and serves requests across them.

Request flow (DESIGN.md): validate + tokenize here -> pick a decode worker (most free blocks) -> ``allocate`` gives a
lease (reserved blocks, transport endpoint, deadline) -> the prefill worker the prompt was admitted to
(:mod:`cluster.control.admission`: least expected time to first token, its cached prefix free) ->
``submit`` (prefill streams KV layer by layer to the lease) -> the decode worker commits the request and streams
tokens back through :meth:`DecodeActor.poll` (one message per poll for all its requests). A failed transfer or a
dead worker is retried once on another pair; otherwise the request fails with a typed error. Every wait has a deadline.

With ``spec.expert_parallel > 1`` the decode workers form expert-parallel groups before serving (they share the MoE
experts; :mod:`cluster.experts.expert_router` forms them and runs one expert router per group). Status, pool resizing and
draining, and the benchmarks' checks are in :mod:`cluster.control.cluster_ops`; the per-worker state, prefill admission
and decode placement in :mod:`cluster.control.admission`; the batch API's :class:`Completion` in
:mod:`cluster.control.completion`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from cluster.control.admission import PrefillAdmission, Worker, apply_prefix_report, pick_decode_worker
from cluster.control.cluster_ops import ClusterOps, await_ref
from cluster.control.completion import Completion, collect
from cluster.control.errors import DecodeInterruptedError, RequestTimeoutError, TransferFailedError
from cluster.control.pool_healer import PoolHealer
from cluster.control.router import WorkerLoad
from cluster.control.spec import ClusterSpec
from cluster.control import expert_groups
from engine import SamplingParams
from engine.config import DTYPES, ModelConfig
from engine.errors import DuetError, is_retryable
from engine.inputs import InputProcessor, image_processor_for
from engine.tokenizer import Tokenizer
from kv_transfer import ClusterSecret
from node_common import messages, prompt_wire

logger = logging.getLogger(__name__)

# a decode worker's long poll: it returns as soon as there are tokens, so this only bounds how often an idle worker
# is asked (was 50 ms: 20 RPCs a second per idle worker)
POLL_S = 1.0


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
        ep_configs = expert_groups.worker_configs(spec, cfg.text)
        self._ep_configs, self._text_config = ep_configs, cfg.text  # a replacement starts with its slot's config
        self._dtype_bytes = DTYPES[spec.dtype].itemsize
        self._closing = False
        self._healer = PoolHealer(spec.heal_policy(), self)  # replaces dead workers (cluster.control.pool_healer)
        self.decodes = [self._spawn("decode", f"decode-{i}", ep_configs[i]) for i in range(spec.num_decode)]
        ray.get([w.actor.ping.remote() for w in self.prefills + self.decodes], timeout=300)
        self.inputs.max_model_len = self._agree_max_model_len()  # the front-end's limits use the workers' value
        # expert-parallel decode groups (none when spec.expert_parallel == 1): formed before any request arrives
        try:
            self.expert_routers = expert_groups.form_groups(spec, cfg.text, [w.actor for w in self.decodes],
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
        self.admission = PrefillAdmission(spec)  # prefill admission and its waiters (front-end loop only)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="duet-frontend", daemon=True)
        self._thread.start()
        self._pollers = [asyncio.run_coroutine_threadsafe(self._poll(w), self._loop) for w in self.decodes]
        self._poller_of = {w.load.worker_id: f for w, f in zip(self.decodes, self._pollers, strict=True)}
        self._healing_task = asyncio.run_coroutine_threadsafe(self._healer.run(), self._loop)
        self._prefix_task = asyncio.run_coroutine_threadsafe(self.admission.report_prefixes(self._open_prefills),
                                                             self._loop)

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

    def _spawn(self, role: str, worker_id: str, expert_parallel: Any = None) -> Worker:
        import ray

        spec = self.spec
        common = {"num_threads": max(1, int(spec.cpus_per_worker)), "compression": spec.compression_policy(),
                  "cpus": self._next_cpus() if spec.pin_cpus else None, "secret": self._secret}
        if role == "prefill":
            extra = {"stream_layers": spec.stream_layers, "kv_proxy": spec.kv_proxy}
        else:
            extra = {"lease_base_s": spec.lease_base_s, "lease_min_rate_bps": spec.lease_min_rate_bps,
                     "expert_parallel": expert_parallel, "expert_tiers": spec.tier_config()}
        actor = ray.remote(self._actor_cls[role]).options(**spec.actor_options(role), max_concurrency=16).remote(
            worker_id, spec.model_dir, spec.engine_config(role), spec.transport, **common, **extra)
        return Worker(WorkerLoad(worker_id), actor)

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
            failure, streamed = None, False
            try:
                async for item in result:
                    if "failed" in item:
                        failure = item
                        break
                    streamed = True
                    yield {**item, "attempt": attempt + 1}
                    if item.get("finished"):
                        return
            finally:
                await result.aclose()
            if failure is None:
                return
            if streamed:  # the caller has tokens of this attempt: a retry would send them again
                logger.warning("request %s failed on %s after streaming tokens (%s)", rid, failure["decode"],
                               failure["failed"])
                raise DecodeInterruptedError(f"request {base_id} failed on decode worker {failure['decode']} after "
                                             f"its first tokens: {failure['failed']}")
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
        self._prefix_task.cancel()
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
        return await collect(self._serve(p, wire, params, None), p.token_ids, self.tokenizer)

    async def _attempt(self, rid: str, wire: dict, params: SamplingParams, p, exclude_d: frozenset[str],
                       exclude_p: frozenset[str], deadline: float) -> AsyncIterator[dict]:
        blocks = -(-len(p.token_ids) // self.spec.block_size)
        self._pick_decode(blocks, exclude_d)  # fail fast when no decode worker could ever hold it
        import ray

        hashes = self.admission.block_hashes(p)
        pw, charged = await self.admission.admit(self._open_prefills, len(p.token_ids), hashes, rid, deadline,
                                                 exclude_p)
        prefill = pw.load
        admitted = True
        try:
            decode = self._pick_decode(blocks, exclude_d)  # after the wait: free blocks may have changed
        except BaseException:
            self.admission.release(pw, charged)
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
                submitted_at = apply_prefix_report(pw, messages.unpack(await _remote(pw.actor.submit, to_prefill,
                                                                                     deadline)))
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
                    self.admission.observe(pw, time.monotonic() - submitted, queued)
                    admitted = self.admission.release(pw, charged)
                    pw.prefix.add_predicted(hashes, submitted_at)  # registered (the next report confirms)
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
                self.admission.release(pw, charged)
            self._queues.pop(rid, None)
            self._owner.pop(rid, None)
            decode.inflight -= 1
            pw.inflight -= 1

    def _agree_max_model_len(self) -> int:
        """The cluster's one ``max_model_len``: the least any worker serves (each caps the configured or model
        limit by its KV pool), so a prompt the front-end admits fits every worker it may be placed on."""
        import ray

        rows = ray.get([w.actor.stats.remote() for w in self.prefills + self.decodes], timeout=60)
        return min(messages.unpack(r)["max_model_len"] for r in rows)

    def _open_prefills(self) -> list[Worker]:
        return [w for w in self.prefills if w.load.alive and w.load.worker_id not in self._draining]

    def _pick_decode(self, blocks: int, exclude: frozenset[str]) -> Worker:
        return pick_decode_worker(self.decodes, blocks, draining=self._draining, exclude=exclude)

    def _abort(self, rid: str, decode: Worker, prefill: Worker) -> None:
        for w in (decode, prefill):
            if w.load.alive:
                w.actor.abort.remote(rid)

    async def _poll(self, w: Worker) -> None:
        import ray

        while w.load.alive:
            try:
                msg = messages.unpack(await asyncio.wait_for(await_ref(w.actor.poll.remote(POLL_S)), timeout=30))
            except Exception as e:  # noqa: BLE001 - dead, silent, or a poll that raises: its requests must not wait
                w.load.alive = False  # for their deadline on a poller that stopped, nor new ones be placed there
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
