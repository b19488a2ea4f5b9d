"""Presence, frequency and repetition penalties, batched over the rows that have any (as vLLM defines them).

For row ``r`` with output token counts ``c`` (tokens generated so far) and ``seen`` (tokens in the prompt or the
output): ``logits -= frequency * c + presence * (c > 0)``; where ``seen``, positive logits are divided by
``repetition`` and negative ones multiplied by it. Worked example: logits ``[2, -1, 0.5]``, output ``[0, 0]``, prompt
``[1]``, frequency 0.5, presence 0.25, repetition 2 -> ``[2/2 - 1 - 0.25, -1*2, 0.5] = [-0.25, -2, 0.5]``.

Each sequence keeps its counts (:class:`PenaltyState`, ``[vocab]`` float32 on the logits' device), updated with the
tokens appended since the previous step: O(new tokens) Python per sequence per step, never O(context).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.sampling_params import SamplingParams


class Penalized(Protocol):
    """What the penalties read of a sequence (:class:`engine.sequence.Sequence`) and keep on it (``penalty``)."""

    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    penalty: PenaltyState | None

    @property
    def output_token_ids(self) -> list[int]: ...


@dataclass
class PenaltyState:
    counts: torch.Tensor  # [vocab] float32: each token's count in the output so far
    seen: torch.Tensor  # [vocab] bool: in the prompt or the output
    counted: int = 0  # output tokens folded into counts

    @classmethod
    def for_sequence(cls, seq: Penalized, vocab: int, device: torch.device) -> PenaltyState:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        prompt = torch.tensor(seq.token_ids[: seq.num_prompt_tokens], dtype=torch.long, device=device)
        seen[prompt.clamp_(0, vocab - 1)] = True
        return cls(torch.zeros(vocab, dtype=torch.float32, device=device), seen)

    def update(self, seq: Penalized) -> None:
        new = seq.output_token_ids[self.counted:]
        if new:
            ids = torch.tensor(new, dtype=torch.long, device=self.counts.device)
            self.counts.index_add_(0, ids, torch.ones(len(new), dtype=torch.float32, device=self.counts.device))
            self.seen[ids] = True
            self.counted += len(new)


def apply_penalties(logits: torch.Tensor, seqs: Sequence[Penalized]) -> None:
    """In place on ``logits`` ``[S, V]`` (row r is ``seqs[r]``'s): the penalties of the rows whose params set any."""
    rows = [r for r, q in enumerate(seqs) if q.params.has_penalties]
    if not rows:
        return
    vocab, dev = logits.shape[-1], logits.device
    states = []
    for r in rows:
        seq = seqs[r]
        if seq.penalty is None:
            seq.penalty = PenaltyState.for_sequence(seq, vocab, dev)
        seq.penalty.update(seq)
        states.append(seq.penalty)
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    counts = torch.stack([s.counts for s in states])
    seen = torch.stack([s.seen for s in states])
    ps = [seqs[r].params for r in rows]
    col = lambda xs: torch.tensor(xs, dtype=logits.dtype, device=dev).unsqueeze(1)  # noqa: E731
    rep, freq, pres = (col([p.repetition_penalty for p in ps]), col([p.frequency_penalty for p in ps]),
                       col([p.presence_penalty for p in ps]))
    sub = logits.index_select(0, idx)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    logits.index_copy_(0, idx, sub)
