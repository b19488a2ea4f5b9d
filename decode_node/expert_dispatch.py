"""One MoE layer across the expert-parallel group: dispatch token rows to the slots holding their experts, run the
local slots with the grouped GEMM, send the results back, combine with the router weights.

Per layer and step every rank makes exactly three collectives on the data group, in this order, even with no tokens
(zero-size splits): (1) ``all_to_all`` of the per-(destination, slot) row counts ``[W, S]``; (2) ``all_to_all`` of the
rows; (3) ``all_to_all`` of the results back along the reversed splits. The maths equals the dense
:class:`engine.moe.SparseMoe` forward: each (token, k) pair is computed by one replica of its expert (same weights),
then ``out[t] = sum_k w[t, k] * expert_k(x[t])`` accumulated in the same order and dtype.

Replica choice: within one step, the n-th (token, k) pair of this rank that chose expert ``e`` goes to replica
``(n + rank) % replicas(e)`` -- round-robin, offset per rank so that ranks with one token each still spread out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from decode_node.expert_slots import SlotTable
from engine.moe import grouped_mm


class DataComm(Protocol):
    """What the dispatch needs from the group: rank, size, the device collectives run on, and all-to-all."""

    rank: int
    world: int
    device: torch.device

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        """Rows ``inp[sum(in_splits[:r]) : ...]`` go to rank ``r``; rows from rank ``r`` land in ``out`` likewise."""


@dataclass(frozen=True)
class LayerRoute:
    """Replica lookup of one MoE layer on the compute device: ``table [E, R]`` physical slot ids, ``counts [E]``."""

    table: torch.Tensor
    counts: torch.Tensor
    slots_per_worker: int
    workers: int

    @classmethod
    def from_table(cls, table: SlotTable, layer: int, device: torch.device) -> LayerRoute:
        rep, counts = table.replicas(layer)
        return cls(torch.from_numpy(rep).to(device), torch.from_numpy(counts).to(device), table.slots_per_worker,
                   table.workers)


@dataclass
class SlotWeights:
    """This rank's experts for one layer: ``gate_up [S, 2I, H]`` and ``down [S, H, I]``, output-major like
    :class:`engine.moe.SparseMoe`."""

    gate_up: torch.Tensor
    down: torch.Tensor

    def compute(self, rows: torch.Tensor, offsets: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
                ) -> torch.Tensor:
        """rows ``[R, H]`` grouped by slot (``offsets`` = int32 cumulative row counts per slot) -> ``[R, H]``."""
        gate, up = grouped_mm(rows, self.gate_up.transpose(1, 2), offsets).chunk(2, dim=-1)
        return grouped_mm(act(gate) * up, self.down.transpose(1, 2), offsets)


@dataclass
class LayerResult:
    out: torch.Tensor  # [T, H] in x's dtype
    slot_rows: torch.Tensor  # [S] int64: rows this rank's slots computed (from every rank)


def pick_slots(experts: torch.Tensor, route: LayerRoute, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts ``[T, k]`` -> (pair ids ``[N]`` into ``experts.view(-1)``, sorted by physical slot; their slots)."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    counts = torch.bincount(flat, minlength=route.counts.shape[0])
    starts = torch.cumsum(counts, 0) - counts
    nth = torch.arange(flat.shape[0], device=flat.device) - starts[by_expert]
    phys = route.table[by_expert, (nth + rank) % route.counts[by_expert]]
    by_slot = torch.argsort(phys, stable=True)
    return order[by_slot], phys[by_slot]


def run_layer(comm: DataComm, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, route: LayerRoute,
              local: SlotWeights, act: Callable[[torch.Tensor], torch.Tensor]) -> LayerResult:
    """x ``[T, H]`` (T may be 0), router ``weights``/``experts`` ``[T, k]`` -> combined MoE output ``[T, H]``."""
    t, h = x.shape
    k = experts.shape[1]
    w, s = route.workers, route.slots_per_worker
    pair, phys = pick_slots(experts, route, comm.rank)
    send_counts = torch.bincount(phys, minlength=w * s).view(w, s).to(comm.device)
    recv_counts = torch.empty_like(send_counts)
    comm.all_to_all(recv_counts, send_counts, [1] * w, [1] * w)
    send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    rows = x[pair // k].to(comm.device)
    recv = rows.new_empty(sum(recv_splits), h)
    comm.all_to_all(recv, rows, recv_splits, send_splits)
    # received rows are grouped by source rank, then slot; the grouped GEMM wants them grouped by slot
    slot_rows = recv_counts.sum(0)
    slot_of_row = torch.repeat_interleave(torch.arange(s, device=comm.device).repeat(w), recv_counts.reshape(-1))
    perm = torch.argsort(slot_of_row, stable=True)
    offsets = torch.cumsum(slot_rows, 0, dtype=torch.int32)
    y = torch.empty_like(recv)
    y[perm] = local.compute(recv[perm].to(x.device), offsets.to(x.device), act).to(comm.device)
    back = rows.new_empty(len(pair), h)
    comm.all_to_all(back, y, send_splits, recv_splits)
    back = back.to(x.device) * weights.reshape(-1)[pair].unsqueeze(1)
    out = torch.zeros(t, h, dtype=back.dtype, device=x.device).index_add_(0, pair // k, back)
    return LayerResult(out.to(x.dtype), slot_rows.to("cpu"))
