"""A routing trace: per decode step, the (token, expert) assignments of every MoE layer, and the requests (with
their routing hints) that joined or left. The expert-cache simulation (:mod:`cluster.experts.expert_cache`) replays
it; :class:`node_common.expert_policies.BeladyPolicy` reads its future. JSON form: ``expert_cache``'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TRACE_VERSION = 1


@dataclass
class TraceStep:
    counts: np.ndarray  # [L, E] (token, expert) assignments
    arrivals: list[tuple[str, np.ndarray]] = field(default_factory=list)  # (request id, hint [L, E])
    departures: list[str] = field(default_factory=list)


@dataclass
class Trace:
    num_layers: int
    num_experts: int
    top_k: int
    steps: list[TraceStep]
    bytes_per_expert: float | None = None

    def load(self) -> np.ndarray:
        """``[L, E]`` total assignments over the trace (a placement's input)."""
        return sum((s.counts for s in self.steps), np.zeros((self.num_layers, self.num_experts), dtype=np.int64))

    def to_dict(self) -> dict:
        return {"version": TRACE_VERSION, "num_layers": self.num_layers, "num_experts": self.num_experts,
                "top_k": self.top_k, **({} if self.bytes_per_expert is None else {"bytes_per_expert": self.bytes_per_expert}),
                "steps": [{"counts": s.counts.tolist(), "arrive": [{"id": r, "hint": h.tolist()} for r, h in s.arrivals],
                           "leave": list(s.departures)} for s in self.steps]}

    @classmethod
    def from_dict(cls, d: dict) -> Trace:
        if d.get("version") != TRACE_VERSION:
            raise ValueError(f"trace version {d.get('version')!r}, expected {TRACE_VERSION}")
        shape = (d["num_layers"], d["num_experts"])
        steps = [TraceStep(np.asarray(s["counts"], dtype=np.int64).reshape(shape),
                           [(a["id"], np.asarray(a["hint"], dtype=np.int64).reshape(shape)) for a in s.get("arrive", [])],
                           list(s.get("leave", []))) for s in d["steps"]]
        return cls(d["num_layers"], d["num_experts"], d["top_k"], steps, d.get("bytes_per_expert"))
