"""What every worker actor shares: identity, a loop thread, and the idle leak check used by tests and operators.

Subclasses set ``role`` and ``self.manager``, build ``self.worker`` (with ``has_work()`` and ``engine``) through
:meth:`_build`, then call :meth:`_start`; ``_loop`` is theirs.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import threading
from typing import Callable

import torch

from engine.isolation import STAGES
from node_common import messages
from node_common.turn_lock import TurnLock

logger = logging.getLogger(__name__)


class WorkerActorBase:
    role = "worker"

    def _init_common(self, worker_id: str, num_threads: int, cpus: list[int] | None = None, nice: int = 0) -> None:
        """``nice``: this worker's scheduling priority, set whatever the process started at (see :func:`set_priority`);
        > 0 for a prefill worker sharing cores with decode workers: their steps come first, it takes what is left."""
        if cpus:
            pin_process(cpus)
        self.nice = set_priority(nice)
        self.num_threads = max(1, num_threads)  # the loop thread's (see _build)
        self.worker_id = worker_id
        self.lock = TurnLock()  # the loop gives way to waiting calls between steps (node_common.turn_lock)
        self.stopped = False

    def _build(self, build: Callable[[], object]) -> None:
        """Run ``build()`` (which makes ``self.worker`` and loads its engine) on the thread that will run the loop,
        re-raising its error here; the loop itself starts at :meth:`_start`.

        One thread of the process computes with ``num_threads`` OpenMP threads, every other one with one. OpenMP's
        thread count is a per-thread setting (a thread started here gets the process's initial one: Ray sets
        OMP_NUM_THREADS=1), and each thread that runs a parallel region keeps a team of its own: with the model loaded
        (its kernels timed) on Ray's thread and stepped on the loop thread, a 2-core host had more OpenMP threads than
        cores, which makes libgomp's idle workers sleep at once instead of spinning, and every parallel region then
        waited for a wake-up (a served 256-token prefill: 102-131 ms against 54-72 ms for the engine alone)."""
        built, box = threading.Event(), {}
        self._go = threading.Event()

        def main() -> None:
            torch.get_num_threads()  # this thread's lazy OpenMP set-up first, so the count set next is the one kept
            torch.set_num_threads(self.num_threads)
            try:
                box["worker"] = build()
            except BaseException as e:  # noqa: BLE001 -- handed to the constructor, which raises it
                box["error"] = e
                return
            finally:
                built.set()
            self._go.wait()
            # what loading left behind goes, and the loaded objects leave the cyclic collector's scans: a full
            # collection walked them all and paused a step (served text TTFT, 2 cores: 35.1 -> 33.9 ms)
            gc.collect()
            gc.freeze()
            if not self.stopped:
                self._loop()

        self.thread = threading.Thread(target=main, name=f"{self.role}-{self.worker_id}", daemon=True)
        self.thread.start()
        built.wait()
        if "error" in box:
            raise box["error"]
        self.worker = box["worker"]
        torch.set_num_threads(1)  # the process default from now on: threads other than the loop's run one

    def _start(self) -> None:
        self._go.set()

    def _loop(self) -> None:
        raise NotImplementedError

    def ping(self) -> bytes:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return messages.pack(worker_id=self.worker_id, role=self.role, cpus=cpus, threads=self.num_threads,
                             nice=os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0)

    def clear_vision_cache(self) -> int:
        """Forget the engine's cached image encodings (for benchmarks that replay the same images)."""
        with self.lock:
            return self.worker.engine.clear_vision_cache()

    def inject_request_fault(self, stage: str, seed: int) -> None:
        """Tests and fault drills only: from now on a request whose ``SamplingParams.seed`` is ``seed`` raises at
        ``stage`` (:data:`engine.isolation.STAGES`) of this worker's steps: that request's own fault, which ends it
        alone. A negative ``seed`` removes the fault."""
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; one of {STAGES}")

        def fault(where: str, seq) -> None:
            if where == stage and seq.params.seed == seed:
                raise RuntimeError(f"fault injected at {stage}")

        with self.lock:
            e = self.worker.engine
            e.hooks = dataclasses.replace(e.hooks, request_fault=None if seed < 0 else fault)

    def check_no_leaks(self) -> bytes:
        """``{"idle", "held"}`` (KV blocks and state slots still held): when idle, asserts every KV block is free or
        cached with zero references and every state slot free."""
        with self.lock:
            bm = self.worker.engine.block_manager
            idle = not self.worker.has_work()
            if idle:
                bm.check_no_leaks()
            slots = 0 if bm.state_slots is None else bm.state_slots.num_slots - bm.state_slots.num_free
            return messages.pack(idle=idle, held=sum(b.ref_count > 0 for b in bm.blocks) + slots)


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


# the nice value of a worker that should run below the others where it cannot be given its own (see set_priority)
LOWEST_NICE = 19


def set_priority(nice: int) -> int:
    """Set every thread's nice value to ``nice`` (Linux: nice is per thread; threads started later inherit it from
    their creator) and return the level this process now runs at. Ray starts a worker process at nice 15 (its
    ``worker_niceness``), below the front-end, raylet and GCS at 0: a decode worker left there lost its cores to every
    wake-up of those (a served 256-token prefill on its two threads: 50 ms against 40 ms at nice 0, 2-core host), and a
    prefill worker lowered to nice 10 outranked it. Raising priority back needs CAP_SYS_NICE (or RLIMIT_NICE): without
    it a worker keeps the level it has, and one that should run below the others (``nice`` > 0) goes to
    ``LOWEST_NICE``, so the order holds. A platform without ``setpriority`` runs as it started."""
    if not hasattr(os, "setpriority"):
        return 0
    current = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)  # this thread first: it tells whether the level is allowed
        level = nice
    except OSError:
        if nice <= 0:
            logger.warning("worker stays at nice %d (not permitted to set %d)", current, nice)
            return current
        level = max(current, LOWEST_NICE)
    for tid in _threads():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, level)
        except OSError:  # a thread that exited meanwhile, or not permitted
            pass
    return level


def pin_process(cpus: list[int]) -> None:
    """Pin every thread of this process (and the threads it starts later) to ``cpus`` (Linux; a no-op elsewhere)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that exited meanwhile
            pass
