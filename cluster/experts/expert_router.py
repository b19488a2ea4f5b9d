"""The global router's expert hook: collects one expert-parallel decode group's load, decides whether a new placement
pays for its migration, and drives it.

One :class:`ExpertRouter` per group (the control plane makes them: :func:`cluster.control.expert_groups.form_groups`). A round (:meth:`ExpertRouter.rebalance`):

1. ``stats`` from every rank (msgpack): the windowed tokens per (MoE layer, logical expert) of each rank's own
   requests, plus prefill's routing histograms of the requests that just arrived (weighted by ``hint_weight``, a
   forecast of load that has not shown up in the window yet);
2. a candidate from :mod:`cluster.experts.placement` -- :func:`~cluster.experts.placement.duet_placement` aligned to the current
   slots, or, with ``max_moves``, :func:`~cluster.experts.placement.migrate_placement` (at most that many slots per layer);
3. :func:`~cluster.experts.placement.should_rebalance` weighs the decode time saved over a horizon against the copy time;
4. ``apply_placement`` on every rank: each loads its changed slots in the background and the group switches at one
   agreed tick (:mod:`decode_node.expert_group`). The router waits for the switch before it plans again.

The periodic thread (:meth:`start`) runs a round every ``interval_s``; :meth:`apply` forces a placement (tests,
operators).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cluster.experts.placement import (
    Placement,
    align,
    duet_placement,
    migrate_placement,
    should_rebalance,
)
from decode_node.expert_slots import SlotTable, balancedness
from node_common import messages

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebalancePolicy:
    """When a rebalance pays. ``step_s``: MoE seconds per decode step under the current placement;
    ``horizon_steps``: steps the new placement is expected to serve; ``link_gbps``: how fast a worker loads an expert
    (checkpoint read on CPU; host-to-device on GPU)."""

    interval_s: float = 10.0  # 0: no periodic rounds (apply() still works)
    min_tokens: int = 256  # window tokens below which the load says too little to move experts
    max_moves: int | None = None  # per layer; None: place from scratch (aligned to the current slots)
    hint_weight: float = 1.0
    step_s: float = 0.01
    horizon_steps: int = 2000
    link_gbps: float = 1.0


@dataclass
class GroupLoad:
    expert_load: np.ndarray  # [L, E] tokens per (MoE layer, logical expert), all ranks, over the window
    hint_load: np.ndarray  # [L, E] prefill routing histograms of requests committed in the window
    worker_rows: np.ndarray  # [L, W] rows each rank's slots computed, over the window
    worker_rows_total: np.ndarray  # [L, W] the same since start
    versions: list[int]
    switches: int  # placement changes the group made (rank 0's count)


class ExpertRouter:
    def __init__(self, actors: list[Any], placement: Placement, *, bytes_per_expert: int,
                 policy: RebalancePolicy | None = None, name: str = "ep-0",
                 guard: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
        """``guard``: entered around each Ray call (the front-end's driver epoch, :mod:`cluster.control.ray_epoch`:
        no call of a driver that is being shut down)."""
        self.actors, self.current, self.name = actors, placement, name
        self._guard = guard
        self.bytes_per_expert, self.policy = bytes_per_expert, policy or RebalancePolicy()
        self.version = 0
        self.rounds = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one round or apply at a time

    # ------------------------------------------------------------------------------------------------ inputs
    def collect(self, timeout_s: float = 30.0) -> GroupLoad:
        import ray

        with self._guard():
            stats = [messages.unpack(s)["experts"] for s in
                     ray.get([a.stats.remote() for a in self.actors], timeout=timeout_s)]
        return GroupLoad(
            expert_load=np.sum([s["expert_load"] for s in stats], axis=0).astype(np.float64),
            hint_load=np.sum([s["hint_load"] for s in stats], axis=0).astype(np.float64),
            worker_rows=np.array([np.sum(s["slot_rows"], axis=1) for s in stats]).T,
            worker_rows_total=np.array([np.sum(s["slot_rows_total"], axis=1) for s in stats]).T,
            versions=[s["version"] for s in stats], switches=len(stats[0]["switches"]))

    def propose(self, load: np.ndarray) -> Placement:
        """A candidate for ``load [L, E]`` (pure; see the module docstring)."""
        p = self.policy
        if p.max_moves is not None:
            return migrate_placement(load, self.current, max_moves=p.max_moves)[0]
        return align(duet_placement(load, self.current.workers, self.current.slots_per_worker), self.current)

    # ------------------------------------------------------------------------------------------------ actions
    def rebalance(self, *, wait_s: float = 60.0) -> bool:
        """One round; True when it changed the placement."""
        with self._lock:
            self.rounds += 1
            g = self.collect()
            load = g.expert_load + self.policy.hint_weight * g.hint_load
            if load.sum() < self.policy.min_tokens:
                return False
            candidate = self.propose(load)
            decision = should_rebalance(load, self.current, candidate, bytes_per_expert=self.bytes_per_expert,
                                        link_gbps=self.policy.link_gbps, step_s=self.policy.step_s,
                                        horizon_steps=self.policy.horizon_steps)
            if not decision:
                return False
            log.info("%s: rebalancing, %d slots move (saves %.3f s, copies %.3f s)", self.name, decision.slots,
                     decision.saved_s, decision.copy_s)
            return self._apply(candidate, wait_s)

    def apply(self, placement: Placement, *, wait_s: float = 60.0) -> bool:
        """Drive ``placement`` onto the group now; True once every rank switched to it within ``wait_s``."""
        with self._lock:
            return self._apply(placement, wait_s)

    def _apply(self, placement: Placement, wait_s: float) -> bool:
        import ray

        self.version += 1
        table = to_slot_table(placement, self.version)
        body = messages.pack(placement=table.to_wire())
        with self._guard():
            replies = ray.get([a.apply_placement.remote(body) for a in self.actors], timeout=30)
        for reply in replies:
            messages.unpack(reply)  # raises the typed error of a rank that refused
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if all(v == self.version for v in self.collect().versions):
                self.current = placement
                return True
            time.sleep(0.02)
        log.warning("%s: placement %d not switched within %.0f s", self.name, self.version, wait_s)
        return False

    def start(self) -> None:
        if self.policy.interval_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"expert-router-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.policy.interval_s):
            try:
                self.rebalance()
            except Exception:  # a thread boundary: a failed round must not end the router
                log.exception("%s: rebalance round failed", self.name)

    # ------------------------------------------------------------------------------------------------ report
    def summary(self) -> dict:
        """``{"placement_changes", "balancedness", "prewarm_hits", "prewarm_misses"}`` for the CLI's JSON.
        ``balancedness``: measured, per MoE layer mean/max of the rows each worker computed since start, averaged
        over layers (None before any token). Pre-warm counts are None: no tiered expert cache yet."""
        g = self.collect()
        return {"placement_changes": g.switches, "balancedness": balancedness(g.worker_rows_total),
                "prewarm_hits": None, "prewarm_misses": None}


def to_slot_table(placement: Placement, version: int) -> SlotTable:
    """:class:`cluster.experts.placement.Placement` (``slots[L, W*S]``) -> the decode group's ``[L, W, S]`` table."""
    slots = placement.slots.reshape(placement.num_layers, placement.workers, placement.slots_per_worker)
    return SlotTable(slots, placement.num_experts, version)


def from_slot_table(table: SlotTable) -> Placement:
    """The inverse of :func:`to_slot_table` (the table's version is dropped): a group's ``[L, W, S]`` table as a
    :class:`~cluster.experts.placement.Placement`."""
    return Placement(table.slots.reshape(table.num_layers, -1), table.num_experts, table.workers,
                     table.slots_per_worker)
