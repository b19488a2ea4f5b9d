"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, min_tokens.

Greedy rows take one batched argmax. Random rows are processed one by one because each request owns its
``torch.Generator`` (a request's samples must not depend on what else shares its batch); the per-row work is a few
vector ops over the vocabulary, O(batch) Python per step.
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def suppress_stop_tokens(logits: torch.Tensor, rows: list[int], banned: list[list[int]]) -> None:
    """In place: forbid EOS/stop tokens on rows that have not reached ``min_tokens`` yet."""
    for r, ids in zip(rows, banned, strict=True):
        if ids:
            logits[r, ids] = float("-inf")


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [S, V] float32 -> one token id per row."""
    out = torch.argmax(logits, dim=-1).tolist()
    for r, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        row = _filter_top_k_top_p(logits[r] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        out[r] = int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
    return out
