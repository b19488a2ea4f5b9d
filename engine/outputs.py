"""Request outputs, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    vision_s: float = 0.0  # seconds of vision-tower calls that encoded this request's images (shared calls counted whole)
    vision_ahead: bool = False  # its images were encoded before it was first scheduled (EngineConfig.vision_slice_s)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability and the ``top`` most likely tokens' (best first), under the distribution
    it was drawn from (:mod:`engine.sampler`). Wire form (msgpack, hand-off and worker events):
    ``[token_id, logprob, [[id, logprob], ...]]``."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    def to_wire(self) -> list:
        return [self.token_id, self.logprob, [[t, lp] for t, lp in self.top]]

    @classmethod
    def from_wire(cls, w: list) -> TokenLogprobs:
        """Inverse of :meth:`to_wire`; raises ValueError / TypeError on a malformed entry."""
        tok, lp, top = w
        return cls(int(tok), float(lp), [(int(t), float(x)) for t, x in top])


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" (RequestOutput.error) | None while running
    stop_reason: int | None = None
    logits: list[torch.Tensor] | None = None
    # one per token of token_ids, when SamplingParams.logprobs is set; the sequence's own list while it runs (it may
    # grow past token_ids: read [:len(token_ids)])
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # the choices this output reports on (all n once finished), by ``index``
    finished: bool  # every choice finished
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token (None for the first), when asked
    # set when the request failed in a step (engine.isolation): every choice then has finish_reason "error"
    error: str | None = None

    def tpot_s(self) -> float | None:
        m, n = self.metrics, len(self.outputs[0].token_ids)
        if m.first_token_time is None or m.finished_time is None or n < 2:
            return None
        return (m.finished_time - m.first_token_time) / (n - 1)
