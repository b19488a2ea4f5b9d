"""What every worker actor shares: identity, a loop thread, and the idle leak check used by tests and operators.

Subclasses set ``role``, build ``self.worker`` (with ``has_work()`` and ``engine``) and ``self.manager``, then call
:meth:`_start`; ``_loop`` is theirs.
"""

from __future__ import annotations

import threading

import torch

from cluster import messages


class WorkerActorBase:
    role = "worker"

    def _init_common(self, worker_id: str, num_threads: int) -> None:
        torch.set_num_threads(max(1, num_threads))  # Ray sets OMP_NUM_THREADS=1 for fractional actors
        self.worker_id = worker_id
        self.lock = threading.Lock()
        self.stopped = False

    def _start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name=f"{self.role}-{self.worker_id}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        raise NotImplementedError

    def ping(self) -> bytes:
        return messages.pack(worker_id=self.worker_id, role=self.role)

    def check_no_leaks(self) -> bytes:
        """``{"idle", "held"}``: when idle, asserts every KV block is free or cached with zero references."""
        with self.lock:
            bm = self.worker.engine.block_manager
            idle = not self.worker.has_work()
            if idle:
                bm.check_no_leaks()
            return messages.pack(idle=idle, held=sum(b.ref_count > 0 for b in bm.blocks))
