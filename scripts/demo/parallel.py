"""The demo trainer's data-parallel collectives (gloo, between its one-thread worker processes)."""

from __future__ import annotations

import torch


def all_reduce_mean(tensors: list[torch.Tensor], workers: int) -> None:
    """Average ``tensors`` in place over the workers (one flat gloo all-reduce)."""
    import torch.distributed as dist

    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat /= workers
    at = 0
    for t in tensors:
        t.copy_(flat[at:at + t.numel()].view_as(t))
        at += t.numel()


def all_reduce_sum(flat: torch.Tensor) -> None:
    """Sum ``flat`` in place over the workers."""
    import torch.distributed as dist

    dist.all_reduce(flat)


def mean_parts(loss: float, parts: dict[str, float], workers: int) -> tuple[float, dict[str, float]]:
    """The step's loss and its logged parts averaged over the workers (a part some worker's half lacked -- the
    match probe with no question it applies to -- over the workers that have it)."""
    import torch.distributed as dist

    names = ("answers", "token_probe", "match_probe")
    sums = torch.tensor([loss, *(parts.get(n, 0.0) for n in names), *(float(n in parts) for n in names)],
                        dtype=torch.float64)
    dist.all_reduce(sums)
    k = len(names)
    return sums[0].item() / workers, {n: sums[1 + i].item() / sums[1 + k + i].item()
                                      for i, n in enumerate(names) if sums[1 + k + i] > 0}
