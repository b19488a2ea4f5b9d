"""The demo trainer's ``--optimizer muon``: the hidden layers' weight matrices step along their momentum
orthogonalized by a Newton-Schulz iteration (each expert's matrix on its own), every other parameter by AdamW.

An update's scale follows the matrix's shape (``0.2 * sqrt(max(rows, cols))``), so the AdamW learning rate serves
both. Written for this trainer, from the method's description (Jordan et al., 2024, "Muon: an optimizer for hidden
layers"); the Newton-Schulz coefficients are the published quintic ones."""

from __future__ import annotations

from collections.abc import Callable

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An approximately orthogonal matrix near ``g``'s polar factor (each matrix of a batch ``[..., rows, cols]``
    alone), computed in ``dtype`` and returned in float32."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    wide = x.size(-2) <= x.size(-1)
    if not wide:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    if not wide:
        x = x.mT
    return x.float()


def split_params(named: list[tuple[str, torch.nn.Parameter]], max_side: int = 512
                 ) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(matrices Muon steps, the rest for AdamW): the hidden layers' weights of two or three dimensions (an expert
    stack is a batch of matrices) whose smaller side is at most ``max_side`` (orthogonalizing the three 768-square
    mergers would take about a tenth of a step); embeddings, the patch embedding, norms, biases, routers' gates and an
    untied LM head go to AdamW."""
    muon, adamw = [], []
    for name, p in named:
        hidden = p.ndim in (2, 3) and not any(k in name for k in ("embed", "gate.weight", "lm_head"))
        (muon if hidden and min(p.shape[-2:]) <= max_side else adamw).append(p)
    return muon, adamw


class Muon(torch.optim.Optimizer):
    """Nesterov momentum, orthogonalized per matrix, with decoupled weight decay. ``share`` = (rank, workers,
    all-reduce of a flat tensor, summing): each data-parallel worker orthogonalizes every ``workers``-th matrix and
    one all-reduce hands the updates to all (the gradients must already be the same on every worker)."""

    def __init__(self, params, lr: float, momentum: float = 0.95, weight_decay: float = 0.0, ns_steps: int = 5,
                 ns_dtype: torch.dtype = torch.float32,
                 share: tuple[int, int, Callable[[torch.Tensor], None]] | None = None) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.ns_steps, self.ns_dtype, self.share = ns_steps, ns_dtype, share

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            mu = group["momentum"]
            rank, workers, reduce = self.share if self.share is not None else (0, 1, None)
            updates = []
            for i, p in enumerate(params):
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p)
                buf = state["momentum"]
                buf.mul_(mu).add_(p.grad)
                if i % workers == rank:
                    updates.append(orthogonalize(p.grad.add(buf, alpha=mu), self.ns_steps, self.ns_dtype))
                else:
                    updates.append(torch.zeros_like(p))
            if reduce is not None and workers > 1:
                flat = torch.cat([u.reshape(-1) for u in updates])
                reduce(flat)
                at = 0
                for u in updates:
                    u.copy_(flat[at:at + u.numel()].view_as(u))
                    at += u.numel()
            for p, u in zip(params, updates, strict=True):
                rows, cols = p.shape[-2:]
                p.mul_(1.0 - group["lr"] * group["weight_decay"])
                p.add_(u, alpha=-group["lr"] * 0.2 * max(rows, cols) ** 0.5)
        return None


def make_optimizers(model: torch.nn.Module, extra: list[torch.nn.Parameter], kind: str, lr: float,
                    muon_lr: float | None = None, bf16: bool = False,
                    share: tuple[int, int, Callable[[torch.Tensor], None]] | None = None
                    ) -> list[torch.optim.Optimizer]:
    """The trainer's optimizers: ``adamw`` (one AdamW over everything) or ``muon`` (Muon over the hidden matrices
    at ``muon_lr``, default ``lr``, orthogonalized in bfloat16 when ``bf16``; AdamW over the rest and ``extra``, the
    training probes)."""
    adamw_kw = dict(betas=(0.9, 0.98), weight_decay=0.01)
    if kind == "adamw":
        return [torch.optim.AdamW([*model.parameters(), *extra], lr=lr, **adamw_kw)]
    if kind != "muon":
        raise ValueError(f"unknown optimizer {kind!r} (known: adamw, muon)")
    hidden, rest = split_params(list(model.named_parameters()))
    muon = Muon(hidden, lr=lr if muon_lr is None else muon_lr, weight_decay=0.01,
                ns_dtype=torch.bfloat16 if bf16 else torch.float32, share=share)
    return [torch.optim.AdamW([*rest, *extra], lr=lr, **adamw_kw), muon]
