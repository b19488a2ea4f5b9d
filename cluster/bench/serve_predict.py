"""What ``duet plan``'s simulators predict for a ``duet bench serve`` run: the planner checked against measurement.

Profiles come from the same checkpoint right before the run (:func:`cluster.plan_cmd.measure_profile`): one thread
for the workers (each has one core) and ``--colocated-threads`` for the colocated engine. What the engine profile
cannot see -- images decoded on the worker, the KV streamed out from the same core, the Ray calls, the first token's
way back -- is measured by a few short and long requests sent one at a time (:func:`calibrate`): a prefill scale
and a fixed per-request latency, plus a fixed cost per decode step. Each rate's own requests (arrival times, prompt tokens with images,
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


def calibrate(prof: Profile, ttfts: list[float], tpots: list[float | None], prompt_tokens: list[int],
              images: list[int]) -> Profile:
    """``prof`` fitted to its serving path, from requests served one at a time (a mix of short and long prompts):
    the measured TTFTs regressed (Theil-Sen) on the profile's prefill times, ``TTFT = latency + scale x prefill``, give how much
    slower the path's prefill is than the bare engine's (``scale``: image decoding, streaming the KV out, the
    actor's other threads on the same core -- all serialised on the worker, so the prefill terms are scaled by it)
    and a fixed per-request latency (RPCs, the transfer's tail, the first token's way back: ``transfer_base_s``).
    The fixed per-step cost is the median of their TPOT minus the profile's one-sequence decode step. Every term
    stays >= 0 and the scale >= 1."""
    prompt = np.array(prompt_tokens)
    engine = prof.prefill_s(prompt, np.array(images))
    ttft = np.array(ttfts)
    slopes = [(ttft[j] - ttft[i]) / (engine[j] - engine[i]) for i in range(len(engine))
              for j in range(i + 1, len(engine)) if abs(engine[j] - engine[i]) > 1e-6]
    scale = max(1.0, float(np.median(slopes))) if slopes else 1.0  # Theil-Sen: one slow outlier does not tilt it
    latency = max(0.0, float(np.median(ttft - scale * engine)))
    step = [t - (prof.decode_base_s + prof.decode_per_seq_s + (p + 1) * prof.decode_per_ctx_token_s)
            for t, p in zip(tpots, prompt_tokens, strict=True) if t is not None]
    per_step = max(0.0, float(np.median(step))) if step else 0.0
    return dataclasses.replace(
        prof, prefill_base_s=prof.prefill_base_s * scale, prefill_per_token_s=prof.prefill_per_token_s * scale,
        prefill_per_token2_s=prof.prefill_per_token2_s * scale, prefill_per_image_s=prof.prefill_per_image_s * scale,
        transfer_base_s=latency, transfer_per_token_s=0.0, transfer_exposed_fraction=1.0,
        decode_base_s=prof.decode_base_s + per_step,
        source=f"{prof.source}; serving path: prefill x{scale:.2f}, +{latency * 1e3:.1f} ms per request, "
               f"+{per_step * 1e3:.2f} ms per decode step, measured {time.strftime('%Y-%m-%d')}")


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
