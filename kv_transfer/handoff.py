"""The prefill -> decode hand-off: what travels in a transfer's ``finish`` frame beside the KV.

The prefill worker builds a :class:`Handoff` when a request's prompt is done and sends ``to_meta()`` as the
``finish(meta)`` dict; the decode worker parses the receiver's ``meta`` with :meth:`Handoff.from_meta` before it
commits the request. Fields:

* ``first_token``: the token prefill sampled (the decode side appends it; prefill never decodes past it);
* ``mrope_delta``: M-RoPE models (Qwen3-VL): generated token at sequence index ``i`` has position ``i + delta`` in
  all three rows (:mod:`engine.mrope`); 0 for text-only prompts and 1-D RoPE models. The decode side checks it
  against its own computation from the prompt (image sizes, no pixels) and fails the request with
  :class:`HandoffMismatch` when they differ, rather than decode at wrong positions;
* ``expert_hist``: the prompt's routing choices ``[MoE layers][experts]`` (routing hints for pre-warm and placement);
* ``generator_state``: a seeded request's sampler state after the first token (``torch.Generator.get_state`` bytes);
* ``compute_done_s``: wall time the last layer's KV was computed (transfer statistics);
* ``first_logprobs``: the first token's logprobs when the request asked for them, in the engine's wire form
  ``[token_id, logprob, [[id, logprob], ...]]`` (carried as it is: this layer never interprets it);
* ``prompt_logprobs``: when asked, one entry per prompt token (``None`` for the first), each in that wire form;
* ``choices``: an ``n > 1`` request's other first tokens, one map per choice 1..n-1: ``{"token", "generator_state"
  (optional), "logprobs" (optional)}``; the decode side forks them onto the prompt's blocks;
* ``stages``: where the prefill worker's time went, seconds on its own clock (the request's TTFT breakdown):
  ``{"prefill_queue_s", "vision_encode_s", "prefill_compute_s"}`` (names this layer passes on without reading);
* ``error``: set when the request failed on the prefill worker after its KV was computed and sent whole (its
  sampling, its grammar: one request's fault in a step); one line naming it. The decode side then frees the
  request's blocks and fails it as not retryable, and ``first_token`` means nothing.

Versions (``"v"``): 1 had no version field and no ``mrope_delta`` (parsed as delta 0, which an image prompt of an
M-RoPE model then fails against); 2 adds both; 3 adds ``first_logprobs``, ``prompt_logprobs`` and ``choices`` (absent in 1 and 2); 4 adds ``stages`` (optional); 5 adds ``error``
(optional; a version-4 receiver refuses it rather than decode from a failed prefill). Any
other version is a :class:`~kv_transfer.base.ProtocolError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kv_transfer.errors import ProtocolError

HANDOFF_VERSION = 5
LEGACY_VERSION = 1  # a meta map without "v"


class HandoffMismatch(ProtocolError):
    """The hand-off disagrees with what the decode side derived from the same prompt (e.g. the M-RoPE delta)."""


@dataclass(frozen=True)
class Handoff:
    first_token: int
    mrope_delta: int = 0
    expert_hist: list[list[int]] | None = None
    generator_state: bytes | None = None
    compute_done_s: float | None = None
    first_logprobs: list | None = None
    prompt_logprobs: list | None = None
    choices: list[dict[str, Any]] = field(default_factory=list)
    stages: dict[str, float] | None = None
    error: str | None = None
    version: int = HANDOFF_VERSION  # of the message it was parsed from

    def to_meta(self) -> dict[str, Any]:
        """The msgpack-able ``finish`` dict (always the current version)."""
        meta: dict[str, Any] = {"v": HANDOFF_VERSION, "first_token": int(self.first_token),
                                "mrope_delta": int(self.mrope_delta)}
        if self.expert_hist is not None:
            meta["expert_hist"] = self.expert_hist
        if self.generator_state is not None:
            meta["generator_state"] = self.generator_state
        if self.compute_done_s is not None:
            meta["compute_done_s"] = float(self.compute_done_s)
        if self.first_logprobs is not None:
            meta["first_logprobs"] = self.first_logprobs
        if self.prompt_logprobs is not None:
            meta["prompt_logprobs"] = self.prompt_logprobs
        if self.choices:
            meta["choices"] = self.choices
        if self.stages is not None:
            meta["stages"] = {str(k): float(v) for k, v in self.stages.items()}
        if self.error is not None:
            meta["error"] = str(self.error)
        return meta

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> Handoff:
        """Inverse of :meth:`to_meta`; also reads version-1 maps (no ``"v"``, delta 0). Raises
        :class:`ProtocolError` for another version or a malformed map."""
        if not isinstance(meta, dict):
            raise ProtocolError(f"hand-off is a {type(meta).__name__}, not a map")
        version = meta.get("v", LEGACY_VERSION)
        if not isinstance(version, int) or isinstance(version, bool) or not LEGACY_VERSION <= version <= HANDOFF_VERSION:
            raise ProtocolError(f"hand-off version {version!r} is not supported (expected <= {HANDOFF_VERSION})")
        try:
            delta = meta.get("mrope_delta", 0) if version >= 2 else 0
            if isinstance(delta, bool) or not isinstance(delta, int):
                raise TypeError(f"mrope_delta must be an int, got {delta!r}")
            state = meta.get("generator_state")
            if state is not None and not isinstance(state, bytes):
                raise TypeError("generator_state must be bytes")
            choices = meta.get("choices", [])
            if not isinstance(choices, list) or not all(isinstance(c, dict) and isinstance(c.get("token"), int)
                                                        for c in choices):
                raise TypeError("choices must be a list of maps with an int token")
            for c in choices:
                if c.get("generator_state") is not None and not isinstance(c["generator_state"], bytes):
                    raise TypeError("a choice's generator_state must be bytes")
            first_lp = meta.get("first_logprobs")
            prompt_lp = meta.get("prompt_logprobs")
            for name, v in (("first_logprobs", first_lp), ("prompt_logprobs", prompt_lp)):
                if v is not None and not isinstance(v, list):
                    raise TypeError(f"{name} must be a list")
            stages = meta.get("stages")
            if stages is not None and not (isinstance(stages, dict) and all(
                    isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                    for k, v in stages.items())):
                raise TypeError("stages must be a map of names to seconds")
            error = meta.get("error")
            if error is not None and not isinstance(error, str):
                raise TypeError("error must be a string")
            return cls(first_token=int(meta["first_token"]), mrope_delta=delta, expert_hist=meta.get("expert_hist"),
                       generator_state=state, compute_done_s=meta.get("compute_done_s"), first_logprobs=first_lp,
                       prompt_logprobs=prompt_lp, choices=choices,
                       stages=None if stages is None else {k: float(v) for k, v in stages.items()}, error=error,
                       version=version)
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"malformed hand-off: {e!r}") from e

    def generator(self) -> torch.Tensor | None:
        """``generator_state`` as the tensor ``torch.Generator.set_state`` takes (None without one)."""
        return None if self.generator_state is None else generator_from_state(self.generator_state)


def generator_to_state(generator: torch.Generator) -> bytes:
    return generator.get_state().numpy().tobytes()


def generator_from_state(state: bytes | None) -> torch.Tensor | None:
    """Inverse of :func:`generator_to_state`."""
    if state is None:
        return None
    return torch.from_numpy(np.frombuffer(state, dtype=np.uint8).copy())


def check_mrope_delta(received: Handoff, own: int, request_id: str) -> None:
    """Raise :class:`HandoffMismatch` unless the delta prefill sent equals the decode side's own ``own``."""
    if received.mrope_delta != own:
        how = "" if received.version >= 2 else f" (a version-{received.version} hand-off carries no delta)"
        raise HandoffMismatch(f"request {request_id}: prefill's M-RoPE delta {received.mrope_delta} != the decode "
                              f"side's {own} for the same prompt{how}")
