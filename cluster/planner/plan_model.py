"""What ``duet plan`` simulates (:mod:`cluster.planner.planner` searches over it): a worker's speed (:class:`Profile`), a
workload (:class:`Workload`, sampled into :class:`Requests`), SLO targets, and the three discrete-event simulators --
a prefill pool (:func:`simulate_prefill_pool`), one decode worker (:func:`simulate_decode_worker`) and one colocated
GPU (:func:`simulate_colocated_gpu`). The model they implement is described in :mod:`cluster.planner.planner`. Pure and
seeded.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, fields
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
    prefill_per_visual_token_s: float = 0.0  # the vision tower's time per image token (images of any size)
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

    def prefill_s(self, tokens: np.ndarray, images: np.ndarray, visual: np.ndarray | None = None) -> np.ndarray:
        """Prefill seconds of prompts of ``tokens`` tokens (image tokens included) with ``images`` images holding
        ``visual`` image tokens (None: no per-visual-token term)."""
        t = (self.prefill_base_s + tokens * self.prefill_per_token_s + tokens.astype(float) ** 2
             * self.prefill_per_token2_s + images * self.prefill_per_image_s)
        return t if visual is None else t + visual * self.prefill_per_visual_token_s

    def decode_step_s(self, batch: int, context_tokens: float) -> float:
        """One decode step over ``batch`` sequences holding ``context_tokens`` context tokens in all."""
        return self.decode_base_s + batch * self.decode_per_seq_s + context_tokens * self.decode_per_ctx_token_s

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
        return Requests(np.cumsum(gaps), prompt, imgs, out, imgs * self.tokens_per_image)


def _lognormal(rng: np.random.Generator, mean: float, cv: float, n: int) -> np.ndarray:
    if cv == 0:
        return np.full(n, float(mean))
    s2 = math.log1p(cv * cv)
    return rng.lognormal(math.log(mean) - s2 / 2, math.sqrt(s2), n)


@dataclass(frozen=True)
class Requests:
    """Arrival times at rate 1 (``unit_arrivals``), prompt tokens (images included), images, output tokens, and
    the image tokens among the prompt tokens (``visual``; None: not known, no per-visual-token cost)."""

    unit_arrivals: np.ndarray
    prompt: np.ndarray
    images: np.ndarray
    output: np.ndarray
    visual: np.ndarray | None = None

    def subset(self, idx: np.ndarray, time_scale: float = 1.0) -> Requests:
        """The requests at ``idx``, their arrival times multiplied by ``time_scale``."""
        return Requests(self.unit_arrivals[idx] * time_scale, self.prompt[idx], self.images[idx], self.output[idx],
                        None if self.visual is None else self.visual[idx])


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
    service = prof.prefill_s(req.prompt, req.images, req.visual).tolist()
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
        t += prof.decode_step_s(b, ctx_base + b * step)
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
    service = prof.prefill_s(req.prompt, req.images, req.visual).tolist()
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
            t += prof.decode_step_s(b, ctx_base + b * step)
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
