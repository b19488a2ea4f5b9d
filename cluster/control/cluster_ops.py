"""Operations on a running :class:`~cluster.control.disagg.DisaggCluster` (a mixin it inherits): per-worker status, the
expert summary, pool resizing for :mod:`cluster.control.autoscale` (add a worker; drain one: no new requests, running ones
finish, then it is shut down and removed), and the checks benchmarks and tests use (vision caches, leaked blocks).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from engine.errors import InvalidRequestError
from node_common import messages

if TYPE_CHECKING:
    from cluster.control.admission import Worker

logger = logging.getLogger("cluster.control.disagg")


class ClusterOps:
    def status(self, timeout_s: float = 5.0) -> list[dict]:
        """One dict per worker: ``worker_id, role, alive`` and the worker's own counters (prefill: ``waiting,
        running, free_blocks``, and ``prompt_tokens`` / ``cached_tokens`` of the prompts it finished; decode:
        ``free_blocks, receiving, running, total_blocks``; both: ``kv_pool_bytes``, ``kv_mirror_bytes`` and
        ``kv_state_bytes`` (hybrid models' GDN state slots), see :meth:`kv_memory_summary`; prefill:
        ``prefix_cache_off``, why it keeps no prefix cache, or None). Prefill rows also carry the front-end's view:
        ``outstanding_tokens`` (its load signal, :mod:`cluster.control.router`), ``placed_prompt_tokens`` and
        ``predicted_cached_tokens``. A worker that does not answer within ``timeout_s`` is reported with
        ``alive=False``."""
        import ray

        workers = [("prefill", w) for w in self.prefills] + [("decode", w) for w in self.decodes]
        refs = [w.actor.stats.remote() if w.load.alive else None for _, w in workers]
        out = []
        for (role, w), ref in zip(workers, refs, strict=True):
            row: dict[str, Any] = {"worker_id": w.load.worker_id, "role": role, "alive": False}
            if ref is not None:
                try:
                    stats = messages.unpack(ray.get(ref, timeout=timeout_s))
                    row.update({k: v for k, v in stats.items() if k not in ("v", "worker_id")}, alive=True)
                except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                    pass
            if role == "decode":
                row["total_blocks"] = self.total_blocks.get(w.load.worker_id, 0)
            else:
                row.update(outstanding_tokens=w.prefill_tokens, placed_prompt_tokens=w.placed_tokens,
                           predicted_cached_tokens=w.predicted_cached_tokens)
            if not row["alive"] and (healing := self._healer.state_of(w.load.worker_id)) is not None:
                row["healing"] = healing  # "respawning" or "given_up" (cluster.control.pool_healer)
            out.append(row)
        return out

    @staticmethod
    def prefix_summary(rows: list[dict]) -> dict:
        """Prefix-cache hits over the prefill workers of :meth:`status` ``rows``: ``hit_rate`` = cached / prompt
        tokens as the workers counted them (prompts finished), ``predicted_hit_rate`` = the router's prediction over
        the prompts it placed (None before any prompt)."""
        pre = [r for r in rows if r["role"] == "prefill"]
        prompt, cached = sum(r.get("prompt_tokens", 0) for r in pre), sum(r.get("cached_tokens", 0) for r in pre)
        placed = sum(r.get("placed_prompt_tokens", 0) for r in pre)
        predicted = sum(r.get("predicted_cached_tokens", 0) for r in pre)
        off = next((r["prefix_cache_off"] for r in pre if r.get("prefix_cache_off")), None)
        return {"prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else None,
                "off_reason": off,  # why the workers keep no prefix cache (hybrid models), or None
                "placed_prompt_tokens": placed, "predicted_cached_tokens": predicted,
                "predicted_hit_rate": predicted / placed if placed else None}

    @staticmethod
    def kv_memory_summary(rows: list[dict]) -> dict:
        """KV bytes over the alive workers of :meth:`status` ``rows``: ``pool_bytes`` (paged pools),
        ``mirror_bytes`` (decode mirrors, :mod:`engine.decode_mirror`) and ``total_bytes``, everything attention
        reads."""
        alive = [r for r in rows if r["alive"]]
        pool, mirror = sum(r.get("kv_pool_bytes", 0) for r in alive), sum(r.get("kv_mirror_bytes", 0) for r in alive)
        state = sum(r.get("kv_state_bytes", 0) for r in alive)  # hybrid models' GDN state slots
        return {"pool_bytes": pool, "mirror_bytes": mirror, "state_bytes": state, "total_bytes": pool + mirror + state}

    def expert_summary(self) -> dict | None:
        """The expert-parallel groups' ``{"placement_changes", "balancedness", "prewarm_hits", "prewarm_misses"}``
        (summed changes, mean balancedness over groups; see :meth:`cluster.experts.expert_router.ExpertRouter.summary`), or
        None without expert parallelism nor tiered expert memory. With tiered expert memory (``spec.expert_resident``)
        ``prewarm_hits`` / ``prewarm_misses`` are the decode workers' expert accesses (one per layer, step and needed
        expert) that found the expert resident / stalled on its load, summed (:mod:`decode_node.expert_tiers`)."""
        tiers = self._tier_counts()
        if not self.expert_routers and tiers is None:
            return None
        out = {"placement_changes": 0, "balancedness": None, "prewarm_hits": None, "prewarm_misses": None}
        if self.expert_routers:
            rows = [r.summary() for r in self.expert_routers]
            measured = [r["balancedness"] for r in rows if r["balancedness"] is not None]
            out.update(placement_changes=sum(r["placement_changes"] for r in rows),
                       balancedness=sum(measured) / len(measured) if measured else None)
        if tiers is not None:
            out.update(tiers)
        return out

    def _tier_counts(self) -> dict | None:
        if self.spec.expert_resident is None:
            return None
        rows = [r["expert_tiers"] for r in self.status() if r["role"] == "decode" and r.get("expert_tiers")]
        return {"prewarm_hits": sum(r["expert_hits"] for r in rows),
                "prewarm_misses": sum(r["stalled_loads"] for r in rows)}

    def clear_vision_caches(self, timeout_s: float = 30.0) -> int:
        """Every worker forgets its cached image encodings (benchmarks); returns how many were dropped in all."""
        import ray

        return sum(ray.get([w.actor.clear_vision_cache.remote() for w in self.prefills + self.decodes],
                           timeout=timeout_s))

    def check_no_leaks(self, timeout_s: float = 10.0) -> dict[str, int]:
        """Blocks held per live worker once idle (waits up to ``timeout_s`` for in-flight work to drain)."""
        import ray

        held: dict[str, int] = {}
        for w in self.prefills + self.decodes:
            if not w.load.alive:
                continue
            end = time.monotonic() + timeout_s
            while True:
                try:
                    r = messages.unpack(ray.get(w.actor.check_no_leaks.remote(), timeout=30))
                except ray.exceptions.RayActorError:
                    w.load.alive = False
                    break
                if r["idle"] or time.monotonic() > end:
                    held[w.load.worker_id] = r["held"]
                    break
                time.sleep(0.05)
        return held

    # ------------------------------------------------------------------------------- pool hooks (cluster.control.autoscale)
    def pool_sizes(self) -> dict[str, int]:
        """Workers per role that take new requests (draining ones excluded), counting dead ones being respawned
        (:mod:`cluster.control.pool_healer`): the autoscaler must not add a worker on top of a replacement. Workers given
        up are not counted."""
        return {role: sum(w.load.alive and w.load.worker_id not in self._draining for w in ws)
                + self._healer.pending(role) for role, ws in (("prefill", self.prefills), ("decode", self.decodes))}

    def add_worker(self, role: str) -> str:
        """Start one more ``role`` worker (blocks until it answers, up to 300 s) and route to it; returns its id.
        Its Ray resource request (``spec.actor_options(role)``) is what makes the Ray autoscaler add a node of the
        pool when none has room. Not with expert-parallel decode groups (their membership is fixed)."""
        import ray

        self._check_resizable(role)
        w = self._spawn(role, self._next_id(role))
        worker_id = w.load.worker_id
        ray.get(w.actor.ping.remote(), timeout=300)
        if role == "decode":
            w.load.free_blocks = messages.unpack(ray.get(w.actor.stats.remote(), timeout=30))["free_blocks"]
            self.total_blocks[worker_id] = w.load.free_blocks
            self.decodes.append(w)
            self._pollers.append(asyncio.run_coroutine_threadsafe(self._poll(w), self._loop))
            self._poller_of[worker_id] = self._pollers[-1]
        else:
            self.prefills.append(w)
        return worker_id

    def drain_worker(self, role: str, worker_id: str | None = None) -> str:
        """Stop routing new requests to one ``role`` worker (``worker_id``, else the least loaded), let its running
        requests finish, then shut it down and remove it. Returns the worker's id at once; :meth:`wait_drained`
        waits for the removal. The pool keeps at least one worker taking requests."""
        self._check_resizable(role)
        pool = self.prefills if role == "prefill" else self.decodes
        open_ = [w for w in pool if w.load.alive and w.load.worker_id not in self._draining]
        if len(open_) < 2:
            raise InvalidRequestError(f"cannot drain the last {role} worker")
        if worker_id is None:
            key = (lambda w: w.prefill_tokens) if role == "prefill" else (lambda w: -w.load.free_blocks)
            w = min(open_, key=key)
        else:
            w = next((x for x in open_ if x.load.worker_id == worker_id), None)
            if w is None:
                raise InvalidRequestError(f"no {role} worker {worker_id} taking requests")
        self._draining[w.load.worker_id] = asyncio.run_coroutine_threadsafe(self._drain(w, pool), self._loop)
        return w.load.worker_id

    def wait_drained(self, worker_id: str, timeout_s: float | None = None) -> None:
        """Block until :meth:`drain_worker`'s worker is removed."""
        self._draining[worker_id].result(timeout=timeout_s)

    def _next_id(self, role: str) -> str:
        worker_id = f"{role}-{self._next_index[role]}"
        self._next_index[role] += 1
        return worker_id

    def _check_resizable(self, role: str) -> None:
        if role not in ("prefill", "decode"):
            raise InvalidRequestError(f"role must be prefill or decode, got {role!r}")
        if role == "decode" and self.expert_routers:
            raise InvalidRequestError("decode pools in expert-parallel groups cannot be resized yet")

    async def _drain(self, w: Worker, pool: list[Worker]) -> None:
        import ray

        wid = w.load.worker_id
        while w.inflight:  # no new request is placed on it (routing skips draining workers); running ones finish
            await asyncio.sleep(0.05)
        w.load.alive = False
        try:  # stops its loop and ends the poll in flight (the poller then sees the worker gone and returns)
            await asyncio.wait_for(await_ref(w.actor.shutdown.remote()), timeout=10)
        except Exception as e:  # noqa: BLE001 - already gone; the kill below makes sure
            logger.debug("shutdown of %s: %s", wid, e)
        poller = self._poller_of.pop(wid, None)
        if poller is not None:  # let it return from that poll rather than see the actor die
            await asyncio.wait_for(asyncio.wrap_future(poller), timeout=30)
        ray.kill(w.actor)
        pool.remove(w)
        self.total_blocks.pop(wid, None)
        logger.info("drained and removed %s", wid)

    # ---------------------------------------------------------------------- self-healing hooks (cluster.control.pool_healer)
    def healing(self) -> dict:
        """``{"respawns": {role: n}, "given_up": {role: [worker ids]}, "respawning": [worker ids]}``."""
        return self._healer.summary()

    def heal_members(self) -> list[tuple[str, Worker]]:
        if self._closing:
            return []
        return [(role, w) for role, ws in (("prefill", self.prefills), ("decode", self.decodes)) for w in ws
                if w.load.worker_id not in self._draining]

    def group_of(self, worker_id: str) -> str | None:
        if self.spec.expert_parallel == 1:
            return None
        i = next((i for i, w in enumerate(self.decodes) if w.load.worker_id == worker_id), None)
        return None if i is None else f"ep-{i // self.spec.expert_parallel}"

    async def replace_dead(self, slot: str, role: str, dead: Worker) -> list[tuple[str, str]]:
        """Start a fresh worker of ``dead``'s role and config in its place (a whole fresh group when it was a member
        of an expert-parallel group: the survivors cannot go on without it). Runs on the front-end loop."""
        import ray

        if role == "decode" and self.group_of(dead.load.worker_id) is not None:
            return await self._reform_group(int(slot.removeprefix("ep-")))
        pool = self.prefills if role == "prefill" else self.decodes
        i = pool.index(dead)
        ray.kill(dead.actor)  # an unresponsive actor must not come back next to its replacement
        new = self._spawn(role, self._next_id(role), self._ep_config(role, i))
        try:
            await asyncio.to_thread(self._await_started, [new])
        except BaseException:
            ray.kill(new.actor)
            raise
        self._install(role, i, new)
        return [(dead.load.worker_id, new.load.worker_id)]

    async def _reform_group(self, g: int) -> list[tuple[str, str]]:
        import ray

        from cluster.control import expert_groups

        world = self.spec.expert_parallel
        idx = range(g * world, (g + 1) * world)
        old = [self.decodes[i] for i in idx]
        for w in old:  # the survivors are killed on purpose: their deaths are not deaths
            self._healer.retire(w.load.worker_id)
            w.load.alive = False
        new = [self._spawn("decode", self._next_id("decode"), self._ep_config("decode", i)) for i in idx]

        def build() -> Any:
            self.expert_routers[g].stop()
            for w in old:
                ray.kill(w.actor)
            try:
                self._await_started(new, stats=False)
                router = expert_groups.form_group(self.spec, self._text_config, [w.actor for w in new], g,
                                                  self._dtype_bytes)
                self._await_started(new, ping=False)
            except BaseException:
                for w in new:
                    ray.kill(w.actor)
                raise
            return router

        router = await asyncio.to_thread(build)
        for i, w in zip(idx, new, strict=True):
            self._install("decode", i, w)
        self.expert_routers[g] = router
        router.start()
        return [(o.load.worker_id, n.load.worker_id) for o, n in zip(old, new, strict=True)]

    def _ep_config(self, role: str, i: int) -> dict | None:
        return self._ep_configs[i] if role == "decode" and i < len(self._ep_configs) else None

    def _await_started(self, workers: list[Worker], *, ping: bool = True, stats: bool = True) -> None:
        """Blocking (call it on a thread): wait for ``workers`` to answer, then read each decode worker's free
        blocks. Bounded by ``HealPolicy.start_timeout_s``."""
        import ray

        timeout = self._healer.policy.start_timeout_s
        if ping:
            ray.get([w.actor.ping.remote() for w in workers], timeout=timeout)
        if stats:
            for w, s in zip(workers, ray.get([w.actor.stats.remote() for w in workers], timeout=timeout),
                            strict=True):
                w.load.free_blocks = messages.unpack(s)["free_blocks"]

    def _install(self, role: str, i: int, new: Worker) -> None:
        """Route to ``new`` in place of the worker at ``i`` of its pool (front-end loop)."""
        import ray

        if self._closing:  # shut down while it started: it must not outlive the cluster
            ray.kill(new.actor)
            return
        pool = self.prefills if role == "prefill" else self.decodes
        old_id, wid = pool[i].load.worker_id, new.load.worker_id
        pool[i] = new
        if role == "decode":
            self.total_blocks.pop(old_id, None)
            self.total_blocks[wid] = new.load.free_blocks
            self._poller_of.pop(old_id, None)
            task = asyncio.get_running_loop().create_task(self._poll(new))
            self._pollers.append(task)
            self._poller_of[wid] = task


async def await_ref(ref):
    """A Ray ObjectRef as a coroutine (so ``asyncio.wait_for`` can bound it)."""
    return await ref
