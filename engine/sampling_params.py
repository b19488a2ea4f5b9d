"""Sampling parameters, named as vLLM names them so users can move over unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy. ``top_k <= 0`` (or -1) disables top-k; ``top_p == 1`` disables nucleus
    sampling. ``seed`` makes one request's sampling reproducible regardless of what else is batched with it.
    ``min_tokens`` suppresses EOS and ``stop_token_ids`` until that many tokens were generated.
    ``return_logits`` (a Duet extension) returns the float32 logits each token was sampled from.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    return_logits: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise InvalidRequestError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
