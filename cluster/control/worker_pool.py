"""The cluster's workers: the prefill and decode pools, their membership and their lifecycle.

:class:`WorkerPool` starts the actors of a :class:`~cluster.control.spec.ClusterSpec` (or, with ``detached_name``,
reattaches to live ones: :mod:`cluster.control.reattach`) and the expert-parallel decode groups, runs a poller per
decode worker (:mod:`cluster.control.streams`) and the pool healer (:mod:`cluster.control.pool_healer`, whose hooks
it implements), and changes membership in four ways:

* :meth:`WorkerPool.add_worker` -- one more worker, routed to once it answers (the autoscaler);
* :meth:`WorkerPool.drain_worker` -- no new requests, running ones finish, then it is shut down and removed;
* :meth:`WorkerPool.replace_dead` -- a fresh worker of a dead one's role and config in its place (a whole fresh group
  for a member of an expert-parallel group);
* :meth:`WorkerPool.close` -- everything shut down.

Membership lists change on the front-end loop (draining and replacement run there; ``add_worker`` appends from the
caller's thread after the worker answered). Request placement reads :meth:`open_prefills` and :meth:`pick_decode`;
per-worker counters are the workers' own (:mod:`cluster.control.worker`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import Future
from typing import Any

from cluster.control import expert_groups, reattach
from cluster.control.bounded import bounded
from cluster.control.admission import pick_decode_worker, pick_local_decode_worker
from cluster.control.pool_healer import PoolHealer
from cluster.control.ray_epoch import EPOCH, ray_call
from cluster.control.router import WorkerLoad
from cluster.control.spec import ClusterSpec, NodeShare
from cluster.control.streams import DecodeStreams
from cluster.control.worker import Worker, await_ref
from engine.config import DTYPES, TextConfig
from engine.errors import InvalidRequestError
from kv_transfer import ClusterSecret
from node_common import messages

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


class WorkerPool:
    """The prefill and decode workers of one cluster (see the module docstring). Construction starts every actor and
    forms the expert-parallel groups (blocking); :meth:`start` then starts the pollers and the healer on ``loop``."""

    def __init__(self, spec: ClusterSpec, text: TextConfig, secret: ClusterSecret | None, streams: DecodeStreams,
                 loop: asyncio.AbstractEventLoop) -> None:
        import ray

        from decode_node.actor import DecodeActor
        from prefill_node.actor import PrefillActor

        self.spec, self._text, self._secret, self._streams, self._loop = spec, text, secret, streams, loop
        self._actor_cls = {"prefill": PrefillActor, "decode": DecodeActor}
        self._next_index = {"prefill": spec.num_prefill, "decode": spec.num_decode}
        self._pinned = 0  # next core for a pinned worker (spec.pin_cpus)
        self._dtype_bytes = DTYPES[spec.dtype].itemsize
        self._ep_configs = expert_groups.worker_configs(spec, text)  # a replacement starts with its slot's config
        self._draining: dict[str, Future] = {}  # worker id -> its drain (see drain_worker)
        self._pollers: dict[str, Future] = {}  # decode worker id -> its poller
        self._closing = False
        self.epoch = EPOCH.current  # of this process's Ray driver (cluster.control.ray_epoch)
        self._healing: Future | None = None  # the healer's monitor (start)
        self.healer = PoolHealer(spec.heal_policy(), self)
        self.share = NodeShare.plan(spec, len([n for n in ray.nodes() if n.get("Alive")]))  # threads, local prefill
        self._detached: dict[str, list[str]] = {}  # worker id -> [role, fingerprint] (spec.detached_name)
        self.prefills, self.decodes = self._start_workers()
        ray.get([w.actor.ping.remote() for w in self.workers()], timeout=300)
        # expert-parallel decode groups (none when spec.expert_parallel == 1): formed before any request arrives
        try:
            self.max_model_len = self._agree_max_model_len()
            self.expert_routers = expert_groups.form_groups(spec, text, [w.actor for w in self.decodes],
                                                            self._dtype_bytes, attached=self._ep_attached)
        except BaseException:
            for w in self.workers():
                ray.kill(w.actor)
            raise
        for r in self.expert_routers:
            r.start()
        self._read_free_blocks(self.decodes, timeout=30)
        self.total_blocks = {w.worker_id: w.load.free_blocks for w in self.decodes}  # all free at start

    def start(self) -> None:
        """Start a poller per decode worker and the healer on the loop (running by now)."""
        for w in self.decodes:
            self._watch(w)
        self._healing = asyncio.run_coroutine_threadsafe(self.healer.run(), self._loop)

    # ------------------------------------------------------------------------------------------------ placement
    def workers(self) -> list[Worker]:
        return self.prefills + self.decodes

    def open_prefills(self) -> list[Worker]:
        """The prefill workers that take new requests (alive, not draining)."""
        return [w for w in self.prefills if w.alive and w.worker_id not in self._draining]

    def pick_decode(self, blocks: int, exclude: frozenset[str]) -> Worker:
        return pick_decode_worker(self.decodes, blocks, draining=self._draining, exclude=exclude)

    def pick_local_decode(self, tokens: int, exclude: frozenset[str]) -> Worker | None:
        """:func:`~cluster.control.admission.pick_local_decode_worker` over this pool."""
        return pick_local_decode_worker(self.decodes, tokens, self.share.local_prefill, self.spec.block_size,
                                        draining=self._draining, exclude=exclude)

    def pool_sizes(self) -> dict[str, int]:
        """Workers per role that take new requests (draining ones excluded), counting dead ones being respawned
        (:mod:`cluster.control.pool_healer`): the autoscaler must not add a worker on top of a replacement. Workers
        given up are not counted."""
        return {role: sum(w.alive and w.worker_id not in self._draining for w in self._pool(role))
                + self.healer.pending(role) for role in ROLES}

    # ------------------------------------------------------------------------------------ resizing (autoscale)
    @ray_call
    def add_worker(self, role: str) -> str:
        """Start one more ``role`` worker (blocks until it answers, up to 300 s) and route to it; returns its id.
        Its Ray resource request (``spec.actor_options(role)``) is what makes the Ray autoscaler add a node of the
        pool when none has room. Not with expert-parallel decode groups (their membership is fixed)."""
        import ray

        self._check_resizable(role)
        w = self._spawn(role, self._next_id(role))
        ray.get(w.actor.ping.remote(), timeout=300)
        if role == "decode":
            self._read_free_blocks([w], timeout=30)
            self.total_blocks[w.worker_id] = w.load.free_blocks
            self.decodes.append(w)
            self._watch(w)
        else:
            self.prefills.append(w)
        return w.worker_id

    def drain_worker(self, role: str, worker_id: str | None = None) -> str:
        """Stop routing new requests to one ``role`` worker (``worker_id``, else the least loaded), let its running
        requests finish, then shut it down and remove it. Returns the worker's id at once; :meth:`wait_drained`
        waits for the removal. The pool keeps at least one worker taking requests."""
        self._check_resizable(role)
        open_ = [w for w in self._pool(role) if w.alive and w.worker_id not in self._draining]
        if len(open_) < 2:
            raise InvalidRequestError(f"cannot drain the last {role} worker")
        if worker_id is None:
            key = (lambda w: w.prefill_tokens) if role == "prefill" else (lambda w: -w.load.free_blocks)
            w = min(open_, key=key)
        else:
            w = next((x for x in open_ if x.worker_id == worker_id), None)
            if w is None:
                raise InvalidRequestError(f"no {role} worker {worker_id} taking requests")
        self._draining[w.worker_id] = asyncio.run_coroutine_threadsafe(self._drain(w, role), self._loop)
        return w.worker_id

    def wait_drained(self, worker_id: str, timeout_s: float | None = None) -> None:
        """Block until :meth:`drain_worker`'s worker is removed."""
        self._draining[worker_id].result(timeout=timeout_s)

    async def _drain(self, w: Worker, role: str) -> None:
        import ray

        while w.inflight:  # no new request is placed on it (routing skips draining workers); running ones finish
            await asyncio.sleep(0.05)
        w.mark_dead("drained")
        try:  # stops its loop and ends the poll in flight (the poller then sees the worker gone and returns)
            await bounded(await_ref(w.actor.shutdown.remote()), timeout=10)
        except Exception as e:  # noqa: BLE001 - already gone; the kill below makes sure
            logger.debug("shutdown of %s: %s", w.worker_id, e)
        poller = self._pollers.pop(w.worker_id, None)
        if poller is not None:  # let it return from that poll rather than see the actor die
            await bounded(asyncio.wrap_future(poller), timeout=30)
        ray.kill(w.actor)
        self._pool(role).remove(w)
        self.total_blocks.pop(w.worker_id, None)
        logger.info("drained and removed %s", w.worker_id)

    def _check_resizable(self, role: str) -> None:
        if role not in ROLES:
            raise InvalidRequestError(f"role must be prefill or decode, got {role!r}")
        if role == "decode" and self.expert_routers:
            raise InvalidRequestError("decode pools in expert-parallel groups cannot be resized yet")

    # -------------------------------------------------------------------- self-healing hooks (pool_healer)
    def heal_members(self) -> list[tuple[str, Worker]]:
        if self._closing:
            return []
        return [(role, w) for role in ROLES for w in self._pool(role) if w.worker_id not in self._draining]

    def group_of(self, worker_id: str) -> str | None:
        if self.spec.expert_parallel == 1:
            return None
        i = next((i for i, w in enumerate(self.decodes) if w.worker_id == worker_id), None)
        return None if i is None else f"ep-{i // self.spec.expert_parallel}"

    async def replace_dead(self, slot: str, role: str, dead: Worker) -> list[tuple[str, str]]:
        """Start a fresh worker of ``dead``'s role and config in its place (a whole fresh group when it was a member
        of an expert-parallel group: the survivors cannot go on without it). Runs on the front-end loop."""
        import ray

        if role == "decode" and self.group_of(dead.worker_id) is not None:
            return await self._reform_group(int(slot.removeprefix("ep-")))
        i = self._pool(role).index(dead)
        ray.kill(dead.actor)  # an unresponsive actor must not come back next to its replacement
        new = self._spawn(role, self._next_id(role), self._ep_config(role, i))
        try:
            await asyncio.to_thread(self._await_started, [new])
        except BaseException:
            ray.kill(new.actor)
            raise
        self._install(role, i, new)
        return [(dead.worker_id, new.worker_id)]

    async def _reform_group(self, g: int) -> list[tuple[str, str]]:
        import ray

        world = self.spec.expert_parallel
        idx = range(g * world, (g + 1) * world)
        old = [self.decodes[i] for i in idx]
        for w in old:  # the survivors are killed on purpose: their deaths are not deaths
            self.healer.retire(w.worker_id)
            w.mark_dead(f"group ep-{g} re-formed")
        new = [self._spawn("decode", self._next_id("decode"), self._ep_config("decode", i)) for i in idx]

        def build() -> Any:
            self.expert_routers[g].stop()
            for w in old:
                ray.kill(w.actor)
            try:
                self._await_started(new, stats=False)
                router = expert_groups.form_group(self.spec, self._text, [w.actor for w in new], g,
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
        return [(o.worker_id, n.worker_id) for o, n in zip(old, new, strict=True)]

    def _install(self, role: str, i: int, new: Worker) -> None:
        """Route to ``new`` in place of the worker at ``i`` of its pool (front-end loop)."""
        import ray

        if self._closing:  # shut down while it started: it must not outlive the cluster
            ray.kill(new.actor)
            return
        pool = self._pool(role)
        old_id = pool[i].worker_id
        pool[i] = new
        if role == "decode":
            self.total_blocks.pop(old_id, None)
            self.total_blocks[new.worker_id] = new.load.free_blocks
            self._pollers.pop(old_id, None)
            self._watch(new)

    def _decode_died(self, w: Worker, why: str) -> None:
        """A decode poller's report (front-end loop): a death unless the worker is being drained or shut down."""
        if not self._closing and w.worker_id not in self._draining:
            self.healer.report_death("decode", w, why)

    # ---------------------------------------------------------------------------------------------- shutdown
    async def stop_healing(self) -> None:
        """No more members for the healer, replacements mid-start stopped (front-end loop)."""
        self._closing = True  # a replacement starting is killed by _install
        if self._healing is not None:
            self._healing.cancel()
        await self.healer.stop()

    def close(self) -> None:
        """Stop the expert routers and every actor (blocking; after :meth:`stop_healing`)."""
        import ray

        self._closing = True
        for r in self.expert_routers:
            r.stop()
        for w in self.decodes:  # first: their pollers then take the lanes' end as the shutdown it is
            w.mark_dead("shut down")
        for w in self.workers():
            try:
                ray.get(w.actor.shutdown.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - already dead
                pass
            ray.kill(w.actor)
        for fut in self._pollers.values():
            fut.cancel()
        if self.spec.detached_name:
            reattach.forget(self.spec.detached_name)
        self.share.close()

    def abandon(self) -> None:
        """Stop watching the workers and leave them running, as a front-end that dies does (tests, upgrades)."""
        self._closing = True
        for r in self.expert_routers:
            r.stop()
        for fut in self._pollers.values():
            fut.cancel()

    # --------------------------------------------------------------------------------------------- internals
    def _pool(self, role: str) -> list[Worker]:
        return self.prefills if role == "prefill" else self.decodes

    def _spawn_args(self, role: str, expert_parallel: Any = None, *, pin: bool = False) -> tuple[dict, dict]:
        """(Ray options, constructor keyword arguments) of a new ``role`` worker (``pin``: take its cores now)."""
        cpus = self._next_cpus() if self.spec.pin_cpus and pin else None
        return self.share.actor_args(self.spec, role, secret=self._secret, cpus=cpus, expert_parallel=expert_parallel)

    def _spawn(self, role: str, worker_id: str, expert_parallel: Any = None) -> Worker:
        import ray

        options, kwargs = self._spawn_args(role, expert_parallel, pin=True)
        if self.spec.detached_name:  # outlives this front-end; the next one reattaches (cluster.control.reattach)
            self._detached[worker_id] = [role, reattach.fingerprint(role, options, kwargs)]
            reattach.write_record(self.spec.detached_name, self._secret, self._detached)
            options.update(name=reattach.actor_name(self.spec.detached_name, worker_id),
                           namespace=reattach.NAMESPACE, lifetime="detached")
        actor = ray.remote(self._actor_cls[role]).options(**options).remote(worker_id, **kwargs)
        return Worker(WorkerLoad(worker_id), actor)

    def _start_workers(self) -> tuple[list[Worker], list[Worker]]:
        """The pools at start: reattached detached workers where there are some (cluster.control.reattach; whole
        expert-parallel groups only, first in the pool, their state in ``self._ep_attached``), new ones for the rest."""
        import ray

        spec, attached, world = self.spec, reattach.Attached(), self.spec.expert_parallel
        if spec.detached_name:
            expected = {r: {reattach.fingerprint(r, *self._spawn_args(r, self._ep_config(r, i))) for i in range(world)}
                        for r in ROLES}
            attached = reattach.attach(spec.detached_name, expected)
        found, seen = attached.workers, attached.seen
        self._ep_attached = reattach.place_groups(found, world, spec.num_decode) if world > 1 else []
        self._detached.update({w: [role, fp] for w, (role, _, _, fp) in found.items()})
        for role, _, index in (w.rpartition("-") for w in seen):  # a name just killed may not be free yet:
            if role in self._next_index and index.isdigit():  # new workers take new ids
                self._next_index[role] = max(self._next_index[role], int(index) + 1)
        pools: dict[str, list[Worker]] = {}
        for role, count in (("prefill", spec.num_prefill), ("decode", spec.num_decode)):
            if role == "decode" and world > 1:  # whole groups, each in rank order: slot i's rank is i % world
                mine = [w for g in self._ep_attached for w in g.members]
            else:
                mine = sorted((w for w, (r, *_) in found.items() if r == role), key=lambda w: int(w.rsplit("-", 1)[1]))
            for worker_id in mine[count:]:  # more than this front-end runs now
                ray.kill(found[worker_id][1])
                self._detached.pop(worker_id, None)
            pools[role] = [Worker(WorkerLoad(w), found[w][1], epoch=found[w][2]) for w in mine[:count]]
            for i in range(len(pools[role]), count):
                worker_id = f"{role}-{i}" if f"{role}-{i}" not in seen else self._next_id(role)
                pools[role].append(self._spawn(role, worker_id, self._ep_config(role, i)))
        if spec.detached_name:
            logger.info("reattached %d detached workers of %r: %s", len(found), spec.detached_name, sorted(found))
            reattach.write_record(spec.detached_name, self._secret, self._detached)
        return pools["prefill"], pools["decode"]

    def _next_cpus(self) -> list[int]:
        """The next block of cores for a pinned worker (``ClusterSpec.pin_cpus``)."""
        width, total = max(1, int(self.spec.cpus_per_worker)), os.cpu_count() or 1
        first, self._pinned = self._pinned, self._pinned + width
        return sorted({(first + k) % total for k in range(width)})

    def _next_id(self, role: str) -> str:
        worker_id = f"{role}-{self._next_index[role]}"
        self._next_index[role] += 1
        return worker_id

    def _ep_config(self, role: str, i: int) -> dict | None:
        return self._ep_configs[i] if role == "decode" and i < len(self._ep_configs) else None

    def _watch(self, w: Worker) -> None:
        self._pollers[w.worker_id] = asyncio.run_coroutine_threadsafe(self._streams.poll(w, self._decode_died),
                                                                      self._loop)

    def _agree_max_model_len(self) -> int:
        """The cluster's one ``max_model_len``: the least any worker serves (each caps the configured or model
        limit by its KV pool), so a prompt the front-end admits fits every worker it may be placed on."""
        import ray

        rows = ray.get([w.actor.stats.remote() for w in self.workers()], timeout=60)
        return min(messages.unpack(r)["max_model_len"] for r in rows)

    def _read_free_blocks(self, workers: list[Worker], *, timeout: float) -> None:
        import ray

        for w, s in zip(workers, ray.get([w.actor.stats.remote() for w in workers], timeout=timeout), strict=True):
            w.load.free_blocks = messages.unpack(s)["free_blocks"]

    @ray_call
    def _await_started(self, workers: list[Worker], *, ping: bool = True, stats: bool = True) -> None:
        """Blocking (call it on a thread): wait for ``workers`` to answer, then read each one's free blocks.
        Bounded by ``HealPolicy.start_timeout_s``."""
        import ray

        timeout = self.healer.policy.start_timeout_s
        if ping:
            ray.get([w.actor.ping.remote() for w in workers], timeout=timeout)
        if stats:
            self._read_free_blocks(workers, timeout=timeout)
