"""Expert-parallel decode: M decode workers share the experts of every MoE layer; everything else is replicated.

Each worker decodes its own requests (attention, dense layers and the router run data-parallel on its batch). In
each MoE layer its tokens go to the workers whose slots hold the chosen experts and come back combined
(:mod:`decode_node.expert_dispatch`); a worker holds only its ``S`` slots per layer (:mod:`decode_node.expert_shard`).

Lockstep (:mod:`decode_node.expert_group`): the decode loop of every rank calls :meth:`ExpertParallel.begin_tick`
once per iteration, and when the group has work anywhere, runs one model pass: its own engine step, or -- with no
batch, or a step that ran no forward -- an empty pass in :meth:`end_tick` that makes the same collectives with no
rows. So a request joins or leaves one worker's batch without any other worker waiting for it, and an idle worker
still serves the experts it holds. Placement changes switch at an agreed tick between two passes.

A failed collective or a failed step leaves the group broken (its ranks can no longer agree where they are): the
worker fails its requests and stops stepping (``broken`` says why); the group is not re-formed.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from decode_node.expert_dispatch import run_layer
from decode_node.expert_group import ExpertGroup, TickPlan
from decode_node.expert_shard import ExpertShard, LoadWindow
from decode_node.expert_slots import InvalidPlacement, SlotTable
from decode_node.expert_weights import ExpertWeightSource
from engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.moe import SparseMoe


@dataclass(frozen=True)
class ExpertParallelConfig:
    """One worker's place in its group. ``placement``: a :meth:`SlotTable.to_wire` map (None: round-robin).
    Load windows cover ``window_buckets`` x ``bucket_ticks`` ticks."""

    rank: int
    world: int
    slots_per_worker: int
    placement: dict | None = None
    timeout_s: float = 60.0
    bucket_ticks: int = 16
    window_buckets: int = 8

    def to_dict(self) -> dict:
        return asdict(self)


class ExpertParallel:
    def __init__(self, engine: LLMEngine, model_dir: str | Path, config: ExpertParallelConfig) -> None:
        layers = engine.model.text.layers
        self.moe_layers = [i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoe)]
        if not self.moe_layers:
            raise InvalidRequestError("expert parallelism needs an MoE model; this checkpoint has no MoE layer")
        t = engine.model_config.text
        self.config, self.device, self.num_experts = config, engine.device, t.num_experts
        self.hidden, self.top_k, self.dtype = t.hidden_size, t.top_k, engine.dtype
        table = (SlotTable.from_wire(config.placement) if config.placement is not None else SlotTable.round_robin(
            num_layers=len(self.moe_layers), workers=config.world, slots_per_worker=config.slots_per_worker,
            num_experts=t.num_experts))
        if (table.workers, table.slots_per_worker) != (config.world, config.slots_per_worker):
            raise InvalidPlacement(f"placement is for {table.workers} workers x {table.slots_per_worker} slots, the "
                                   f"group has {config.world} x {config.slots_per_worker}")
        self.shard = ExpertShard(ExpertWeightSource(model_dir, dtype=engine.dtype), self.moe_layers, table,
                                 rank=config.rank, device=engine.device)
        moes = [layers[i].mlp for i in self.moe_layers]
        self.act = moes[0].act
        for li, moe in enumerate(moes):
            moe.executor = functools.partial(self._run, li)
            # this worker computes only its slots: drop the replicated [E, ...] expert tensors the loader filled
            moe.release_experts()
        n, window = len(self.moe_layers), dict(bucket_ticks=config.bucket_ticks, buckets=config.window_buckets)
        self.expert_load = LoadWindow(n, t.num_experts, self.device, **window)  # this rank's tokens, per expert
        self.slot_rows = LoadWindow(n, config.slots_per_worker, self.device, **window)  # rows this rank computed
        self.hint_load = LoadWindow(n, t.num_experts, torch.device("cpu"), **window)  # prefill's routing hints
        self.group: ExpertGroup | None = None
        self.switches: list[dict] = []  # {"version", "tick", "running"} per placement change
        self.broken: str | None = None
        self._ran = [False] * n

    @property
    def rank(self) -> int:
        return self.config.rank

    def join(self, group: ExpertGroup) -> None:
        if (group.rank, group.world) != (self.config.rank, self.config.world):
            raise InvalidRequestError(f"group rank {group.rank}/{group.world} != configured "
                                      f"{self.config.rank}/{self.config.world}")
        self.group = group

    def apply_placement(self, table: SlotTable) -> None:
        """Stage ``table`` (loaded in the background); the group switches once every rank has staged it."""
        self.shard.stage(table)

    # ------------------------------------------------------------------------------------------------ the tick
    def begin_tick(self, *, has_work: bool, stop: bool, running: int = 0) -> TickPlan:
        """The group's header for this tick; switches placement when the group agreed to. Call once per loop
        iteration on every rank, then :meth:`end_tick` after the (optional) engine step when ``plan.any_work``."""
        assert self.group is not None, "join the group first"
        plan = self.group.agree(has_work=has_work, stop=stop, staged=self.shard.staged_version,
                                active=self.shard.active.table.version)
        if plan.switch_to is not None and not plan.stop:
            self.shard.switch(plan.switch_to)
            self.switches.append({"version": plan.switch_to, "tick": plan.tick, "running": running})
        self._ran = [False] * len(self._ran)
        return plan

    def end_tick(self) -> None:
        """Complete this tick's pass: empty MoE collectives for every layer the engine step did not run."""
        if not all(self._ran):
            self._empty_pass()
        for w in (self.expert_load, self.slot_rows, self.hint_load):
            w.tick()

    @torch.inference_mode()
    def _empty_pass(self) -> None:
        x = torch.empty(0, self.hidden, dtype=self.dtype, device=self.device)
        weights = torch.empty(0, self.top_k, dtype=torch.float32, device=self.device)
        experts = torch.empty(0, self.top_k, dtype=torch.int64, device=self.device)
        for li, ran in enumerate(self._ran):
            if not ran:
                self._run(li, x, weights, experts)

    def _run(self, li: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        active = self.shard.active
        res = run_layer(self.group, x, weights, experts, active.routes[li], active.weights[li], self.act)
        self.expert_load.add(li, torch.bincount(experts.reshape(-1), minlength=self.num_experts))
        self.slot_rows.add(li, res.slot_rows)
        self._ran[li] = True
        return res.out

    def note_hint(self, expert_hist: list[list[int]]) -> None:
        """A committed request's prefill routing histogram ``[num_layers][E]`` (all decoder layers)."""
        hist = np.asarray(expert_hist, dtype=np.int64)
        for li, layer in enumerate(self.moe_layers):
            self.hint_load.add(li, torch.from_numpy(hist[layer]))

    # ------------------------------------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """msgpack-able: placement versions (``wanted``: the newest staged or active; ``group``: the key of the group
        joined, None before), switches, and loads as ``[moe_layers][...]`` lists: ``expert_load``
        (this rank's tokens per logical expert), ``slot_rows`` (rows this rank's slots computed for all ranks) and
        ``hint_load`` (prefill's histograms of the requests committed here) over the window; ``slot_rows_total``
        since start. The window advances only on ticks with work anywhere."""
        return {"rank": self.rank, "world": self.config.world, "version": self.shard.active.table.version,
                "staged": self.shard.staged_version, "wanted": self.shard.wanted_version,
                "group": self.group.key if self.group is not None else None, "stage_error": self.shard.stage_error,
                "ticks": self.group.tick if self.group is not None else 0, "switches": list(self.switches),
                "slots_loaded": self.shard.slots_loaded, "broken": self.broken,
                "expert_load": self.expert_load.total().tolist(), "slot_rows": self.slot_rows.total().tolist(),
                "slot_rows_total": self.slot_rows.lifetime().tolist(),
                "hint_load": self.hint_load.total().tolist(), "placement": self.shard.active.table.to_wire()}
