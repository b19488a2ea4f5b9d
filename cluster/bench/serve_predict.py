"""What ``duet plan``'s simulators predict for a ``duet bench serve`` run: the planner checked against measurement.

Profiles come from the same checkpoint right before the run (:func:`cluster.plan_cmd.measure_profile`): one thread
for the workers (each has one core) and ``--colocated-threads`` for the colocated engine. What the engine profile
cannot see -- the front-end tokenising and PNG-encoding images, the Ray calls, the KV transfer's exposed part,
streaming tokens back -- is measured by a few requests sent one at a time (:func:`calibrate`) and enters the profile as
its fixed per-request cost (``transfer_base_s``). Each rate's own requests (arrival times, prompt tokens with images,
output lengths) are then simulated as that run served them: a one-worker prefill pool feeding one decode worker, and
one colocated engine (:func:`predict`). :func:`errors` compares predicted with measured percentiles.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from cluster.planner import Profile, Requests, simulate_colocated_gpu, simulate_decode_worker, simulate_prefill_pool

TOLERANCE = 0.25  # the bound on |predicted / measured - 1|
CHECKED = ("ttft_s", "tpot_s")
QUANTILES = ("p50", "p90")


def requests_of(arrivals, prompt_tokens: list[int], rate: float) -> Requests:
    """The planner's view of one rate's requests (its arrival times at unit rate, as the simulators take them)."""
    images = [len(a.prompt.get("multi_modal_data", {}).get("image", [])) for a in arrivals]
    return Requests(np.array([a.at_s * rate for a in arrivals]), np.array(prompt_tokens, dtype=np.int64),
                    np.array(images, dtype=np.int64), np.array([a.max_tokens for a in arrivals], dtype=np.int64))


def calibrate(prof: Profile, ttfts: list[float], prompt_tokens: list[int], images: list[int]) -> Profile:
    """``prof`` with its fixed per-request cost set from requests served one at a time: the median of their measured
    TTFT minus the profile's prefill time (never below 0)."""
    model = prof.prefill_s(np.array(prompt_tokens), np.array(images))
    extra = max(0.0, float(np.median(np.array(ttfts) - model)))
    return dataclasses.replace(prof, transfer_base_s=extra, transfer_per_token_s=0.0, transfer_exposed_fraction=1.0,
                               source=f"{prof.source}; fixed per-request cost {extra * 1e3:.1f} ms measured "
                                      f"{time.strftime('%Y-%m-%d')}")


def _pcts(xs: np.ndarray) -> dict:
    return {f"p{q}": float(np.percentile(xs, q)) if len(xs) else None for q in (50, 90, 99)}


def predict(workers: Profile, colocated: Profile, req: Requests, rate: float) -> dict:
    """Simulated TTFT / TPOT percentiles of both systems at ``rate`` (``{"disaggregated": ..., "colocated": ...}``,
    each ``{"ttft_s": {p50, p90, p99}, "tpot_s": {...}}``; TPOT over requests with more than one output token)."""
    arrive = req.unit_arrivals / rate
    ttft = simulate_prefill_pool(workers, req, rate, 1)
    first = arrive + ttft
    order = np.argsort(first, kind="stable")
    tpot = np.zeros(len(first))
    tpot[order] = simulate_decode_worker(workers, first[order], req.prompt[order], req.output[order])
    c_ttft, c_tpot = simulate_colocated_gpu(colocated, req, rate)
    c_ttft = c_ttft + colocated.exposed_transfer_s(req.prompt)  # its fixed per-request cost (front-end, stream)
    multi = req.output > 1
    return {"disaggregated": {"ttft_s": _pcts(ttft), "tpot_s": _pcts(tpot[multi])},
            "colocated": {"ttft_s": _pcts(c_ttft), "tpot_s": _pcts(c_tpot[multi])}}


def errors(predicted: dict, measured: dict) -> dict:
    """``predicted / measured - 1`` per system, metric and quantile (None where either side has no value)."""
    out: dict = {}
    for system, pred in predicted.items():
        for metric in CHECKED:
            for q in QUANTILES:
                p, m = pred[metric][q], measured[system][metric][q]
                out[f"{system}.{metric}.{q}"] = None if p is None or not m else p / m - 1
    return out


def within(errs: dict, system: str = "disaggregated", tol: float = TOLERANCE) -> bool | None:
    """Whether every checked error of ``system`` is within ``tol`` (None when none could be computed)."""
    vals = [v for k, v in errs.items() if k.startswith(system + ".") and v is not None]
    return all(abs(v) <= tol for v in vals) if vals else None
