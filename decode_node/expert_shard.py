"""One worker's share of the experts: its slots' weights for the active placement, a staged next placement loaded in
the background, and sliding-window load counts.

Placement switching (decode never waits for it): :meth:`ExpertShard.stage` starts a thread that builds the next
placement's slot buffers -- unchanged slots copied from the active buffers, changed ones read from the checkpoint --
and publishes it as *staged*; the decode loop keeps running on the active buffers meanwhile. The group agrees on a
tick (see :mod:`decode_node.expert_group`) and every rank calls :meth:`switch` between two model passes, which only
swaps references; the old buffers are freed after the switch.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from decode_node.expert_dispatch import LayerRoute, SlotWeights
from decode_node.expert_slots import InvalidPlacement, SlotTable
from decode_node.expert_weights import ExpertWeightSource

log = logging.getLogger(__name__)


@dataclass
class ActivePlacement:
    table: SlotTable
    weights: list[SlotWeights]  # per MoE layer
    routes: list[LayerRoute]  # per MoE layer


class ExpertShard:
    """``moe_layers``: decoder-layer index of each MoE layer (the table's layer axis follows this order)."""

    def __init__(self, source: ExpertWeightSource, moe_layers: list[int], table: SlotTable, *, rank: int,
                 device: torch.device) -> None:
        if table.num_layers != len(moe_layers):
            raise InvalidPlacement(f"placement has {table.num_layers} layers, the model {len(moe_layers)} MoE layers")
        self.source, self.moe_layers, self.rank, self.device = source, moe_layers, rank, device
        self.active = self._build(table, None)
        self.slots_loaded = 0  # slots read from the checkpoint by placement changes
        self._lock = threading.Lock()
        self._staged: ActivePlacement | None = None
        self._wanted = table.version
        self._thread: threading.Thread | None = None
        self.stage_error: str | None = None

    @property
    def staged_version(self) -> int:
        """The version :meth:`switch` can move to now (the active one while nothing newer is staged)."""
        with self._lock:
            return self._staged.table.version if self._staged is not None else self.active.table.version

    @property
    def wanted_version(self) -> int:
        """The newest version staged or active: a new placement must be newer (:meth:`stage`)."""
        with self._lock:
            return max(self._wanted, self.active.table.version)

    def stage(self, table: SlotTable) -> None:
        """Start loading ``table`` in the background (replaces any staging in progress). Raises
        :class:`InvalidPlacement` for a table of another shape or an old version."""
        a = self.active.table
        if (table.num_layers, table.workers, table.slots_per_worker, table.num_experts) != \
                (a.num_layers, a.workers, a.slots_per_worker, a.num_experts):
            raise InvalidPlacement(f"placement shape {table.slots.shape} ({table.num_experts} experts) does not match "
                                   f"the group's {a.slots.shape} ({a.num_experts} experts)")
        with self._lock:
            if table.version <= max(self._wanted, a.version):
                raise InvalidPlacement(f"placement version {table.version} is not newer than {self._wanted}")
            self._wanted, self._staged, self.stage_error = table.version, None, None
        self._thread = threading.Thread(target=self._load, args=(table,), name=f"ep-stage-{table.version}",
                                        daemon=True)
        self._thread.start()

    def wait_staged(self, timeout_s: float) -> bool:
        """Tests and tools: wait for the background load to finish."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self._thread is None or not self._thread.is_alive()

    def switch(self, version: int) -> None:
        """Between two model passes: make the staged placement (which must be ``version``) active."""
        with self._lock:
            if self._staged is None or self._staged.table.version != version:
                raise InvalidPlacement(f"rank {self.rank}: placement {version} is not staged")
            if self.device.type == "cuda":
                # queued kernels may still read the old buffers; the allocator only tracks their staging stream
                torch.cuda.synchronize(self.device)
            self.active, self._staged = self._staged, None

    def _load(self, table: SlotTable) -> None:
        try:
            built = self._build(table, self.active)
        except Exception as e:  # a thread boundary: report it, keep the active placement
            log.exception("loading placement %d failed", table.version)
            with self._lock:
                self.stage_error = f"placement {table.version}: {e}"
            return
        with self._lock:
            if self._wanted == table.version:
                self._staged = built

    def _build(self, table: SlotTable, old: ActivePlacement | None) -> ActivePlacement:
        weights, routes = [], []
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        for li, layer in enumerate(self.moe_layers):
            want = table.worker_experts(self.rank)[li]
            if old is None:
                keep = np.zeros(len(want), dtype=bool)
            else:
                keep = old.table.worker_experts(self.rank)[li] == want
            gu, down = self.source.read(layer, want[~keep].tolist()) if (~keep).any() else (None, None)
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                w = self._assemble(old.weights[li] if old is not None else None, keep, gu, down)
            weights.append(w)
            routes.append(LayerRoute.from_table(table, li, self.device))
            if old is not None:
                self.slots_loaded += int((~keep).sum())
        if stream is not None:
            stream.synchronize()
        return ActivePlacement(table, weights, routes)

    def _assemble(self, old: SlotWeights | None, keep: np.ndarray, gu: torch.Tensor | None,
                  down: torch.Tensor | None) -> SlotWeights:
        if old is None:
            return SlotWeights(gu.to(self.device), down.to(self.device))
        new = SlotWeights(torch.empty_like(old.gate_up), torch.empty_like(old.down))
        kept = torch.from_numpy(np.flatnonzero(keep)).to(self.device)
        fresh = torch.from_numpy(np.flatnonzero(~keep)).to(self.device)
        if kept.numel():
            new.gate_up[kept], new.down[kept] = old.gate_up[kept], old.down[kept]
        if fresh.numel():
            new.gate_up[fresh] = gu.to(self.device, non_blocking=True)
            new.down[fresh] = down.to(self.device, non_blocking=True)
        return new


class LoadWindow:
    """Counts per (MoE layer, column) over the last ``buckets`` x ``bucket_ticks`` ticks (a sliding window of whole
    buckets plus the bucket being filled). Accumulates on ``device``; moves to the host once per bucket."""

    def __init__(self, num_layers: int, width: int, device: torch.device, *, bucket_ticks: int = 16,
                 buckets: int = 8) -> None:
        self.current = torch.zeros(num_layers, width, dtype=torch.int64, device=device)
        self.bucket_ticks, self._ticks = bucket_ticks, 0
        self.done: deque[np.ndarray] = deque(maxlen=buckets)
        self._rolled = np.zeros((num_layers, width), dtype=np.int64)  # every finished bucket, for lifetime()

    def add(self, layer: int, counts: torch.Tensor) -> None:
        self.current[layer] += counts.to(self.current.device)

    def tick(self) -> None:
        self._ticks += 1
        if self._ticks >= self.bucket_ticks:
            self.done.append(self.current.cpu().numpy().copy())  # on the CPU, .cpu() is no copy
            self._rolled += self.done[-1]
            self.current.zero_()
            self._ticks = 0

    def total(self) -> np.ndarray:
        out = self.current.cpu().numpy().copy()
        for b in self.done:
            out += b
        return out

    def lifetime(self) -> np.ndarray:
        """Counts since the window was made."""
        return self._rolled + self.current.cpu().numpy()
