"""What ``duet plan``'s simulators predict for a ``duet bench serve`` run: the planner checked against measurement.

Profiles come from the same checkpoint right before the run (:func:`cluster.cli.plan_cmd.measure_profile`): one thread
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
from pathlib import Path

import numpy as np

from duet_bench.serve_workload import (
    Arrival,
    NoBar,
    drive_colocated,
    drive_disagg,
    make_workload,
)
from cluster.planner.planner import (
    DEFAULT_BATCHED_TOKENS,
    Profile,
    Requests,
    simulate_colocated_gpu,
    simulate_decode_worker,
    simulate_prefill_pool,
)
from cluster.report import fmt, format_table, log, ms

TOLERANCE = 0.25  # the bound on |predicted / measured - 1|
CHECKED = ("ttft_s", "tpot_s")
QUANTILES = ("p50", "p90")


def requests_of(arrivals, prompt_tokens: list[int], rate: float) -> Requests:
    """The planner's view of one rate's requests (its arrival times at unit rate, as the simulators take them)."""
    return Requests(np.array([a.at_s * rate for a in arrivals]), np.array(prompt_tokens, dtype=np.int64),
                    np.array([a.images for a in arrivals], dtype=np.int64),
                    np.array([a.max_tokens for a in arrivals], dtype=np.int64))


def calibrate(prof: Profile, ttfts: list[float], tpots: list[float | None], prompt_tokens: list[int],
              images: list[int], service: list[float] | None = None, join: list[float] | None = None,
              outputs: list[int] | None = None) -> Profile:
    """``prof`` fitted to its serving path, from requests served one at a time (a mix of short and long prompts).

    The path's prefill is slower than the bare engine's (images decoded on the worker, the KV streamed out from the
    same core, the actor's other threads): its prefill terms are scaled by the Theil-Sen slope of the time the worker
    occupied its core per request (``service``, when the worker reports it: its process's CPU seconds, every thread)
    -- or, without it, of the measured TTFT -- against the profile's prefill time, and with ``service`` the median
    residual is a fixed cost per request added to ``prefill_base_s`` (the simulated worker is busy for it, so it
    queues the requests behind). What TTFT has beyond that is a fixed per-request latency that does not
    occupy the worker (RPCs, the KV's tail, the first token's way back): ``transfer_base_s``; with ``service`` it is
    fitted as ``a + b x prompt tokens`` (``transfer_base_s``, ``transfer_per_token_s``). Their TPOTs (one sequence
    each) give the path's decode step: its cost per context token (Theil-Sen against the prompt length) and a fixed
    per-step correction (negative when the profile's batch fit overshoots at one sequence). ``join``: the decode
    worker's time per request beyond its steps (its process's CPU seconds), fitted as ``a + b x prompt tokens``
    (``decode_join_base_s``, ``decode_join_per_token_s``): under load it delays the steps of the running batch; with
    ``outputs`` (each probe's tokens) its share of a probe's TPOT is taken out before the step is fitted, since the
    simulated worker charges it again."""
    prompt = np.array(prompt_tokens)
    engine = prof.prefill_s(prompt, np.array(images))
    ttft = np.array(ttfts)
    y = np.array(service) if service is not None else ttft
    scale = _theil_sen(engine, y) or 1.0
    scale = max(0.1, scale) if service is not None else max(1.0, scale)
    # what the worker spends on every request whatever its size (taking it in, the step's fixed part beyond the
    # engine's): the median residual of the scaled prefill, never below the scaled engine base
    fixed = max(float(np.median(y - scale * engine)), -scale * prof.prefill_base_s) if service is not None else 0.0
    rest = ttft - scale * engine - fixed  # latency that does not occupy the worker; the KV's tail grows with the prompt
    per_token = max(0.0, _theil_sen(prompt.astype(float), rest) or 0.0) if service is not None else 0.0
    latency = max(0.0, float(np.median(rest - per_token * prompt)))
    if join is not None and outputs is not None:
        tpots = [None if t is None else t - j / max(1, n - 1) for t, j, n in zip(tpots, join, outputs, strict=True)]
    measured = [(p, t) for p, t in zip(prompt_tokens, tpots, strict=True) if t is not None]
    per_ctx = prof.decode_per_ctx_token_s
    if len({p for p, _ in measured}) > 1:  # a one-sequence step on the path, against its context
        per_ctx = max(0.0, _theil_sen(np.array([p for p, _ in measured], float), np.array([t for _, t in measured])))
    one_seq = prof.decode_base_s + prof.decode_per_seq_s
    step = [t - (one_seq + p * per_ctx) for p, t in measured]
    per_step = float(np.median(step)) if step else 0.0
    per_step = max(per_step, 1e-6 - prof.decode_base_s)  # a step still takes time
    join_base = join_per_token = 0.0
    if join is not None:
        j = np.array(join, float)
        join_per_token = max(0.0, _theil_sen(prompt.astype(float), j) or 0.0)
        join_base = max(0.0, float(np.median(j - join_per_token * prompt)))
    return dataclasses.replace(
        prof, decode_join_base_s=join_base, decode_join_per_token_s=join_per_token,
        prefill_base_s=prof.prefill_base_s * scale + fixed, prefill_per_token_s=prof.prefill_per_token_s * scale,
        prefill_per_token2_s=prof.prefill_per_token2_s * scale, prefill_per_image_s=prof.prefill_per_image_s * scale,
        transfer_base_s=latency, transfer_per_token_s=per_token, transfer_exposed_fraction=1.0,
        decode_base_s=prof.decode_base_s + per_step, decode_per_ctx_token_s=per_ctx,
        source=f"{prof.source}; serving path: prefill x{scale:.2f} {fixed * 1e3:+.1f} ms, "
               f"+{latency * 1e3:.1f} ms per request +{per_token * 1e6:.1f} us per prompt token, "
               f"{per_step * 1e3:+.2f} ms per decode step "
               f"+{per_ctx * 1e6:.2f} us per context token, decode intake {join_base * 1e3:.1f} ms "
               f"+{join_per_token * 1e6:.1f} us per prompt token, measured {time.strftime('%Y-%m-%d')}")


def _theil_sen(x: np.ndarray, y: np.ndarray) -> float | None:
    """The median of pairwise slopes of ``y`` against ``x`` (None without two distinct x): robust to an outlier."""
    slopes = [(y[j] - y[i]) / (x[j] - x[i]) for i in range(len(x)) for j in range(i + 1, len(x))
              if abs(x[j] - x[i]) > 1e-9]
    return float(np.median(slopes)) if slopes else None


def _pcts(xs: np.ndarray) -> dict:
    return {f"p{q}": float(np.percentile(xs, q)) if len(xs) else None for q in (50, 90, 99)}


def predict(workers: Profile, colocated: Profile, req: Requests, rate: float, *,
            prefill_budget: int = DEFAULT_BATCHED_TOKENS, prefill_policy: str = "fcfs") -> dict:
    """Simulated TTFT / TPOT percentiles of both systems at ``rate`` (``{"disaggregated": ..., "colocated": ...}``,
    each ``{"ttft_s": {p50, p90, p99}, "tpot_s": {...}}``; TPOT over requests with more than one output token)."""
    arrive = req.unit_arrivals / rate
    ttft = simulate_prefill_pool(workers, req, rate, 1, max_batched_tokens=prefill_budget, policy=prefill_policy)
    first = arrive + ttft
    order = np.argsort(first, kind="stable")
    tpot = np.zeros(len(first))
    tpot[order] = simulate_decode_worker(workers, first[order], req.prompt[order], req.output[order])
    c_ttft, c_tpot = simulate_colocated_gpu(colocated, req, rate)
    c_ttft = c_ttft + colocated.exposed_transfer_s(req.prompt)  # its fixed per-request cost (front-end, stream)
    multi = req.output > 1
    service = float(np.mean(workers.prefill_s(req.prompt, req.images)))  # the prefill core's time per request
    return {"disaggregated": {"ttft_s": _pcts(ttft), "tpot_s": _pcts(tpot[multi]),
                              "prefill_cpu_s_per_request": service},
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


def max_error(errs: dict, system: str = "disaggregated") -> float | None:
    """The largest ``|error|`` of ``system`` (None when none could be computed)."""
    return max((abs(v) for k, v in errs.items() if k.startswith(system + ".") and v is not None), default=None)


def within(errs: dict, system: str = "disaggregated", tol: float = TOLERANCE) -> bool | None:
    """Whether every checked error of ``system`` is within ``tol`` (None when none could be computed)."""
    worst = max_error(errs, system)
    return None if worst is None else worst <= tol


def checks(rows: list[dict]) -> list[dict]:
    """Per measured rate with predictions: the disaggregated run's largest error and whether it is within bounds."""
    return [{"rate": r["rate"], "ok": within(r["prediction_errors"]), "max_abs_error": max_error(r["prediction_errors"])}
            for r in rows if "prediction_errors" in r]


def table(rows: list[dict]) -> str:
    """Predicted against measured TTFT / TPOT p50 and p90 (ms) per rate and system."""
    header = ["rate", "system", "TTFT p50 pred", "meas", "p90 pred", "meas", "TPOT p50 pred", "meas", "p90 pred",
              "meas", "max |err| %"]
    out = []
    for r in rows:
        for name, pred in r.get("predicted", {}).items():
            cells = [fmt(ms(x)) for metric in CHECKED for q in QUANTILES
                     for x in (pred[metric][q], r[name][metric][q])]
            worst = max_error(r["prediction_errors"], name)
            out.append([f"{r['rate']:g}/s", name, *cells, fmt(None if worst is None else 100 * worst)])
    return format_table(header, out)


# ------------------------------------------------------------------ profiles measured for a run, calibrated
def probe_requests(tok, seed: int, images: int) -> list[Arrival]:
    """Short and long prompts served one at a time: calibrate fits a scale and a latency from them."""
    return [dataclasses.replace(a, at_s=0.0, max_tokens=12) for frac in (0.0, 1.0) for a in
            make_workload(tok, 4, 1.0, seed=seed + 2, image_fraction=frac, output_mean=2, output_max=2,
                          images=images)]


def _measure_profile(model_dir: Path, threads: int):
    from cluster.cli.plan_cmd import measure_profile

    # decode batches as small as this load runs them, at a context like its prompts': an MoE step's cost per sequence
    # falls as more sequences share the experts they touch, and grows with what each one attends to, so a fit over
    # 1-16 sequences of 32 tokens underestimates the steps of 2-5 long sequences seen here
    return measure_profile(model_dir=model_dir, threads=threads, batches=(1, 2, 4, 8), contexts=(512, 1024))


def profile_colocated(model_dir: Path, llm, probe: list[Arrival], probe_tokens: list[int]):
    """The colocated engine's profile (its threads), calibrated by the probe requests (``probe_tokens`` prompt
    tokens each) served one at a time."""
    import torch

    log("measuring the colocated engine's profile for the planner check")
    prof = _measure_profile(model_dir, torch.get_num_threads())
    drive_colocated(llm, probe[-1:], NoBar())  # the first prompt of this size pays one-off allocations
    recs = [drive_colocated(llm, [a], NoBar())[0] for a in probe]
    return calibrate(prof, [r["ttft_s"] for r in recs], [r["tpot_s"] for r in recs], probe_tokens,
                     [a.images for a in probe])


def profile_workers(model_dir: Path, cluster, probe: list[Arrival], probe_tokens: list[int]):
    """The workers' profile (one thread), calibrated by the probe requests: the prefill worker's CPU time is what a
    request occupies its core with, and the decode worker's beyond its steps what taking the request in costs it (the
    idle loop's own rate taken out)."""
    log("measuring the workers' profile for the planner check")
    prof = _measure_profile(model_dir, 1)
    idle = _decode_idle_rate(cluster)
    drive_disagg(cluster, probe[-1:], NoBar())
    recs, service, join = [], [], []
    for a in probe:
        before, t0 = _worker_cpu_s(cluster), time.perf_counter()
        recs.append(drive_disagg(cluster, [a], NoBar())[0])
        after = _worker_cpu_s(cluster)
        service.append(after[0] - before[0])
        join.append(max(0.0, after[1] - before[1] - idle * (time.perf_counter() - t0)))
    return calibrate(prof, [r["ttft_s"] for r in recs], [r["tpot_s"] for r in recs], probe_tokens,
                     [a.images for a in probe], service=service, join=join, outputs=[r["tokens"] for r in recs])


def _worker_cpu_s(cluster) -> tuple[float, float]:
    """CPU seconds of the (one) prefill worker's process, every thread (prefilling, taking requests in and streaming
    KV out all occupy its core; its compute loop alone undercounts a request by ~15%), and of the decode worker's
    beyond its decode steps (taking requests in: RPCs, receiving KV, committing; and its polls)."""
    return prefill_cpu_s(cluster), _decode_overhead_s(cluster)


def _decode_overhead_s(cluster) -> float:
    st = _stats(cluster.decodes[0])
    return float(st["cpu_s"] - st["step_s"])


def _decode_idle_rate(cluster, seconds: float = 1.0) -> float:
    """CPU seconds per second the idle decode worker spends (its loop's polls), to take out of a request's cost."""
    before = _decode_overhead_s(cluster)
    time.sleep(seconds)
    return max(0.0, (_decode_overhead_s(cluster) - before) / seconds)


def prefill_cpu_s(cluster) -> float:
    return float(_stats(cluster.prefills[0])["cpu_s"])


def _stats(worker) -> dict:
    import ray

    from node_common import messages

    return messages.unpack(ray.get(worker.actor.stats.remote(), timeout=30))
