"""``duet plan``: size the prefill and decode pools for a workload, by discrete-event simulation.

Pure and seeded: the same profile, workload, SLO and seed give the same plan. One public entry, :func:`plan`.

Model (all times in seconds; a *profile* says how fast one GPU/worker is, :class:`Profile`):

* prefill of a prompt of ``n`` tokens with ``k`` images holding ``v`` image tokens takes ``prefill_s(n, k, v) =
  base + n * per_token + n**2 * per_token2 + k * per_image + v * per_visual_token`` on one worker (the vision
  tower's cost grows with the image: a Qwen3-VL image's tokens follow its size); the pool is one queue (a router sending each prompt to the
  first free worker; a heap of free times simulates it), and a worker that frees up prefills the prompts waiting for
  it together -- in arrival order, or shortest first as the engine's ``shortest`` policy -- up to a token budget, all
  of them ready at the end of that step (the simulators: :mod:`cluster.planner.plan_model`);
* the prompt's KV then moves to a decode worker: ``transfer_s(n) = base + n * per_token``, of which
  ``transfer_exposed_fraction`` is on the critical path (layer-wise streaming hides the rest); the first token reaches
  the user then, so ``TTFT = queue + prefill + exposed transfer``;
* a decode worker runs continuous batching of at most ``max_decode_batch`` sequences; one step over a batch of ``b``
  sequences holding ``c`` context tokens in all takes ``decode_step_s(b, c) = base + b * per_seq + c * per_ctx_token``
  and gives every sequence one token; taking a request in (receiving its KV, committing it) costs the worker
  ``join_base + n * join_per_token`` between steps. Requests reach decode workers at random (Poisson thinning), so
  each decode worker is simulated alone; ``TPOT = (last token - first token) / (output - 1)``;
* colocated serving: every GPU runs both; requests go to GPUs at random; a GPU runs chunked-prefill steps: one decode
  token for every running sequence plus the prompts that have arrived (up to a token budget), so running sequences
  wait for the step's prefill, which is what inflates colocated TPOT.

Goodput per GPU is the largest arrival rate at which TTFT p90 and TPOT p90 both meet the SLO, divided by the GPUs.
The pools decouple (TTFT is set by the prefill pool, TPOT by the decode pool), so for a budget of ``N`` GPUs the plan
finds ``r_d`` = one decode worker's largest rate (bisection on simulated rates), and for ``P`` prefill workers
``R_p(P)`` = the pool's largest rate; the split maximises ``min(R_p(P), (N - P) * r_d)`` -- ``R_p`` grows with ``P``
and the other term falls, so a binary search over ``P`` finds the crossing in ``O(log N)`` pool simulations. Colocated
goodput is ``N * r_c`` with ``r_c`` one GPU's largest rate. Hundreds of GPUs plan in about a second.

Worked example (``tests/cluster/planner/test_planner.py``): prefill 1 ms/token, decode step 20 ms flat, transfer free,
prompts 1000 tokens, outputs 50, SLO TTFT 2 s / TPOT 50 ms, 8 GPUs. A prefill worker takes 1 s per prompt, so each
serves under 1 req/s; a decode worker at 20 ms/step with a batch of 64 serves about 64 / (50 * 0.02) = 64 req/s. The
plan gives 7 prefill workers and 1 decode worker.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum

import numpy as np

from cluster.planner.plan_model import (  # noqa: F401 - the simulators and model types are part of the planner's API
    DEFAULT_BATCHED_TOKENS,
    SLO,
    PlanError,
    Profile,
    Requests,
    Workload,
    _check,
    simulate_colocated_gpu,
    simulate_decode_worker,
    simulate_prefill_pool,
)


# ------------------------------------------------------------------------------------------------------ the search
class Mode(str, Enum):
    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"


@dataclass(frozen=True)
class Plan:
    """The recommendation for ``gpus`` GPUs. Goodputs are req/s for the whole budget; ``needed`` is the smallest
    configuration of each mode that serves the workload's rate within SLO (absent without a rate); ``predicted`` the
    simulated latencies of the recommended configuration at the workload's rate (or 80% of its goodput)."""

    gpus: int
    prefill: int
    decode: int
    disaggregated_goodput: float
    colocated_goodput: float
    recommended: Mode
    reason: str
    needed: dict = field(default_factory=dict)
    predicted: dict = field(default_factory=dict)

    @property
    def pd_ratio(self) -> float:
        return self.prefill / self.decode

    def to_dict(self) -> dict:
        return {**asdict(self), "recommended": self.recommended.value, "pd_ratio": self.pd_ratio,
                "disaggregated_goodput_per_gpu": self.disaggregated_goodput / self.gpus,
                "colocated_goodput_per_gpu": self.colocated_goodput / self.gpus}


def p90(x: np.ndarray) -> float:
    return float(np.percentile(x, 90)) if len(x) else 0.0


def max_rate(meets, guess: float, rel_tol: float = 0.01) -> float:
    """The largest rate with ``meets(rate)`` true (assumed monotone), by doubling from ``guess`` then bisection;
    0.0 when even a vanishing rate misses."""
    lo, hi = 0.0, guess
    if not meets(guess * 1e-3):
        return 0.0
    for _ in range(60):
        if not meets(hi):
            break
        lo, hi = hi, hi * 2
    else:
        raise PlanError("the rate search did not converge: check the profile (a stage that takes no time?)")
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


class _Planner:
    def __init__(self, prof: Profile, wl: Workload, slo: SLO, seed: int, requests_per_worker: int) -> None:
        self.prof, self.wl, self.slo, self.seed, self.n = prof, wl, slo, seed, requests_per_worker
        self.base = wl.sample(requests_per_worker, seed)
        self._pool: dict[int, float] = {}
        # Work per request at full batch: a finite simulation cannot see a slow overload (the queue has no time to
        # grow), so a rate is only accepted below these capacities too (utilisation < 1).
        self.prefill_work = float(np.mean(prof.prefill_s(self.base.prompt, self.base.images, self.base.visual)))
        b = prof.max_decode_batch
        ctx = b * float(np.mean(self.base.prompt + self.base.output / 2))
        step = prof.decode_step_s(b, ctx)
        self.decode_work = step / b * float(np.mean(self.base.output - 1))
        self.prefill_guess = 1.0 / self.prefill_work
        self.decode_guess = 1.0 / max(self.decode_work, 1e-12)

    def pool_rate(self, workers: int) -> float:
        """``R_p(P)``: the prefill pool's largest rate meeting the TTFT target (memoised)."""
        if workers not in self._pool:
            req = self.wl.sample(max(self.n, 20 * workers), self.seed + 1)
            self._pool[workers] = max_rate(
                lambda r: r * self.prefill_work < workers and
                p90(simulate_prefill_pool(self.prof, req, r, workers)) <= self.slo.ttft_p90_s,
                self.prefill_guess * workers)
        return self._pool[workers]

    def decode_rate(self) -> float:
        """``r_d``: one decode worker's largest rate meeting the TPOT target."""
        req = self.base

        def meets(r: float) -> bool:
            if r * self.decode_work >= 1:
                return False
            tpot = simulate_decode_worker(self.prof, req.unit_arrivals / r, req.prompt, req.output)
            return p90(tpot[req.output > 1]) <= self.slo.tpot_p90_s
        return max_rate(meets, self.decode_guess)

    def colocated_rate(self) -> float:
        """``r_c``: one colocated GPU's largest rate meeting both targets."""
        def meets(r: float) -> bool:
            if r * (self.prefill_work + self.decode_work) >= 1:
                return False
            ttft, tpot = simulate_colocated_gpu(self.prof, self.base, r)
            return p90(ttft) <= self.slo.ttft_p90_s and p90(tpot[self.base.output > 1]) <= self.slo.tpot_p90_s
        return max_rate(meets, 1.0 / (self.prefill_work + self.decode_work))

    def best_split(self, gpus: int, r_d: float) -> tuple[int, float]:
        """The ``P`` in ``[1, gpus - 1]`` maximising ``min(R_p(P), (gpus - P) * r_d)`` and that goodput."""
        lo, hi = 1, gpus - 1
        while lo < hi:  # first P where the prefill pool is no longer the bottleneck
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if self.pool_rate(mid) < (gpus - mid) * r_d else (lo, mid)
        cands = {max(1, lo - 1), lo}
        good = {p: min(self.pool_rate(p), (gpus - p) * r_d) for p in sorted(cands)}
        best = max(good, key=lambda p: (good[p], -p))
        return best, good[best]

    def smallest_pool(self, rate: float, limit: int) -> int | None:
        """Fewest prefill workers whose pool serves ``rate`` (None beyond ``limit``)."""
        hi = 1
        while self.pool_rate(hi) < rate:  # doubling keeps the pools simulated near the answer's size
            if hi >= limit:
                return None
            hi = min(limit, hi * 2)
        lo = max(1, hi // 2)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if self.pool_rate(mid) < rate else (lo, mid)
        return lo

    def predict(self, mode: Mode, rate: float, prefill: int, decode: int, gpus: int) -> dict:
        """Latency percentiles of one joint simulation of the whole configuration at ``rate``."""
        workers = decode if mode is Mode.DISAGGREGATED else gpus
        req = self.wl.sample(max(self.n, 20 * workers), self.seed + 2)
        who = np.random.default_rng(self.seed + 3).integers(0, workers, len(req.prompt))
        ttft, tpot = np.zeros(len(who)), np.zeros(len(who))
        if mode is Mode.DISAGGREGATED:
            ttft = simulate_prefill_pool(self.prof, req, rate, prefill)
        for w in range(workers):
            idx = np.flatnonzero(who == w)
            if mode is Mode.DISAGGREGATED:
                first = req.unit_arrivals[idx] / rate + ttft[idx]
                order = idx[np.argsort(first, kind="stable")]
                tpot[order] = simulate_decode_worker(self.prof, np.sort(first), req.prompt[order], req.output[order])
            else:
                sub = req.subset(idx, workers)
                ttft[idx], tpot[idx] = simulate_colocated_gpu(self.prof, sub, rate)
        tp = tpot[req.output > 1]
        return {"mode": mode.value, "rate": rate, **{f"ttft_p{q}_s": float(np.percentile(ttft, q)) for q in (50, 90)},
                **{f"tpot_p{q}_s": float(np.percentile(tp, q)) if len(tp) else 0.0 for q in (50, 90)}}


def plan(profile: Profile, workload: Workload, slo: SLO, gpus: int, *, seed: int = 0,
         requests_per_worker: int = 1000) -> Plan:
    """Recommend the prefill/decode split of ``gpus`` GPUs (and whether to disaggregate at all).

    With ``workload.rate`` > 0 the mode needing fewer GPUs for that rate wins (colocated on a tie: one engine is
    simpler); otherwise the mode with more goodput per GPU at this budget."""
    _check(isinstance(gpus, int) and gpus >= 2, f"gpus must be an integer >= 2, got {gpus!r}")
    _check(requests_per_worker >= 50, "requests_per_worker must be >= 50")
    pl = _Planner(profile, workload, slo, seed, requests_per_worker)
    r_d, r_c = pl.decode_rate(), pl.colocated_rate()
    p, g_dis = pl.best_split(gpus, r_d)
    g_col = gpus * r_c
    needed: dict = {}
    if workload.rate > 0:
        needed = _needed(pl, workload.rate, r_d, r_c, limit=max(gpus, 4096))
        d, c = needed.get("disaggregated_gpus"), needed.get("colocated_gpus")
        colocated = c is not None and (d is None or c <= d)
        reason = (f"at {workload.rate:g} req/s colocated needs {c} GPUs, disaggregated {d}" if c or d else
                  f"no configuration up to {max(gpus, 4096)} GPUs meets the SLO at {workload.rate:g} req/s")
    else:
        colocated = g_col >= g_dis
        reason = f"goodput per GPU: colocated {g_col / gpus:.3g}, disaggregated {g_dis / gpus:.3g} req/s"
    mode = Mode.COLOCATED if colocated else Mode.DISAGGREGATED
    best = max(g_col if colocated else g_dis, 1e-9)
    rate = workload.rate if 0 < workload.rate <= best else 0.8 * best
    predicted = pl.predict(mode, rate, p, gpus - p, gpus) if best > 1e-9 else {}
    return Plan(gpus, p, gpus - p, g_dis, g_col, mode, reason, needed, predicted)


def _needed(pl: _Planner, rate: float, r_d: float, r_c: float, limit: int) -> dict:
    out: dict = {"colocated_gpus": math.ceil(rate / r_c - 1e-9) if r_c > 0 and rate / r_c <= limit else None}
    p = pl.smallest_pool(rate, limit)
    if p is not None and r_d > 0 and rate / r_d <= limit:
        d = max(1, math.ceil(rate / r_d - 1e-9))
        out |= {"disaggregated_gpus": p + d, "prefill": p, "decode": d}
    else:
        out["disaggregated_gpus"] = None
    return out
