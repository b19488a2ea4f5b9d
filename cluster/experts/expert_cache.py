"""Tiered expert memory: which experts a decode worker keeps resident on its device, simulated over routing traces.

The model (what :func:`simulate` counts):

* **Device pool**: ``scope="global"`` (the default): one pool of ``resident x L x E`` expert slots shared by all
  layers, as a device's memory budget is; ``scope="layer"``: each layer has its own ``resident x E`` slots. The rest
  of the experts live in host memory. (With per-layer pools, a layer whose step needs more experts than its pool
  holds must stall on the excess whatever the policy: :func:`forced_stalls` is that floor.)
* **Time** runs in layer-times: layer ``l`` of step ``t`` runs at ``tau = t * L + l``. A **link** copies
  ``link_rate`` experts per layer-time (idle link time is not banked), earliest deadline first; a copy that
  completes during layer ``tau`` is usable from ``tau + 1``; a queued copy whose deadline passes is dropped uncopied.
* **Running a layer**: every (token, expert) assignment to a resident expert is a hit; each needed expert that is
  not resident is a **stalled load** (copied on demand while the layer waits), kept afterwards if there is room or
  the policy admits it over its lowest-scored resident expert.
* **Bytes copied** = (stalled loads + completed prefetches) x ``bytes_per_expert``.

What a policy is told, and when (the contract a real worker's pre-warm follows too):

1. ``at(now)`` -- the next layer to run is ``now`` (set before and after every layer).
2. ``on_requests(arrivals, departures)`` -- requests joining the batch of the coming step, each with its routing
   hint (the per-layer expert histogram prefill saw, ``[L, E]``), and the ids that left. Called one layer-time
   before that step (hints arrive with the KV hand-off, ahead of the request).
3. ``prefetch_list()`` -- right after (2): ``(layer, expert)`` pairs to copy for the coming step, best first.
4. ``lookahead(layer, experts)`` -- while layer ``l - 1`` runs, the experts layer ``l`` of this step will use
   (the next layer's router applied to the current hidden state); returns those to copy now. They are not evicted
   before layer ``l`` runs.
5. ``observe(layer, counts)`` -- after a layer ran, its ``[E]`` assignment counts.
6. ``score(layer, expert)`` -- eviction order, lowest first; ``admit(incoming, victim, demand=...)`` decides whether
   an expert copied on demand, or a speculative prefetch, may evict ``victim`` (look-ahead copies always may).

Policies (:mod:`node_common.expert_policies`): :class:`LRUPolicy` (on demand, least recently used out),
:class:`DuetPolicy` (pre-warm from hints and an exponentially weighted forecast, one-layer look-ahead, lowest
forecast out), :class:`BeladyPolicy` (offline MIN: on demand only, keeps the experts used soonest; reads the trace).

Trace JSON (:func:`load_trace` / :func:`save_trace`), one object::

    {"version": 1, "num_layers": L, "num_experts": E, "top_k": k,
     "bytes_per_expert": 196608,                                  # optional: size of one expert's weights
     "steps": [{"counts": [[int] * E] * L,                       # (token, expert) assignments of the step
                "arrive": [{"id": "r7", "hint": [[int] * E] * L}],  # requests joining before the step
                "leave": ["r3"]}, ...]}                           # requests gone since the previous step
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from node_common.expert_policies import POLICIES, BeladyPolicy, CachePolicy, DuetPolicy, LRUPolicy, capacity_for, make_policy
from node_common.expert_trace import Trace, TraceStep

__all__ = ["BeladyPolicy", "CachePolicy", "CacheStats", "DuetPolicy", "LRUPolicy", "Trace", "TraceStep",
           "capacity_for", "forced_stalls", "load_trace", "make_policy", "save_trace", "simulate", "zipf_trace"]

SCOPES = ("layer", "global")
QWEN3_30B_EXPERT_BYTES = 3 * 2048 * 768 * 2  # one Qwen3-30B-A3B expert in bf16: the synthetic traces' default


def load_trace(path: str | os.PathLike) -> Trace:
    """Read a trace written by :func:`save_trace` (format in the module docstring)."""
    return Trace.from_dict(json.loads(Path(path).read_text()))


def save_trace(trace: Trace, path: str | os.PathLike) -> Path:
    from cluster.report import write_json

    return write_json(path, trace.to_dict())


def zipf_trace(*, s: float = 1.2, num_layers: int = 4, num_experts: int = 16, top_k: int = 2, steps: int = 300,
               batch: int = 4, mean_output: float = 24.0, prompt_tokens: int = 64, affinity: float = 1.0,
               bytes_per_expert: float = QWEN3_30B_EXPERT_BYTES, seed: int = 0) -> Trace:
    """A synthetic decode trace. Per layer, experts are Zipf(``s``)-popular in a random order; each request tilts
    that by ``exp(affinity * N(0, 1))`` per expert (its own preferences). A request's hint is the histogram of
    ``prompt_tokens`` tokens' top-``k`` choices; each decode step it routes one token the same way. Requests leave
    after a geometric number of tokens (mean ``mean_output``) and new ones refill the batch to ``batch``."""
    assert 1 <= top_k <= num_experts and batch >= 1 and steps >= 1
    rng = np.random.default_rng(seed)
    pop = 1.0 / np.arange(1, num_experts + 1) ** s
    base = np.stack([pop[rng.permutation(num_experts)] for _ in range(num_layers)])  # [L, E]
    active: dict[str, tuple[np.ndarray, int]] = {}
    out, next_id, leave = [], 0, []
    for _ in range(steps):
        arrivals = []
        while len(active) < batch:
            logp = np.log(base) + affinity * rng.standard_normal(base.shape)
            rid = f"z{next_id}"
            next_id += 1
            hint = _choose(logp, top_k, prompt_tokens, rng).sum(0)
            active[rid] = (logp, int(rng.geometric(1.0 / mean_output)))
            arrivals.append((rid, hint))
        counts = np.zeros((num_layers, num_experts), dtype=np.int64)
        for rid, (logp, left) in list(active.items()):
            counts += _choose(logp, top_k, 1, rng)[0]
            active[rid] = (logp, left - 1)
        out.append(TraceStep(counts, arrivals, leave))
        leave = [rid for rid, (_, left) in active.items() if left <= 0]
        for rid in leave:
            del active[rid]
    return Trace(num_layers, num_experts, top_k, out, bytes_per_expert)


def _choose(logp: np.ndarray, k: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """``[n, L, E]`` 0/1: for each of ``n`` tokens and each layer, ``k`` distinct experts drawn without replacement
    with probabilities ``softmax(logp)`` (Gumbel top-k)."""
    g = logp[None] + rng.gumbel(size=(n, *logp.shape))
    top = np.argpartition(-g, k - 1, axis=-1)[..., :k]
    out = np.zeros(g.shape, dtype=np.int64)
    np.put_along_axis(out, top, 1, axis=-1)
    return out


# ----------------------------------------------------------------------------------------------------- simulation
@dataclass
class CacheStats:
    policy: str
    scope: str  # "layer": capacity per layer; "global": one pool for all layers
    capacity: int  # resident experts (per layer or in all)
    assignments: int = 0  # (token, expert) assignments
    hits: int = 0  # assignments whose expert was resident when its layer ran
    stalled_loads: int = 0  # experts copied on demand while their layer waited
    prefetches: int = 0  # copies completed ahead of need (look-ahead and pre-warm lists)
    bytes_copied: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.assignments if self.assignments else 1.0

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


def forced_stalls(trace: Trace, *, resident: float, scope: str = "global") -> int:
    """A lower bound on any policy's stalled loads, prefetching or not: a layer that needs more experts in one step
    than its pool holds must copy the excess while it runs (per-layer pools; one pool for all layers: the layer's
    need beyond the whole pool)."""
    L, E = trace.num_layers, trace.num_experts
    cap = capacity_for(resident, E) if scope == "layer" else capacity_for(resident, L * E)
    return int(sum(max(0, int((s.counts[layer] > 0).sum()) - cap) for s in trace.steps for layer in range(L)))


def simulate(trace: Trace, policy: CachePolicy, *, resident: float, scope: str = "global",
             bytes_per_expert: float | None = None, link_rate: float = 2.0) -> CacheStats:
    """Run ``trace`` through ``policy``, all experts in host memory at the start. ``scope="layer"``: each layer has
    ``capacity_for(resident, E)`` device slots; ``"global"``: one pool of ``capacity_for(resident, L * E)`` slots
    shared by all layers. ``link_rate``: expert copies per layer-time (``math.inf``: copies are instant).
    ``bytes_per_expert``: default the trace's, else 1 (bytes then count copies)."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    L, E = trace.num_layers, trace.num_experts
    cap = capacity_for(resident, E) if scope == "layer" else capacity_for(resident, L * E)
    policy.reset(L, E, cap, trace.top_k)
    sim = _Sim(policy, cap, L, link_rate, per_layer=scope == "layer")
    stats = CacheStats(policy.name, scope, cap)
    if trace.steps:  # the first step's list goes out one layer-time ahead too
        policy.at(0)
        sim.announce(trace.steps[0], deadline_step=0)
        sim.link(-1, stats)
    for t, step in enumerate(trace.steps):
        for layer in range(L):
            tau = t * L + layer
            policy.at(tau)
            if layer + 1 < L:
                ahead = policy.lookahead(layer + 1, np.flatnonzero(step.counts[layer + 1]))
                sim.enqueue(ahead, layer + 1, tau + 1, certain=True, need=ahead)
            elif t + 1 < len(trace.steps):
                sim.announce(trace.steps[t + 1], deadline_step=t + 1)
            missed = sim.run_layer(layer, step.counts[layer], stats)
            policy.observe(layer, step.counts[layer])
            policy.at(tau + 1)
            sim.keep(layer, missed)
            sim.link(tau, stats)
    bpe = bytes_per_expert if bytes_per_expert is not None else trace.bytes_per_expert or 1.0
    stats.bytes_copied = (stats.stalled_loads + stats.prefetches) * float(bpe)
    return stats


class _Sim:
    """Residency, the copy queue and the link; the policy decides what to copy and what to evict."""

    def __init__(self, policy: CachePolicy, cap: int, num_layers: int, link_rate: float, *, per_layer: bool) -> None:
        self.p, self.cap, self.L, self.rate = policy, cap, num_layers, link_rate
        self.pools: list[set[tuple[int, int]]] = [set() for _ in range(num_layers if per_layer else 1)]
        self.per_layer = per_layer
        self.queue: dict[tuple[int, int], tuple[int, bool]] = {}  # (layer, expert) -> (deadline tau, certain)
        self.need: set[tuple[int, int]] = set()  # the look-ahead's experts for the next layer: never evicted
        self.credit = 0.0

    def pool(self, layer: int) -> set[tuple[int, int]]:
        return self.pools[layer if self.per_layer else 0]

    def announce(self, step: TraceStep, *, deadline_step: int) -> None:
        self.p.on_requests(step.arrivals, step.departures)
        for layer, e in self.p.prefetch_list():
            self.enqueue([e], layer, deadline_step * self.L + layer, certain=False)

    def enqueue(self, experts, layer: int, deadline: int, *, certain: bool, need=None) -> None:
        if need is not None:
            self.need = {(layer, int(e)) for e in need}
        for e in experts:
            key = (layer, int(e))
            if key in self.pool(layer):
                continue
            old = self.queue.get(key)
            self.queue[key] = (min(deadline, old[0]) if old else deadline, certain or bool(old and old[1]))

    def run_layer(self, layer: int, counts: np.ndarray, stats: CacheStats) -> list[tuple[int, int]]:
        """Count hits and stalled loads of ``layer``; returns the experts it copied on demand."""
        needed = [(layer, int(e)) for e in np.flatnonzero(counts)]
        pool = self.pool(layer)
        stats.assignments += int(counts.sum())
        stats.hits += int(sum(counts[e] for key in needed if key in pool for e in [key[1]]))
        missed = [key for key in needed if key not in pool]
        stats.stalled_loads += len(missed)
        for key in needed:
            self.queue.pop(key, None)
        self.need = {k for k in self.need if k[0] != layer}
        return missed

    def keep(self, layer: int, missed: list[tuple[int, int]]) -> None:
        """After the layer ran: keep each expert copied on demand if there is room or the policy admits it."""
        for key in missed:
            self._place(key, demand=True, certain=False)

    def link(self, tau: int, stats: CacheStats) -> None:
        self.credit += self.rate
        for key in [k for k, (d, _) in self.queue.items() if d <= tau]:
            del self.queue[key]  # too late: its layer ran without it
        while self.queue and self.credit >= 1:
            key, (_, certain) = min(self.queue.items(), key=lambda kv: (kv[1][0], not kv[1][1], kv[0]))
            del self.queue[key]
            if key not in self.pool(key[0]) and self._place(key, demand=False, certain=certain):
                stats.prefetches += 1
                self.credit -= 1
        if not self.queue or math.isinf(self.credit):
            self.credit = 0.0

    def _place(self, key: tuple[int, int], *, demand: bool, certain: bool) -> bool:
        """Make ``key`` resident if there is room, or evict the policy's lowest-scored unprotected expert (a
        look-ahead copy always may; others only if :meth:`CachePolicy.admit` agrees)."""
        pool = self.pool(key[0])
        if len(pool) < self.cap:
            pool.add(key)
            return True
        cands = [x for x in pool if x not in self.need]
        if not cands:
            return False
        victim = min(cands, key=lambda x: (self.p.score(*x), x))
        if not certain and not self.p.admit(key, victim, demand=demand):
            return False
        pool.discard(victim)
        pool.add(key)
        return True
