"""Expert placement: which logical expert each physical slot of each decode worker holds, per MoE layer.

Pure functions over numpy arrays (no Ray, no torch). Shapes: ``load[L, E]`` is tokens per (layer, logical expert)
over a window; a placement gives every layer ``W`` workers x ``S`` slots, slot ``s`` living on worker ``s // S``.
An expert's tokens split evenly over its replicas, so worker ``w``'s load in layer ``l`` is
``sum(load[l, e] / replicas[l, e] for e in the experts of w's slots)``; balancedness is mean / max of that over
workers, averaged over layers (SGLang's and vLLM's definition).

* :func:`static_placement` -- round-robin, the no-statistics baseline.
* :func:`greedy_placement` -- replicate-then-pack in the style of DeepSeek EPLB: each spare slot goes to the expert
  with the highest load per replica, then replicas go heaviest first to the least-loaded worker with a free slot.
* :func:`duet_placement` -- greedy, then a search over replica counts and pairwise swaps off the most-loaded worker;
  per layer it keeps whichever packing has the lower maximum, so it is never less balanced than greedy. With
  ``nodes`` it then spreads each expert's replicas over nodes where that costs no balance.
* :func:`migrate_placement` -- start from the current placement and change at most ``max_moves`` slots per layer.
* :func:`should_rebalance` -- whether a candidate placement saves more time over a horizon than copying costs.

Worked example (one layer, E=4, W=2, S=3, load ``[7, 9, 4, 1]``, mean worker load 10.5). Greedy: the two spare
slots go to expert 1 (9 -> 4.5 per replica) and then expert 0 (7 -> 3.5); replicas heaviest first
``1:4.5, 1:4.5, 2:4, 0:3.5, 0:3.5, 3:1`` land on workers ``0, 1, 0, 1, 0 (1 already holds 0), 1`` -> slots
``[1 2 0 | 1 0 3]``, loads 12 and 9, balancedness 10.5/12 = 0.875. Duet also tries moving a replica of expert 0 to
expert 1 (counts ``[1, 3, 1, 1]``, replicas of 1 carry 3): ``[0 1 3 | 2 1 1]``, loads 11 and 10, balancedness
10.5/11 = 0.955 (three replicas of expert 1 on two workers cannot avoid a duplicate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from cluster.experts import placement_pack as pack

PLACEMENT_VERSION = 1


@dataclass(frozen=True, eq=False)
class Placement:
    """Per layer, physical slot -> logical expert (``slots[L, W*S]``, read-only); every expert has a replica."""

    slots: np.ndarray
    num_experts: int
    workers: int
    slots_per_worker: int
    _replicas: tuple = field(init=False, repr=False)

    def __post_init__(self) -> None:
        slots = np.array(self.slots, dtype=np.int64, copy=True)
        assert slots.ndim == 2 and slots.shape[1] == self.workers * self.slots_per_worker, slots.shape
        assert slots.size == 0 or (slots.min() >= 0 and slots.max() < self.num_experts), "expert id out of range"
        slots.setflags(write=False)
        object.__setattr__(self, "slots", slots)
        reps = tuple(tuple(tuple(int(s) for s in np.flatnonzero(row == e)) for e in range(self.num_experts))
                     for row in slots)
        missing = [(li, e) for li, layer in enumerate(reps) for e, r in enumerate(layer) if not r]
        assert not missing, f"experts without a replica (layer, expert): {missing[:5]}"
        object.__setattr__(self, "_replicas", reps)

    @property
    def num_layers(self) -> int:
        return self.slots.shape[0]

    @property
    def num_slots(self) -> int:
        return self.workers * self.slots_per_worker

    def worker_of(self, slot: int) -> int:
        return slot // self.slots_per_worker

    def replicas(self, layer: int, expert: int) -> tuple[int, ...]:
        """The slots holding ``expert`` in ``layer`` (ascending)."""
        return self._replicas[layer][expert]

    def logical_to_physical(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """``[layer][expert] -> slots`` for every expert (the inverse of :attr:`slots`)."""
        return self._replicas

    def replica_counts(self) -> np.ndarray:
        """``[L, E]`` replicas per (layer, expert)."""
        return np.stack([np.bincount(row, minlength=self.num_experts) for row in self.slots]) if self.num_layers \
            else np.zeros((0, self.num_experts), dtype=np.int64)

    def worker_experts(self, layer: int, worker: int) -> np.ndarray:
        s = self.slots_per_worker
        return self.slots[layer, worker * s:(worker + 1) * s]

    def to_dict(self) -> dict:
        """msgpack/JSON-able form (plain ints and lists) with a ``version``."""
        return {"version": PLACEMENT_VERSION, "num_experts": self.num_experts, "workers": self.workers,
                "slots_per_worker": self.slots_per_worker, "slots": self.slots.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> Placement:
        if d.get("version") != PLACEMENT_VERSION:
            raise ValueError(f"placement version {d.get('version')!r}, expected {PLACEMENT_VERSION}")
        slots = np.array(d["slots"], dtype=np.int64).reshape(-1, d["workers"] * d["slots_per_worker"])
        return cls(slots, d["num_experts"], d["workers"], d["slots_per_worker"])

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Placement) and (self.num_experts, self.workers, self.slots_per_worker)
                == (other.num_experts, other.workers, other.slots_per_worker)
                and np.array_equal(self.slots, other.slots))

    __hash__ = None  # type: ignore[assignment]


# ------------------------------------------------------------------------------------------------------- metrics
def worker_loads(load: np.ndarray, placement: Placement) -> np.ndarray:
    """``[L, W]`` load per worker, an expert's load split evenly over its replicas."""
    load = _check_load(load, placement.num_experts)
    assert load.shape[0] == placement.num_layers, (load.shape, placement.num_layers)
    counts = placement.replica_counts()
    share = np.take_along_axis(load / counts, placement.slots, axis=1)
    return share.reshape(placement.num_layers, placement.workers, placement.slots_per_worker).sum(-1)


def layer_balancedness(load: np.ndarray, placement: Placement) -> np.ndarray:
    """``[L]`` mean worker load / max worker load (1.0 for a layer without load)."""
    wl = worker_loads(load, placement)
    mx = wl.max(axis=1)
    return np.where(mx > 0, wl.mean(axis=1) / np.where(mx > 0, mx, 1.0), 1.0)


def balancedness(load: np.ndarray, placement: Placement) -> float:
    """Per-layer mean/max worker load, averaged over layers."""
    return float(layer_balancedness(load, placement).mean())


def slots_changed(a: Placement, b: Placement) -> int:
    """Physical (layer, slot) pairs whose logical expert differs between ``a`` and ``b`` (same shape)."""
    assert a.slots.shape == b.slots.shape, (a.slots.shape, b.slots.shape)
    return int((a.slots != b.slots).sum())


# ---------------------------------------------------------------------------------------------------- placements
def static_placement(num_experts: int, workers: int, slots_per_worker: int, layers: int) -> Placement:
    """Round-robin: expert ``e`` on worker ``e % W``; spare slots get second replicas of experts 0, 1, ... in order,
    each on the next worker (round-robin) that has room and does not hold it yet."""
    assert workers >= 1 and slots_per_worker >= 1 and workers * slots_per_worker >= num_experts >= 1
    counts = np.ones(num_experts, dtype=np.int64)
    for i in range(workers * slots_per_worker - num_experts):
        counts[i % num_experts] += 1
    row = pack.round_robin(counts, workers, slots_per_worker)
    return Placement(np.tile(row, (layers, 1)), num_experts, workers, slots_per_worker)


def greedy_placement(load: np.ndarray, workers: int, slots_per_worker: int) -> Placement:
    """EPLB-style replicate-then-pack baseline (see the module docstring); ``W * S >= E`` required."""
    load = _check_load(load)
    num_experts = load.shape[1]
    assert workers >= 1 and slots_per_worker >= 1 and workers * slots_per_worker >= num_experts
    rows = [pack.lpt(w, pack.water_fill(w, workers * slots_per_worker), workers, slots_per_worker) for w in load]
    return Placement(_stack(rows, workers * slots_per_worker), num_experts, workers, slots_per_worker)


def duet_placement(load: np.ndarray, workers: int, slots_per_worker: int, *,
                   nodes: int | Sequence[int] | None = None) -> Placement:
    """Duet's placement: per layer the lowest-maximum packing among greedy's and the searched ones (module docstring).

    ``nodes``: a node count (workers split into equal contiguous groups) or each worker's node id. Replicas of an
    expert are then spread over distinct nodes by swaps that do not raise the layer's maximum worker load.
    """
    load = _check_load(load)
    num_experts = load.shape[1]
    n = workers * slots_per_worker
    assert workers >= 1 and slots_per_worker >= 1 and n >= num_experts
    node_of = _node_ids(nodes, workers)
    rows = []
    for w in load:
        row = pack.search(w, workers, slots_per_worker)
        if node_of is not None:
            row = pack.spread(w, row, workers, slots_per_worker, node_of)
        rows.append(row)
    return Placement(_stack(rows, n), num_experts, workers, slots_per_worker)


def migrate_placement(load: np.ndarray, current: Placement, *, max_moves: int,
                      target: float = 1.0) -> tuple[Placement, int]:
    """Improve ``current`` by at most ``max_moves`` slot changes **per layer** (a move: one slot gets another expert;
    swapping two slots' experts is two moves). Each step takes the change or swap that lowers the layer's maximum
    worker load most per move (ties: lowest sum of squared worker loads); a layer stops at ``target`` balancedness,
    when its budget is spent, or when nothing improves. Returns the new placement and :func:`slots_changed`."""
    load = _check_load(load, current.num_experts)
    assert load.shape[0] == current.num_layers and max_moves >= 0
    rows = [pack.migrate(w, row, current.workers, current.slots_per_worker, max_moves, target)
            for w, row in zip(load, current.slots, strict=True)]
    new = Placement(_stack(rows, current.num_slots), current.num_experts, current.workers, current.slots_per_worker)
    return new, slots_changed(current, new)


def align(candidate: Placement, current: Placement) -> Placement:
    """``candidate`` with workers relabelled (per layer, greedily by shared experts) and slots reordered within each
    worker so that as many slots as possible keep their current expert. Loads and balancedness are unchanged: this
    is what placing from scratch costs at best, before counting :func:`slots_changed`."""
    assert candidate.slots.shape == current.slots.shape
    rows = [pack.align_row(c, o, candidate.workers, candidate.slots_per_worker)
            for c, o in zip(candidate.slots, current.slots, strict=True)]
    return Placement(_stack(rows, candidate.num_slots), candidate.num_experts, candidate.workers,
                     candidate.slots_per_worker)


@dataclass(frozen=True)
class RebalanceDecision:
    """Outcome of :func:`should_rebalance`; truthy when the rebalance pays."""

    go: bool
    saved_s: float  # decode time saved over the horizon
    copy_s: float  # time to copy the changed experts over the link
    slots: int  # slots that change

    def __bool__(self) -> bool:
        return self.go


def should_rebalance(load: np.ndarray, current: Placement, candidate: Placement, *, bytes_per_expert: float,
                     link_gbps: float, step_s: float, horizon_steps: int) -> RebalanceDecision:
    """Whether switching to ``candidate`` pays for its copies.

    A step's MoE time follows the slowest worker of each layer, so with ``m(P) = sum_l max_w worker_loads(P)[l, w]``::

        saved_s = horizon_steps * step_s * (1 - m(candidate) / m(current))
        copy_s  = slots_changed(current, candidate) * bytes_per_expert / (link_gbps * 1e9)
        go      = saved_s > copy_s

    ``step_s``: seconds one step spends in MoE layers under ``current``; ``link_gbps``: GB/s (1e9 bytes/s) of the
    link the experts are copied over. Copy time counts in full although copies run beside decode (conservative).
    """
    assert link_gbps > 0 and step_s >= 0 and horizon_steps >= 0 and bytes_per_expert >= 0
    cur = float(worker_loads(load, current).max(axis=1).sum())
    new = float(worker_loads(load, candidate).max(axis=1).sum())
    saved = horizon_steps * step_s * (1.0 - new / cur) if cur > 0 else 0.0
    n = slots_changed(current, candidate)
    copy = n * bytes_per_expert / (link_gbps * 1e9)
    return RebalanceDecision(saved > copy, saved, copy, n)


# --------------------------------------------------------------------------------------------------------- helpers
def _check_load(load: np.ndarray, num_experts: int | None = None) -> np.ndarray:
    load = np.asarray(load, dtype=np.float64)
    assert load.ndim == 2, f"load must be [L, E], got shape {load.shape}"
    assert num_experts is None or load.shape[1] == num_experts, (load.shape, num_experts)
    assert np.isfinite(load).all() and (load >= 0).all(), "load must be finite and non-negative"
    return load


def _stack(rows: list[np.ndarray], n: int) -> np.ndarray:
    return np.stack(rows) if rows else np.zeros((0, n), dtype=np.int64)


def _node_ids(nodes: int | Sequence[int] | None, workers: int) -> np.ndarray | None:
    if nodes is None:
        return None
    if isinstance(nodes, int | np.integer):
        assert nodes >= 1 and workers % nodes == 0, f"{workers} workers do not split into {nodes} equal nodes"
        return np.arange(workers) // (workers // nodes)
    ids = np.asarray(nodes, dtype=np.int64)
    assert ids.shape == (workers,), f"need one node id per worker, got {ids.shape}"
    return ids
