"""Physical expert slots: which logical expert each slot of each worker holds, per MoE layer.

A :class:`SlotTable` is the decode group's view of a placement: ``slots[l, w, s]`` is the logical expert held by
slot ``s`` of worker ``w`` in MoE layer ``l`` (``l`` counts MoE layers only, in model order). The physical slot id is
``p = w * S + s``. Every logical expert has at least one replica per layer; a hot expert may have several, and tokens
pick among them by load (:meth:`SlotTable.replicas`). The placement algorithm (:mod:`cluster.experts.placement`) decides the
table; this module only validates it, derives lookup tables and moves it across processes.

Worked example, 4 experts, 2 workers, 3 slots (one spare slot each)::

    SlotTable.round_robin(num_layers=1, workers=2, slots_per_worker=3, num_experts=4).slots[0]
    # [[0, 1, 2],      worker 0: experts 0, 1, 2
    #  [3, 0, 1]]      worker 1: expert 3 and replicas of 0 and 1
    replicas(0) -> table [[0, 4], [1, 5], [2, 2], [3, 3]], counts [2, 2, 1, 1]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WIRE_VERSION = 1


class InvalidPlacement(ValueError):
    """A slot table that cannot serve: wrong shape, unknown expert ids, or an expert with no replica."""


@dataclass(frozen=True, eq=False)
class SlotTable:
    """``slots``: int64 ``[num_moe_layers, workers, slots_per_worker]`` of logical expert ids. ``version``: a
    placement id that grows with every change (the group switches only when all workers staged the same one)."""

    slots: np.ndarray
    num_experts: int
    version: int = 0

    def __post_init__(self) -> None:
        s = np.asarray(self.slots, dtype=np.int64)
        if s.ndim != 3 or 0 in s.shape:
            raise InvalidPlacement(f"slots must be [layers, workers, slots_per_worker], got shape {s.shape}")
        if s.min() < 0 or s.max() >= self.num_experts:
            raise InvalidPlacement(f"expert ids must lie in [0, {self.num_experts})")
        for layer in range(s.shape[0]):
            missing = np.setdiff1d(np.arange(self.num_experts), s[layer])
            if missing.size:
                raise InvalidPlacement(f"layer {layer}: expert(s) {missing.tolist()} have no slot")
        s.setflags(write=False)
        object.__setattr__(self, "slots", s)

    @property
    def num_layers(self) -> int:
        return self.slots.shape[0]

    @property
    def workers(self) -> int:
        return self.slots.shape[1]

    @property
    def slots_per_worker(self) -> int:
        return self.slots.shape[2]

    @classmethod
    def round_robin(cls, *, num_layers: int, workers: int, slots_per_worker: int, num_experts: int,
                    version: int = 0) -> SlotTable:
        """Static placement: physical slot ``p`` holds expert ``p % num_experts`` (spare slots replicate the
        lowest ids)."""
        if workers * slots_per_worker < num_experts:
            raise InvalidPlacement(f"{workers} workers x {slots_per_worker} slots cannot hold {num_experts} experts")
        row = np.arange(workers * slots_per_worker) % num_experts
        slots = np.broadcast_to(row.reshape(1, workers, slots_per_worker), (num_layers, workers, slots_per_worker))
        return cls(slots.copy(), num_experts, version)

    def worker_experts(self, rank: int) -> np.ndarray:
        """``[num_layers, slots_per_worker]``: the experts worker ``rank`` holds."""
        return self.slots[:, rank]

    def replicas(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """``(table [E, R], counts [E])``: physical slot ids of each expert's replicas; row ``e`` lists its
        ``counts[e]`` replicas first and repeats them cyclically up to ``R`` = the largest count."""
        flat = self.slots[layer].reshape(-1)
        counts = np.bincount(flat, minlength=self.num_experts)
        table = np.empty((self.num_experts, int(counts.max())), dtype=np.int64)
        for e in range(self.num_experts):
            where = np.flatnonzero(flat == e)
            table[e] = where[np.arange(table.shape[1]) % len(where)]
        return table, counts

    def changed_slots(self, other: SlotTable, rank: int) -> list[tuple[int, int]]:
        """(layer, slot) pairs of worker ``rank`` whose expert differs between ``self`` and ``other``."""
        diff = self.worker_experts(rank) != other.worker_experts(rank)
        return [(int(l), int(s)) for l, s in zip(*np.nonzero(diff), strict=True)]

    def with_version(self, version: int) -> SlotTable:
        return SlotTable(self.slots, self.num_experts, version)

    def to_wire(self) -> dict:
        """A msgpack-able map (``{"v", "version", "num_experts", "shape", "slots": flat list}``)."""
        return {"v": WIRE_VERSION, "version": self.version, "num_experts": self.num_experts,
                "shape": list(self.slots.shape), "slots": self.slots.reshape(-1).tolist()}

    @classmethod
    def from_wire(cls, d: dict) -> SlotTable:
        if d.get("v") != WIRE_VERSION:
            raise InvalidPlacement(f"unsupported slot table version {d.get('v')!r}")
        slots = np.asarray(d["slots"], dtype=np.int64).reshape(d["shape"])
        return cls(slots, int(d["num_experts"]), int(d["version"]))


def balancedness(worker_load: np.ndarray) -> float | None:
    """``worker_load [layers, workers]`` -> mean over layers of (mean worker load / max worker load), skipping
    layers with no load (SGLang's and vLLM's definition). None when no layer had any load."""
    load = np.asarray(worker_load, dtype=np.float64)
    peak = load.max(axis=1)
    used = peak > 0
    if not used.any():
        return None
    return float((load[used].mean(axis=1) / peak[used]).mean())


def predicted_worker_load(table: SlotTable, expert_load: np.ndarray) -> np.ndarray:
    """``expert_load [layers, E]`` spread evenly over each expert's replicas -> ``[layers, workers]``."""
    out = np.zeros((table.num_layers, table.workers))
    for layer in range(table.num_layers):
        counts = np.bincount(table.slots[layer].reshape(-1), minlength=table.num_experts)
        per_slot = expert_load[layer][table.slots[layer]] / counts[table.slots[layer]]
        out[layer] = per_slot.sum(axis=1)
    return out
