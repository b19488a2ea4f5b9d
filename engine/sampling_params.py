"""Sampling parameters, named as vLLM names them so users can move over unchanged."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.grammar_spec import StructuredOutputsParams

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
MAX_N = 16
_SEED_MIX = 0x9E3779B97F4A7C15  # choice i > 0 of a seeded request: a seed no small change of the user's seed gives


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy. ``top_k <= 0`` (or -1) disables top-k; ``top_p == 1`` disables nucleus
    sampling. ``seed`` makes one request's sampling reproducible regardless of what else is batched with it (choice
    ``i`` of ``n`` samples from :meth:`choice_seed`). ``min_tokens`` suppresses EOS and ``stop_token_ids`` until that
    many tokens were generated.

    Penalties (as vLLM applies them): ``presence_penalty`` / ``frequency_penalty`` (in [-2, 2]) subtract
    ``presence * [count > 0] + frequency * count`` over the tokens generated so far; ``repetition_penalty`` (> 0;
    1 = off) divides positive logits and multiplies negative ones of every token seen in the prompt or the output.

    ``logprobs``: None, or how many most likely alternatives to return beside each sampled token's log-probability
    (0 = the sampled token's only). Log-probabilities are those of the distribution the token was drawn from
    (*processed*: after penalties, a logits processor's mask, temperature and top-k / top-p; greedy rows skip
    temperature), see :mod:`engine.sampler`. ``prompt_logprobs``: the same for each prompt token after the first,
    under the model's own distribution at the position before it (nothing was sampled there: raw ``log_softmax``);
    such a prompt is computed whole (no prefix-cache hit). ``n``: independent choices decoded from one prefill of the prompt.
    ``return_logits`` (a Duet extension) returns, per token, the float32 logits after penalties and masks and
    before temperature and top-k / top-p.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must match (engine.grammar)

    def __post_init__(self) -> None:
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {v}")
        # bounded below: dividing a logit by a subnormal penalty overflows to inf (a failed step, not a 400)
        if not (math.isfinite(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 10):
            raise InvalidRequestError(f"repetition_penalty must be in [0.01, 10], got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {self.n}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        # what the wire (msgpack) and torch.Generator take: a bigger int would fail in a worker, not here
        for name in ("top_k", "max_tokens", "min_tokens"):
            v = getattr(self, name)
            if v is not None and not v < 2**63:
                raise InvalidRequestError(f"{name} must be below 2**63, got {v}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise InvalidRequestError(f"seed must be a 64-bit integer, got {self.seed}")
        if not all(0 <= t < 2**63 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice ``index``: ``seed`` itself for choice 0 (so ``n=1`` is unchanged), a mix of ``seed``
        and ``index`` for the others (deterministic, and not the seed of a neighbouring request's choice 0)."""
        if self.seed is None:
            return None
        if index == 0:
            return self.seed
        return (self.seed * _SEED_MIX + index * 0xBF58476D1CE4E5B9) % (2**63)
