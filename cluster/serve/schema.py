"""The request and event types both APIs hand to :class:`~cluster.serve.service.InferenceService`, and the model's
default sampling (its ``generation_config.json``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

from engine.outputs import TokenLogprobs


@dataclass
class ImageInput:
    data: bytes
    mime_type: str = ""


@dataclass
class SamplingOptions:
    """What the client asked for; ``None`` takes the model's default (its generation_config)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's and the k most likely tokens'
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (completions' echo)
    n: int = 1
    structured_outputs: Any = None  # engine.grammar_spec.StructuredOutputsParams (cluster.serve.structured)


@dataclass
class GenerateInput:
    """One request, whichever API it came from: exactly one of ``prompt``, ``prompt_token_ids``, ``messages``."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None  # [{"role", "content"}], "<image>" marks each image's place
    images: list[ImageInput] = field(default_factory=list)
    raw_prompt: bool = False  # prompt as is, without the chat template
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    model: str = ""
    request_id: str = ""
    tools: Any = None  # cluster.serve.tool_calls.ToolRequest (chat with tools)


@dataclass(frozen=True)
class DeltaEvent:
    token_ids: list[int]
    text: str
    index: int = 0  # the choice (n > 1)
    logprobs: list[TokenLogprobs] | None = None  # one per token of token_ids, when asked
    # choice 0's first delta, when asked: the prompt's ids and logprobs (None for the first token)
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(frozen=True)
class ChoiceEnd:
    index: int
    finish_reason: str  # "stop" | "length" | "abort"
    stop: str  # the stop string that ended it, if any
    completion_tokens: int


@dataclass(frozen=True)
class FinalEvent:
    """The request's end. ``finish_reason`` / ``stop`` are choice 0's; ``choices`` has every choice's (by index);
    ``completion_tokens`` counts all choices' tokens."""

    request_id: str
    finish_reason: str  # "stop" | "length" | "abort"
    stop: str
    prompt_tokens: int
    completion_tokens: int
    timeline: dict  # RequestClock.timeline(...) plus "kv_transfer"
    choices: list[ChoiceEnd] = field(default_factory=list)


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> GenerationDefaults:
        """From ``generation_config.json`` (as vLLM's ``--generation-config auto``): ``do_sample: false`` means
        greedy, ``max_new_tokens`` the default ``max_tokens``."""
        path = Path(model_dir, "generation_config.json")
        try:
            cfg = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            cfg = {}
        greedy = cfg.get("do_sample") is False
        return cls(temperature=0.0 if greedy else float(cfg.get("temperature", 1.0)),
                   top_p=float(cfg.get("top_p", 1.0)), top_k=int(cfg.get("top_k", -1) or -1),
                   max_tokens=int(cfg.get("max_new_tokens") or 16))
