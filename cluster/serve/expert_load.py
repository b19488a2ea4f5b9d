"""Expert routing load seen by the front-end: the sum of the per-request ``[num_layers, num_experts]`` histograms
that prefill workers report with each request's first token.

:func:`summarize` is pure: per layer, balancedness = mean / max expert load (1.0 = perfectly even, as SGLang and
vLLM define it) and the hottest expert. Worked example: one layer with loads [3, 1, 0, 0] -> mean 1.0, max 3 ->
balancedness 0.333, hottest expert 0.
"""

from __future__ import annotations

import numpy as np

REPLICATED = "every decode worker holds all experts (no expert parallelism)"


def placement_summary(decode_stats: list[dict]) -> str:
    """How experts are placed, from the decode workers' ``stats`` (an ``experts`` entry means an expert-parallel
    shard)."""
    sharded = [w for w in decode_stats if w.get("experts")]
    return f"expert-parallel: experts sharded across {len(sharded)} decode workers" if sharded else REPLICATED


def summarize(hist: np.ndarray | None) -> dict:
    """``{"num_layers", "num_experts", "tokens_routed", "balancedness": [per layer], "hottest_expert": [...]}``
    of a ``[num_layers, num_experts]`` load matrix (all zeros for ``None``)."""
    if hist is None or hist.size == 0:
        return {"num_layers": 0, "num_experts": 0, "tokens_routed": 0, "balancedness": [], "hottest_expert": []}
    assert hist.ndim == 2, hist.shape
    peak = hist.max(axis=1)
    balanced = np.where(peak > 0, hist.mean(axis=1) / np.maximum(peak, 1), 1.0)
    return {"num_layers": int(hist.shape[0]), "num_experts": int(hist.shape[1]), "tokens_routed": int(hist.sum()),
            "balancedness": [round(float(b), 4) for b in balanced],
            "hottest_expert": [int(i) for i in hist.argmax(axis=1)]}


class ExpertLoad:
    """Accumulates per-request routing histograms (requests of a text-only dense model add nothing)."""

    def __init__(self) -> None:
        self.hist: np.ndarray | None = None

    def add(self, request_hist: list[list[int]]) -> None:
        h = np.asarray(request_hist, dtype=np.int64)
        if h.ndim != 2:
            return
        if self.hist is None or self.hist.shape != h.shape:
            self.hist = np.zeros_like(h)
        self.hist += h

    def summary(self) -> dict:
        return summarize(self.hist)
