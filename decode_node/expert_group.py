"""The expert-parallel group's process groups, its rendezvous, and the per-tick agreement that keeps it in lockstep.

Rendezvous: the cluster (:func:`cluster.control.expert_groups.form_group`) asks rank 0 to :func:`host_store` (a
``TCPStore`` on a free port of ``host``, loopback by default), then every rank constructs :class:`ExpertGroup` concurrently with that address and a ``group_key`` fresh per
group incarnation (keys live under ``duet/ep/<group_key>/``). Construction returns once all ``world`` ranks joined,
or raises :class:`GroupUnavailable` at the deadline; every later collective is bounded by ``timeout_s`` too.

Two groups: a gloo *control* group for the tick header, and a *data* group for the MoE all-to-alls -- the same gloo
group on CPU, NCCL when the model runs on CUDA (the dispatch then keeps its buffers on the GPU).

Lockstep: every rank calls :meth:`ExpertGroup.agree` once per tick, then (when the tick has work anywhere) runs
exactly one model pass -- its own batch, or an empty pass that makes the same collectives with no rows. The header is
one ``all_reduce(MAX)`` of ``[has_work, stop, ready, -ready]``, so all ranks learn the same facts at the same tick:
whether anyone has work, whether anyone is stopping, and the highest and lowest placement version staged. A
placement switches at the first tick where every rank staged the same newer version.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.errors import DuetError


class GroupUnavailable(DuetError):
    """The expert-parallel group could not be formed, or a peer left it (a collective failed or timed out). Another
    decode worker (outside the group) may serve the request, so the front-end retries it there."""

    code = "group_unavailable"
    retryable = True


@dataclass(frozen=True)
class TickPlan:
    """What every rank of the group agreed at one tick."""

    tick: int
    any_work: bool
    stop: bool
    switch_to: int | None  # the placement version every rank staged, when newer than the active one


def host_store(host: str = "127.0.0.1", timeout_s: float = 60.0) -> dist.TCPStore:
    """Rank 0's side of the rendezvous: a master TCPStore on a free port of ``host`` (``store.port``)."""
    return dist.TCPStore(host, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


class ExpertGroup:
    def __init__(self, *, host: str, port: int, rank: int, world: int, group_key: str, device: torch.device,
                 timeout_s: float = 60.0, bind: str | None = None) -> None:
        """Join the group whose store is at ``host:port``; ``bind``: this rank's own address for the gloo sockets
        (default ``host``, right when all ranks share the node)."""
        if not 0 <= rank < world:
            raise GroupUnavailable(f"rank {rank} outside a group of {world}")
        self.rank, self.world, self.key = rank, world, group_key
        self.device = device if device.type == "cuda" else torch.device("cpu")
        self.tick = 0
        timeout = timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(host, port, None, False, timeout)
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind or host)]
            opts._timeout = timeout
            self.ctl = dist.ProcessGroupGloo(dist.PrefixStore(f"duet/ep/{group_key}/ctl", store), rank, world, opts)
            self.data = self.ctl
            if self.device.type == "cuda":
                nccl_opts = dist.ProcessGroupNCCL.Options()
                nccl_opts._timeout = timeout
                self.data = dist.ProcessGroupNCCL(dist.PrefixStore(f"duet/ep/{group_key}/data", store), rank, world,
                                                  nccl_opts)
        except (RuntimeError, ValueError) as e:
            raise GroupUnavailable(f"expert-parallel group {group_key}: rank {rank}/{world} could not join: {e}") from e
        self._store = store  # keeps the rendezvous connection open for the group's life

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        try:
            self.data.alltoall_base(out, inp, out_splits, in_splits).wait()
        except RuntimeError as e:
            raise GroupUnavailable(f"expert-parallel all-to-all failed on rank {self.rank}: {e}") from e

    def agree(self, *, has_work: bool, stop: bool, staged: int, active: int) -> TickPlan:
        """The tick header (see the module docstring). ``staged``: the placement version this rank has loaded and
        could switch to now (``active`` when nothing is staged)."""
        header = torch.tensor([int(has_work), int(stop), staged, -staged], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        try:
            self.ctl.allreduce([header], opts).wait()
        except RuntimeError as e:
            raise GroupUnavailable(f"expert-parallel tick {self.tick} failed on rank {self.rank}: {e}") from e
        any_work, any_stop, hi, lo = (int(v) for v in header.tolist())
        lo = -lo
        plan = TickPlan(self.tick, bool(any_work), bool(any_stop), hi if hi == lo and hi > active else None)
        self.tick += 1
        return plan
