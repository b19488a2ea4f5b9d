"""``duet plan``: size the prefill and decode pools for a workload, by discrete-event simulation.

Pure and seeded: the same profile, workload, SLO and seed give the same plan. One public entry, :func:`plan`.

Model (all times in seconds; a *profile* says how fast one GPU/worker is, :class:`Profile`):

* prefill of a prompt of ``n`` tokens with ``k`` images takes ``prefill_s(n, k) = base + n * per_token +
  n**2 * per_token2 + k * per_image`` on one worker; the pool is one FCFS queue (a router sending each prompt to the
  first free worker; a heap of free times simulates it), and a worker that frees up prefills the prompts waiting for
  it together, up to a token budget, all of them ready at the end of that step;
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

Worked example (``tests/cluster/test_planner.py``): prefill 1 ms/token, decode step 20 ms flat, transfer free,
prompts 1000 tokens, outputs 50, SLO TTFT 2 s / TPOT 50 ms, 8 GPUs. A prefill worker takes 1 s per prompt, so each
serves under 1 req/s; a decode worker at 20 ms/step with a batch of 64 serves about 64 / (50 * 0.02) = 64 req/s. The
plan gives 7 prefill workers and 1 decode worker.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from pathlib import Path

import numpy as np

from engine.errors import DuetError

DEFAULT_BATCHED_TOKENS = 4096  # a colocated step's token budget: the engine's default max_num_batched_tokens


class PlanError(DuetError):
    """A profile, workload or SLO that cannot be planned (the message names the field)."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise PlanError(msg)


@dataclass(frozen=True)
class Profile:
    """How fast one worker is. ``source`` says where the numbers came from (measured, or assumed)."""

    prefill_base_s: float = 0.0
    prefill_per_token_s: float = 1e-4
    prefill_per_token2_s: float = 0.0
    prefill_per_image_s: float = 0.0
    decode_base_s: float = 0.01
    decode_per_seq_s: float = 0.0
    decode_per_ctx_token_s: float = 0.0
    decode_join_base_s: float = 0.0  # a decode worker's time to take a request in (its KV, the commit), per request
    decode_join_per_token_s: float = 0.0  # ... and per prompt token; the step it joins in takes that much longer
    max_decode_batch: int = 64
    transfer_base_s: float = 0.0
    transfer_per_token_s: float = 0.0
    transfer_exposed_fraction: float = 1.0
    source: str = "assumed"

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "source":
                _check(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0, f"profile.{f.name} must be a "
                                                                                     f"finite number >= 0, got {v!r}")
        _check(self.max_decode_batch >= 1, "profile.max_decode_batch must be >= 1")
        _check(self.transfer_exposed_fraction <= 1, "profile.transfer_exposed_fraction must be <= 1")
        _check(self.decode_base_s + self.decode_per_seq_s > 0, "profile: a decode step must take time")
        _check(self.prefill_base_s + self.prefill_per_token_s + self.prefill_per_token2_s > 0,
               "profile: a prefill must take time")

    def prefill_s(self, tokens: np.ndarray, images: np.ndarray) -> np.ndarray:
        return (self.prefill_base_s + tokens * self.prefill_per_token_s + tokens.astype(float) ** 2
                * self.prefill_per_token2_s + images * self.prefill_per_image_s)

    def exposed_transfer_s(self, tokens: np.ndarray) -> np.ndarray:
        return (self.transfer_base_s + tokens * self.transfer_per_token_s) * self.transfer_exposed_fraction

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known - {"comment", "notes"})
        _check(not unknown, f"profile: unknown fields {unknown} (known: {sorted(known)})")
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise PlanError(f"profile {path}: {e}") from None


@dataclass(frozen=True)
class Workload:
    """Requests: Poisson arrivals at ``rate`` req/s (0: only goodput is asked); prompt and output lengths lognormal
    with the given means and ``*_cv`` (0: fixed); a request has ``images`` images with probability
    ``image_fraction``, each adding ``tokens_per_image`` prompt tokens."""

    rate: float = 0.0
    prompt_mean: float = 512
    prompt_cv: float = 0.0
    output_mean: float = 128
    output_cv: float = 0.0
    image_fraction: float = 0.0
    images: int = 1
    tokens_per_image: int = 256

    def __post_init__(self) -> None:
        _check(math.isfinite(self.rate) and self.rate >= 0, f"workload.rate must be >= 0, got {self.rate}")
        _check(self.prompt_mean >= 1, f"workload.prompt_mean must be >= 1, got {self.prompt_mean}")
        _check(self.output_mean >= 1, f"workload.output_mean must be >= 1, got {self.output_mean}")
        _check(self.prompt_cv >= 0 and self.output_cv >= 0, "workload: *_cv must be >= 0")
        _check(0 <= self.image_fraction <= 1, f"workload.image_fraction must be in [0, 1], got {self.image_fraction}")
        _check(self.images >= 0 and self.tokens_per_image >= 0, "workload: images and tokens_per_image must be >= 0")

    def sample(self, n: int, seed: int) -> Requests:
        """``n`` requests at unit rate (divide ``gaps`` by a rate to use them); deterministic in ``seed``."""
        rng = np.random.default_rng(seed)
        gaps = rng.exponential(1.0, n)
        imgs = np.where(rng.random(n) < self.image_fraction, self.images, 0)
        prompt = np.maximum(1, np.round(_lognormal(rng, self.prompt_mean, self.prompt_cv, n))).astype(np.int64)
        prompt += imgs * self.tokens_per_image
        out = np.maximum(1, np.round(_lognormal(rng, self.output_mean, self.output_cv, n))).astype(np.int64)
        return Requests(np.cumsum(gaps), prompt, imgs, out)


def _lognormal(rng: np.random.Generator, mean: float, cv: float, n: int) -> np.ndarray:
    if cv == 0:
        return np.full(n, float(mean))
    s2 = math.log1p(cv * cv)
    return rng.lognormal(math.log(mean) - s2 / 2, math.sqrt(s2), n)


@dataclass(frozen=True)
class Requests:
    """Arrival times at rate 1 (``unit_arrivals``), prompt tokens (images included), images, output tokens."""

    unit_arrivals: np.ndarray
    prompt: np.ndarray
    images: np.ndarray
    output: np.ndarray


@dataclass(frozen=True)
class SLO:
    ttft_p90_s: float = 2.0
    tpot_p90_s: float = 0.1

    def __post_init__(self) -> None:
        _check(self.ttft_p90_s > 0 and self.tpot_p90_s > 0, "slo: TTFT and TPOT targets must be > 0")


# ------------------------------------------------------------------------------------------------------ simulators
def simulate_prefill_pool(prof: Profile, req: Requests, rate: float, workers: int, *,
                          max_batched_tokens: int = DEFAULT_BATCHED_TOKENS, policy: str = "fcfs") -> np.ndarray:
    """TTFT of every request through a pool of ``workers`` prefill workers at ``rate`` req/s.

    A worker that frees up takes prompts that have arrived into one step, as the engine schedules them: ``fcfs`` in
    arrival order, as many as ``max_batched_tokens`` holds (at least one); ``shortest`` (the engine's
    ``scheduling_policy``) shortest first, each at most twice the prompt tokens already in the step. The step takes
    their prefill times together and every prompt in it has its KV at the step's end (a prompt waits for the others
    in its step, which one prompt at a time would not charge it). ``shortest``'s age limit is not modelled."""
    if policy not in ("fcfs", "shortest"):
        raise ValueError(f"policy must be 'fcfs' or 'shortest', got {policy!r}")
    arrive = (req.unit_arrivals / rate).tolist()
    service = prof.prefill_s(req.prompt, req.images).tolist()
    prompts = req.prompt.tolist()
    free = [0.0] * workers
    done = np.empty(len(arrive))
    waiting: list[tuple[int, int]] = []  # (key, index): arrival order for fcfs, prompt tokens for shortest
    nxt, n, left, clock = 0, len(arrive), len(arrive), 0.0
    while left:
        start = max(clock, heapq.heappop(free))  # never before a prompt already taken from the queue
        if not waiting:
            start = max(start, arrive[nxt])
        clock = start
        while nxt < n and arrive[nxt] <= start:
            heapq.heappush(waiting, (prompts[nxt] if policy == "shortest" else nxt, nxt))
            nxt += 1
        end, tokens, batch = start, 0, []
        while waiting:
            i = waiting[0][1]
            if batch and (tokens + prompts[i] > max_batched_tokens
                          or (policy == "shortest" and prompts[i] > 2 * tokens)):
                break
            heapq.heappop(waiting)
            batch.append(i)
            end += service[i]
            tokens += prompts[i]
        done[batch] = end
        left -= len(batch)
        heapq.heappush(free, end)
    return done - np.asarray(arrive) + prof.exposed_transfer_s(req.prompt)


def simulate_decode_worker(prof: Profile, first_token: np.ndarray, prompt: np.ndarray, output: np.ndarray
                           ) -> np.ndarray:
    """TPOT of every request on one decode worker; ``first_token`` (sorted) is when each one's KV arrived.

    Sequences join at step boundaries, FCFS, up to ``max_decode_batch``; taking one in costs the worker
    ``decode_join_base_s + decode_join_per_token_s * prompt`` before the next step. Context sums are kept
    incrementally (a sequence that joined at step ``j`` with prompt ``p`` holds ``p + step - j`` tokens), so a step
    costs O(log b)."""
    n = len(first_token)
    tpot = np.zeros(n)
    t, step, nxt = 0.0, 0, 0
    ends: list[tuple[int, int]] = []  # (step at which the sequence emits its last token, index)
    ctx_base = 0  # sum over running of prompt - join step
    arrivals, prompts, outs = first_token.tolist(), prompt.tolist(), output.tolist()
    join = (prof.decode_join_base_s + prof.decode_join_per_token_s * np.asarray(prompt, float)).tolist()
    while nxt < n or ends:
        if not ends and arrivals[nxt] > t:
            t = arrivals[nxt]
        while nxt < n and arrivals[nxt] <= t and len(ends) < prof.max_decode_batch:
            t += join[nxt]  # taking it in delays the batch's next step
            if outs[nxt] <= 1:
                nxt += 1
                continue
            heapq.heappush(ends, (step + outs[nxt] - 1, nxt))  # the first token came from prefill
            ctx_base += prompts[nxt] - step
            nxt += 1
        if not ends:
            continue
        b = len(ends)
        t += prof.decode_base_s + b * prof.decode_per_seq_s + (ctx_base + b * step) * prof.decode_per_ctx_token_s
        step += 1
        while ends and ends[0][0] <= step:
            _, i = heapq.heappop(ends)
            ctx_base -= prompts[i] - (step - outs[i] + 1)
            tpot[i] = (t - arrivals[i]) / (outs[i] - 1)
    return tpot


def simulate_colocated_gpu(prof: Profile, req: Requests, rate: float, *,
                           max_batched_tokens: int = DEFAULT_BATCHED_TOKENS) -> tuple[np.ndarray, np.ndarray]:
    """TTFT and TPOT of every request on one GPU that prefills and decodes in the same steps.

    As a chunked-prefill engine schedules: each step runs one decode token for every running sequence together with
    the prompts that have arrived (FCFS, as many as ``max_batched_tokens`` holds, at least one); the step takes the
    prompts' prefill time plus the decode step's, so running sequences wait for the step's prefill (what inflates
    colocated TPOT) while prompts that arrive together share one step. A prompt's first token comes at the end of its
    step; it decodes from the next."""
    arrive = (req.unit_arrivals / rate).tolist()
    service = prof.prefill_s(req.prompt, req.images).tolist()
    prompts, outs = req.prompt.tolist(), req.output.tolist()
    n = len(arrive)
    ttft, tpot, first = np.zeros(n), np.zeros(n), [0.0] * n
    t, step, nxt, ctx_base = 0.0, 0, 0, 0
    ends: list[tuple[int, int]] = []  # (step at which the sequence emits its last token, index)
    while nxt < n or ends:
        if not ends and arrive[nxt] > t:
            t = arrive[nxt]
        batch, tokens = [], 0
        while (nxt < n and arrive[nxt] <= t and len(ends) + len(batch) < prof.max_decode_batch
               and (not batch or tokens + prompts[nxt] <= max_batched_tokens)):
            batch.append(nxt)
            tokens += prompts[nxt]
            nxt += 1
        b = len(ends)
        t += sum(service[i] for i in batch)
        if b:
            t += prof.decode_base_s + b * prof.decode_per_seq_s + (ctx_base + b * step) * prof.decode_per_ctx_token_s
            step += 1
            while ends and ends[0][0] <= step:
                _, i = heapq.heappop(ends)
                ctx_base -= prompts[i] - (step - outs[i] + 1)
                tpot[i] = (t - first[i]) / (outs[i] - 1)
        for i in batch:
            first[i] = t
            ttft[i] = t - arrive[i]
            if outs[i] > 1:
                heapq.heappush(ends, (step + outs[i] - 1, i))
                ctx_base += prompts[i] - step
    return ttft, tpot


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
        self.prefill_work = float(np.mean(prof.prefill_s(self.base.prompt, self.base.images)))
        b = prof.max_decode_batch
        ctx = b * float(np.mean(self.base.prompt + self.base.output / 2))
        step = prof.decode_base_s + b * prof.decode_per_seq_s + ctx * prof.decode_per_ctx_token_s
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
                sub = Requests(req.unit_arrivals[idx] * workers, req.prompt[idx], req.images[idx], req.output[idx])
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
