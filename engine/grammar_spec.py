"""What a request's output must match (structured outputs), as vLLM's ``StructuredOutputsParams`` names it.

Pure data, no grammar library: it rides in :class:`~engine.sampling_params.SamplingParams` across process boundaries
(a plain map: every field is a string, a bool or a list of strings) and :mod:`engine.grammar` compiles it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from engine.errors import InvalidRequestError

MAX_GRAMMAR_CHARS = 256 * 1024  # a schema or grammar larger than this is refused (compile time grows with it)


@dataclass
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON Schema, as a dict or its JSON text; kept as text), ``json_object`` (any
    JSON object), ``regex``, ``choice`` (one of these strings), ``grammar`` (a Lark grammar, llguidance's dialect).

    ``whitespace_flexible``: let JSON hold whitespace between tokens (off by default: compact ``,`` and ``:``
    separators, so a sampled document cannot grow without end in blanks)."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)
        set_ = [f.name for f in fields(self) if f.name != "whitespace_flexible" and getattr(self, f.name)]
        if len(set_) != 1:
            raise InvalidRequestError(f"structured outputs take exactly one of json, json_object, regex, choice, "
                                      f"grammar (got {', '.join(set_) or 'none'})")
        for name in ("json", "regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or len(v) > MAX_GRAMMAR_CHARS):
                raise InvalidRequestError(f"structured outputs: {name} must be a string of at most "
                                          f"{MAX_GRAMMAR_CHARS} characters")
        if self.choice is not None and not (self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("structured outputs: choice must be a non-empty list of non-empty strings")

    @classmethod
    def coerce(cls, value: StructuredOutputsParams | dict[str, Any] | None) -> StructuredOutputsParams | None:
        """``value`` itself, or the params a plain map (``dataclasses.asdict``'s, off the wire) describes."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"structured_outputs must be a map, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        if set(value) - known:
            raise InvalidRequestError(f"structured_outputs: unknown field(s) {sorted(set(value) - known)}")
        return cls(**value)
