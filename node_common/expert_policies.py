"""Expert-cache policies: what to pre-warm and what to evict. The call contract is in
:mod:`cluster.experts.expert_cache`.

A policy holds only what it was told (hints, observed counts); the simulator -- or a real decode worker -- owns
residency and copies. :class:`BeladyPolicy` is the exception by design: it reads the whole trace (the offline optimum).
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import numpy as np

POLICIES = ("lru", "duet", "belady")

if TYPE_CHECKING:
    from node_common.expert_trace import Trace


class CachePolicy:
    """Base: on demand only, nothing pre-warmed. Subclasses define :meth:`score` (lowest is evicted first)."""

    name = "base"

    def reset(self, num_layers: int, num_experts: int, capacity: int, top_k: int) -> None:
        """Start of a run: layer and expert counts, resident slots per layer, experts per token."""
        self.num_layers, self.num_experts, self.capacity, self.top_k = num_layers, num_experts, capacity, top_k
        self.now = 0

    def at(self, now: int) -> None:
        """The next layer to run is ``now`` (layer ``now % L`` of step ``now // L``)."""
        self.now = now

    def distance(self, layer: int) -> int:
        """Layer-times until ``layer`` runs next (0: it runs next)."""
        return (layer - self.now) % self.num_layers

    def on_requests(self, arrivals: list[tuple[str, np.ndarray]], departures: list[str]) -> None:
        """Requests joining the coming step (id, hint ``[L, E]``) and ids that left."""

    def prefetch_list(self) -> list[tuple[int, int]]:
        """``(layer, expert)`` pairs to copy before the coming step, best first."""
        return []

    def lookahead(self, layer: int, experts: np.ndarray) -> list[int]:
        """Of the experts ``layer`` will use in this step (known one layer early), those to copy now."""
        return []

    def observe(self, layer: int, counts: np.ndarray) -> None:
        """After ``layer`` ran: its ``[E]`` assignment counts."""

    def score(self, layer: int, expert: int) -> float:
        raise NotImplementedError

    def admit(self, incoming: tuple[int, int], victim: tuple[int, int], *, demand: bool) -> bool:
        """Whether ``incoming`` (layer, expert) -- copied on demand, or a speculative prefetch -- may evict
        ``victim``."""
        return self.score(*incoming) > self.score(*victim)


class LRUPolicy(CachePolicy):
    """On-demand loading; an expert used now is always kept, the least recently used one goes."""

    name = "lru"

    def reset(self, num_layers: int, num_experts: int, capacity: int, top_k: int) -> None:
        super().reset(num_layers, num_experts, capacity, top_k)
        self.last = np.full((num_layers, num_experts), -1, dtype=np.int64)

    def observe(self, layer: int, counts: np.ndarray) -> None:
        self.last[layer, counts > 0] = self.now

    def score(self, layer: int, expert: int) -> float:
        return float(self.last[layer, expert])

    def admit(self, incoming: tuple[int, int], victim: tuple[int, int], *, demand: bool) -> bool:
        return True


class BeladyPolicy(CachePolicy):
    """Belady's MIN without prefetch: after a miss, keep the experts whose next use is soonest (the one just copied
    competes too: it is dropped after use when every resident expert is needed sooner)."""

    name = "belady"

    def __init__(self, trace: Trace) -> None:
        self.uses = [[np.flatnonzero(np.array([s.counts[layer, e] > 0 for s in trace.steps])).tolist()
                      for e in range(trace.num_experts)] for layer in range(trace.num_layers)]

    def score(self, layer: int, expert: int) -> float:
        uses = self.uses[layer][expert]
        i = bisect.bisect_left(uses, (self.now - layer + self.num_layers - 1) // self.num_layers)
        return -float(uses[i] * self.num_layers + layer) if i < len(uses) else -np.inf


class DuetPolicy(CachePolicy):
    """Pre-warm from routing hints and a load forecast, one-layer look-ahead, lowest forecast evicted.

    Forecast of layer ``l``'s assignments to ``e`` in the coming step: ``h`` x (sum over requests in the batch of
    ``top_k`` x their hint's share of ``e`` in layer ``l``) + (1 - ``h``) x an exponentially weighted mean of
    observed counts (``decay``: weight of the past per step); ``h`` is ``hint_weight`` or, by default, learnt from
    how well each part predicted the counts so far (:meth:`weight`). The pre-warm list holds, per layer,
    the ``capacity`` experts with the highest forecast whose chance of use in the step, ``1 - exp(-forecast)``, is at
    least ``threshold``; look-ahead copies every expert the next layer will use. A speculative copy or one made on
    demand evicts only an expert with a lower forecast.
    """

    name = "duet"

    def __init__(self, *, decay: float = 0.9, hint_weight: float | None = None, threshold: float = 0.6,
                 prewarm: bool = True, lookahead: bool = True) -> None:
        assert 0 <= decay < 1 and (hint_weight is None or 0 <= hint_weight <= 1) and 0 <= threshold <= 1
        self.decay, self.hint_weight, self.threshold = decay, hint_weight, threshold
        self.prewarm, self.use_lookahead = prewarm, lookahead

    def reset(self, num_layers: int, num_experts: int, capacity: int, top_k: int) -> None:
        super().reset(num_layers, num_experts, capacity, top_k)
        self.ewma = np.zeros((num_layers, num_experts))
        self.hints: dict[str, np.ndarray] = {}
        self.hint_sum = np.zeros((num_layers, num_experts))
        self.last = np.full((num_layers, num_experts), -1.0)
        self.fit = np.zeros(2)  # decayed sums of (h - m)(c - m) and (h - m)^2: hint h, moving average m, counts c
        self._forecast: np.ndarray | None = None

    def on_requests(self, arrivals: list[tuple[str, np.ndarray]], departures: list[str]) -> None:
        self._forecast = None
        for rid in departures:
            h = self.hints.pop(rid, None)
            if h is not None:
                self.hint_sum -= h
        for rid, hist in arrivals:
            hist = np.asarray(hist, dtype=np.float64)
            tot = hist.sum(-1, keepdims=True)
            h = np.divide(hist, tot, out=np.zeros_like(hist), where=tot > 0) * self.top_k
            self.hints[rid] = h
            self.hint_sum += h

    def forecast(self) -> np.ndarray:
        """``[L, E]`` expected assignments in the coming step (cached until the next hint or observation)."""
        if self._forecast is None:
            w = self.weight() if self.hints else 0.0
            self._forecast = w * self.hint_sum + (1 - w) * self.ewma
        return self._forecast

    def weight(self) -> float:
        """The hints' share of the forecast: fixed, or (``hint_weight=None``) the least-squares blend of the two parts
        over recent steps, clipped to [0, 1] (1 before any step ran) -- hints that do not predict decode routing fade
        out."""
        if self.hint_weight is not None:
            return self.hint_weight
        return float(np.clip(self.fit[0] / self.fit[1], 0.0, 1.0)) if self.fit[1] > 0 else 1.0

    def prefetch_list(self) -> list[tuple[int, int]]:
        if not self.prewarm:
            return []
        f = self.forecast()
        out = []
        for layer in range(self.num_layers):
            top = np.argsort(-f[layer], kind="stable")[:self.capacity]
            out += [(layer, int(e)) for e in top if 1 - np.exp(-f[layer, e]) >= self.threshold]
        return out

    def lookahead(self, layer: int, experts: np.ndarray) -> list[int]:
        return [int(e) for e in experts] if self.use_lookahead else []

    def observe(self, layer: int, counts: np.ndarray) -> None:
        self._forecast = None
        if self.hints:
            d = self.hint_sum[layer] - self.ewma[layer]
            self.fit = 0.95 * self.fit + [(d * (counts - self.ewma[layer])).sum(), (d * d).sum()]
        self.ewma[layer] = self.decay * self.ewma[layer] + (1 - self.decay) * counts
        self.last[layer, counts > 0] = self.now

    def score(self, layer: int, expert: int) -> float:
        """Minus the forecast time to the next use: ``distance(layer) + L * (1 - p) / p`` with ``p`` the chance of
        use per step, ``1 - exp(-forecast)`` (a geometric wait); within one layer that orders by forecast."""
        p = 1.0 - np.exp(-self.forecast()[layer, expert])
        wait = self.distance(layer) + self.num_layers * (1 - p) / p if p > 0 else np.inf
        return -wait + 1e-9 * float(self.last[layer, expert])  # recency breaks ties


def capacity_for(resident: float, num_experts: int) -> int:
    """Device slots for a ``resident`` fraction of ``num_experts`` (at least one)."""
    assert 0 < resident <= 1
    return max(1, round(resident * num_experts))


def make_policy(name: str, trace: Trace, **kw) -> CachePolicy:
    """``"lru"``, ``"duet"`` or ``"belady"`` (Belady reads the trace's future; the others only what the simulator
    tells them)."""
    if name == "lru":
        return LRUPolicy()
    if name == "duet":
        return DuetPolicy(**kw)
    if name == "belady":
        return BeladyPolicy(trace)
    raise ValueError(f"unknown expert-cache policy {name!r}; choose from {', '.join(POLICIES)}")
