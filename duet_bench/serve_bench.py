"""``duet bench serve [MODEL_DIR]``: open-loop serving, colocated engine against the disaggregated cluster.

Workload (:mod:`duet_bench.serve_workload`, deterministic in the seed): Poisson arrivals at each ``--rates``
rate; a request is image-heavy with probability ``--image-fraction`` (a demo-task question with one or two images, as
:func:`duet_testing.demo_tasks.make_dataset` makes them) or else text-only (several demo-corpus sentences); its output length
is drawn from a geometric distribution with mean ``--output-mean`` (capped at ``--output-max``), EOS ignored so every
request runs to its drawn length. Both systems get the same requests at the same times in the same run, each rate
starting with no cached image encodings (the rates replay the same images):

* colocated -- the in-process :class:`engine.LLM` with ``--colocated-threads`` torch threads (default 2: the cores
  the two workers get), driven step by step: arrivals are added between steps with their scheduled arrival time, so
  a request that arrives during a long step is charged the wait;
* disaggregated -- a 1 prefill + 1 decode :class:`~cluster.control.disagg.DisaggCluster` (one thread each, pinned to a
  core of its own unless ``--no-pin``; KV over ``--kv-transport``), each request started by an asyncio task at its
  arrival time and streamed. Its prefill worker schedules ``--prefill-policy`` (default ``fcfs``; ``shortest``
  gives short prompts steps of their own: lower TTFT at light load, but more, smaller steps cost its core ~30% more
  per request, so it saturates sooner) within a step budget of ``--prefill-batched-tokens`` (default: the engine's
  4096 tokens).

The colocated engine runs every rate first, before the cluster is started: an idle cluster on the same cores (its
actors and their RPCs) slowed the colocated engine's two-thread steps enough to cut its goodput by ~20%.

``MODEL_DIR`` ``bench`` runs the ``duet bench`` model (54M parameters, 256 visual tokens per image), whose
image prompts take long enough to prefill that a colocated engine's decode steps wait behind them; the demo model's
prefills are too small to disturb decoding.

Per system and rate: TTFT and TPOT p50/p90/p99 (TPOT = (last token - first token) / (tokens - 1), from the scheduled
arrival), throughput (requests and output tokens per second of makespan), goodput (requests meeting both SLOs per
second) and SLO attainment; ratios disaggregated / colocated. Criterion of the issue (:func:`criteria`): at a rate
where colocated p99 TPOT misses its SLO, disaggregated p99 TPOT <= half of colocated's and goodput >= 1.3x. PNG plots
(latency CDFs, goodput against rate) when matplotlib is importable. ``--quick``: a few requests at one rate (tests).

Planner check (``--predict``, on by default; :mod:`duet_bench.serve_predict`): engine profiles of the same
checkpoint are measured before the run, and ``duet plan``'s simulators replay each rate's requests; the table of
predicted against measured TTFT / TPOT p50 and p90 and the check "within 25%" are printed and kept in the JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from duet_bench import serve_predict
from duet_bench.serve_workload import (
    Arrival,
    NoBar,
    breakdown_table,
    drive_colocated,
    drive_disagg,
    make_workload,
    prompt_tokens,
    summarise,
)
from cluster.report import fmt, format_table, ms, write_json

RATES = (0.5, 1.0, 2.0, 4.0)
QUICK_RATES = (4.0,)
SYSTEMS = ("colocated", "disaggregated")
MAX_TPOT_RATIO = 0.5
MIN_GOODPUT_RATIO = 1.3


# ----------------------------------------------------------------------------------------------------- pure helpers
def ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den <= 0 else num / den


def criteria(rows: list[dict], tpot_slo: float) -> dict:
    """The issue's check at each rate where colocated p99 TPOT misses the SLO: disaggregated p99 TPOT <= 0.5x and
    goodput >= 1.3x of colocated's. ``met``: it holds at one such rate at least (the issue asks for "an arrival rate
    where ..."), ``met_at`` lists them and ``met_at_every_rate`` is the stricter reading; both None when no measured
    rate overloads colocated serving. The planner's checks read the same way."""
    at = [r for r in rows if (r["colocated"]["tpot_s"]["p99"] or 0) > tpot_slo]
    checks = [{"rate": r["rate"], "p99_tpot_ratio": r["ratios"]["p99_tpot"], "goodput_ratio": r["ratios"]["goodput"],
               "ok": (r["ratios"]["p99_tpot"] or math.inf) <= MAX_TPOT_RATIO
               and (r["ratios"]["goodput"] or 0) >= MIN_GOODPUT_RATIO} for r in at]
    colocated_wins = [r["rate"] for r in rows if (r["ratios"]["goodput"] or 0) < 1.0]
    planner = serve_predict.checks(rows)
    return {"max_p99_tpot_ratio": MAX_TPOT_RATIO, "min_goodput_ratio": MIN_GOODPUT_RATIO, "checks": checks,
            "met": any(c["ok"] for c in checks) if checks else None,
            "met_at": [c["rate"] for c in checks if c["ok"]],
            "met_at_every_rate": all(c["ok"] for c in checks) if checks else None,
            "rates_colocated_wins": colocated_wins, "planner_tolerance": serve_predict.TOLERANCE, "planner": planner,
            "planner_met": any(c["ok"] for c in planner) if planner else None,
            "planner_met_at": [c["rate"] for c in planner if c["ok"]]}


def serve_table(rows: list[dict]) -> str:
    header = ["rate", "system", "done", "TTFT p50", "p90", "p99 ms", "TPOT p50", "p90", "p99 ms", "req/s", "tok/s",
              "goodput", "SLO %"]
    out = []
    for r in rows:
        for name in SYSTEMS:
            s = r[name]
            in_ms = lambda d, k: fmt(ms(d[k]))
            out.append([f"{r['rate']:g}/s", name, f"{s['completed']}/{s['requests']}",
                        *(in_ms(s["ttft_s"], k) for k in ("p50", "p90", "p99")),
                        *(in_ms(s["tpot_s"], k) for k in ("p50", "p90", "p99")),
                        fmt(s["throughput_req_s"], 2), fmt(s["throughput_tok_s"], 1), fmt(s["goodput_req_s"], 2),
                        fmt(None if s["slo_attainment"] is None else 100 * s["slo_attainment"])])
    return format_table(header, out)


# ------------------------------------------------------------------------------------------------------ measurement
def _setup(quick: bool) -> dict:
    return {"dtype": "float32", "max_num_seqs": 32, "num_kv_blocks": 256 if quick else 2048, "block_size": 16}


def _reserve(quick: bool) -> dict:
    """Decode staging reserved at start in both systems (4 images + 128 tokens fit), so neither stalls its decodes
    to grow it mid-run."""
    return {} if quick else {"decode_mirror_tokens": 2048}


def _measure(args: argparse.Namespace, model_dir: Path, rates: tuple[float, ...], n: int
             ) -> tuple[list[dict], dict | None]:
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(args.colocated_threads)  # the colocated engine gets the cores both workers get
    try:
        return _measure_with(args, model_dir, rates, n)
    finally:
        torch.set_num_threads(saved)


def _measure_with(args: argparse.Namespace, model_dir: Path, rates: tuple[float, ...], n: int
                  ) -> tuple[list[dict], dict | None]:
    """Every rate on the colocated engine first, then the cluster is started and every rate runs on it: an idle
    cluster beside the colocated engine (its actors, their RPCs) slowed the engine's two-thread steps by ~20%
    (measured: goodput 2.5-2.8 alone against 2.1-2.2 beside it at the same rate), which the baseline must not pay."""
    from tqdm import tqdm

    from cluster.control.disagg import DisaggCluster
    from cluster.control.spec import ClusterSpec
    from engine import LLM

    # the colocated engine keeps fcfs: ``shortest`` measured no better there (its misses are decode steps waiting
    # behind prefills, which the order of the prompts does not change)
    llm = LLM(model_dir, enable_prefix_caching=False, **_setup(args.quick), **_reserve(args.quick))
    tok = llm.get_tokenizer()
    # the same prompts at every rate (only the times scale): count their tokens once
    prompt_lens = [prompt_tokens(llm, a) for a in _workload(args, tok, n, 1.0)]
    warm = make_workload(tok, 2, 100.0, seed=args.seed + 1, image_fraction=0.5, output_mean=2, output_max=2)
    probe = serve_predict.probe_requests(tok, args.seed, args.images)
    probe_lens = [prompt_tokens(llm, a) for a in probe]
    workloads = {rate: _workload(args, tok, n, rate) for rate in rates}  # the same requests for both systems
    rows = [{"rate": rate, "image_requests": sum(a.kind == "image" for a in workloads[rate])} for rate in rates]
    profiles = None

    def run_rates(name: str, drive, target, clear) -> None:
        for row in rows:
            arrivals = workloads[row["rate"]]
            clear()  # every rate replays the same images: each system starts it without their encodings
            cpu0 = serve_predict.prefill_cpu_s(target) if name == "disaggregated" else None
            before = target.status() if name == "disaggregated" else None
            driver_cpu0 = time.process_time()
            with tqdm(total=n, desc=f"{name} @ {row['rate']:g} req/s", leave=False, file=sys.stderr) as bar:
                recs = drive(target, arrivals, bar)
            row[name] = summarise(recs, ttft_slo=args.ttft_slo, tpot_slo=args.tpot_slo) | {"records": recs}
            if name == "disaggregated":  # this process: the front-end (validation, images, routing) + the client
                row[name]["frontend_cpu_ms_per_request"] = 1000 * (time.process_time() - driver_cpu0) / n
            if before is not None:
                row[name]["prefill"] = prefill_shares(before, target.status())
            if cpu0 is not None:  # the prefill core's time per request under this load (the planner's service)
                row[name]["prefill_cpu_s_per_request"] = (serve_predict.prefill_cpu_s(target) - cpu0) / n

    drive_colocated(llm, warm, NoBar())
    if args.predict:
        profiles = {"colocated": serve_predict.profile_colocated(model_dir, llm, probe, probe_lens)}
    run_rates("colocated", drive_colocated, llm, llm.engine.clear_vision_cache)
    spec = ClusterSpec(model_dir=str(model_dir), num_prefill=args.num_prefill, num_decode=1,
                       transport=args.kv_transport, cpus_per_worker=1, pin_cpus=args.pin,
                       local_prefill_tokens=0,  # disaggregated serving against the colocated engine: no hybrid
                       extra_engine={"enable_prefix_caching": args.num_prefill > 1,
                                     "scheduling_policy": args.prefill_policy,
                                     **_reserve(args.quick)},
                       prefill_max_batched_tokens=args.prefill_batched_tokens or None, **_setup(args.quick))
    budget = spec.engine_config("prefill")["max_num_batched_tokens"]
    cluster = DisaggCluster(spec)
    try:
        drive_disagg(cluster, warm, NoBar())
        if profiles is not None:
            profiles["workers"] = serve_predict.profile_workers(model_dir, cluster, probe, probe_lens)
        run_rates("disaggregated", drive_disagg, cluster, cluster.clear_vision_caches)
        row_leaks = cluster.check_no_leaks()
    finally:
        cluster.shutdown()
    for row in rows:
        c, d = row["colocated"], row["disaggregated"]
        row["ratios"] = {"p99_tpot": ratio(d["tpot_s"]["p99"], c["tpot_s"]["p99"]),
                         "goodput": ratio(d["goodput_req_s"], c["goodput_req_s"])}
        if profiles is not None:
            req = serve_predict.requests_of(workloads[row["rate"]], prompt_lens, row["rate"])
            row["predicted"] = serve_predict.predict(profiles["workers"], profiles["colocated"], req, row["rate"],
                                                     prefill_budget=budget, prefill_policy=args.prefill_policy)
            row["prediction_errors"] = serve_predict.errors(row["predicted"], row)
        row["leaked_blocks"] = sum(row_leaks.values())
    return rows, profiles


def prefill_shares(before: list[dict], after: list[dict]) -> dict:
    """Between two ``cluster.status()`` snapshots: each prefill worker's share of the prompt tokens placed
    (``shares``) and the prefix-hit rate, as the workers counted it and as the router predicted it."""
    def delta(key: str) -> dict[str, int]:
        was = {r["worker_id"]: r.get(key, 0) for r in before if r["role"] == "prefill"}
        return {r["worker_id"]: r.get(key, 0) - was.get(r["worker_id"], 0) for r in after if r["role"] == "prefill"}

    placed, prompt, cached, predicted = (delta(k) for k in ("placed_prompt_tokens", "prompt_tokens",
                                                            "cached_tokens", "predicted_cached_tokens"))
    total = sum(placed.values())
    return {"shares": {w: (t / total if total else None) for w, t in sorted(placed.items())},
            "hit_rate": sum(cached.values()) / sum(prompt.values()) if sum(prompt.values()) else None,
            "predicted_hit_rate": sum(predicted.values()) / total if total else None}


def prefill_table(rows: list[dict]) -> str:
    """Per rate: each prefill worker's share of the placed prompt tokens and the prefix-hit rates."""
    out = []
    for r in rows:
        pre = r["disaggregated"].get("prefill") or {}
        shares = " ".join(f"{w}={fmt(100 * v if v is not None else None)}%" for w, v in pre.get("shares", {}).items())
        rate = lambda k: fmt(None if pre.get(k) is None else 100 * pre[k])  # noqa: E731
        out.append([f"{r['rate']:g}/s", shares, rate("hit_rate"), rate("predicted_hit_rate")])
    return format_table(["rate", "prefill share of prompt tokens", "prefix hit %", "predicted %"], out)


def _workload(args: argparse.Namespace, tok, n: int, rate: float) -> list[Arrival]:
    return make_workload(tok, n, rate, seed=args.seed, image_fraction=args.image_fraction,
                         output_mean=args.output_mean, output_max=args.output_max, images=args.images)


def plots(rows: list[dict], out_dir: Path) -> list[str]:
    """Latency CDFs per rate and goodput against rate as PNGs; [] when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key in zip(axes, ("ttft_s", "tpot_s"), strict=True):
        for r in rows:
            for name in SYSTEMS:
                xs = np.sort([x[key] * 1e3 for x in r[name]["records"] if x["error"] is None and x[key] is not None])
                ax.plot(xs, np.arange(1, len(xs) + 1) / max(1, len(xs)), label=f"{name} @ {r['rate']:g}/s")
        ax.set_xlabel(f"{key[:4].upper()} ms"), ax.set_ylabel("CDF"), ax.legend(fontsize=7)
    paths.append(out_dir / "serve_latency_cdf.png")
    fig.tight_layout(), fig.savefig(paths[-1]), plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 4))
    for name in SYSTEMS:
        ax.plot([r["rate"] for r in rows], [r[name]["goodput_req_s"] or 0 for r in rows], "o-", label=name)
    ax.set_xlabel("arrival rate req/s"), ax.set_ylabel("goodput req/s"), ax.legend()
    paths.append(out_dir / "serve_goodput.png")
    fig.tight_layout(), fig.savefig(paths[-1]), plt.close(fig)
    return [str(p) for p in paths]


# ------------------------------------------------------------------------------------------------------------ main
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", help="checkpoint directory, or 'bench' for the duet bench model "
                                                "(default: the shipped demo model)")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="pin the prefill and decode workers to one core each (default on)")
    p.add_argument("--rates", type=_rates, default=None, help=f"comma list of req/s (default {_join(RATES)})")
    p.add_argument("--requests", type=int, default=None, help="requests per rate (default 64; 6 with --quick)")
    p.add_argument("--image-fraction", type=float, default=0.5, help="share of image-heavy requests")
    p.add_argument("--images", type=int, default=0,
                   help="images per image request (0: the demo question's own, one or two)")
    p.add_argument("--output-mean", type=float, default=None, help="mean output tokens (default 32; 4 with --quick)")
    p.add_argument("--output-max", type=int, default=128)
    p.add_argument("--ttft-slo", type=float, default=1.0, help="TTFT target, seconds")
    p.add_argument("--tpot-slo", type=float, default=0.1, help="TPOT target, seconds")
    p.add_argument("--colocated-threads", type=int, default=2, help="torch threads of the colocated engine")
    p.add_argument("--kv-transport", default="gloo", choices=["gloo", "grpc"])
    p.add_argument("--prefill-batched-tokens", type=int, default=0,
                   help="the prefill worker's step budget (ClusterSpec.prefill_max_batched_tokens; default 0: the "
                        "engine's max_num_batched_tokens)")
    p.add_argument("--prefill-policy", default="fcfs", choices=["fcfs", "shortest"],
                   help="the prefill worker's scheduling_policy (shortest gives short prompts steps of their own: "
                        "lower TTFT at light load, more steps and ~30%% more prefill CPU per request under load)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prefill", type=int, default=1,
                   help="prefill workers of the cluster (2+: prints each one's share of the prompt tokens and the "
                        "prefix-hit rate; prefix caching is then on for the cluster)")
    p.add_argument("--json", default="bench_out/serve.json", help="where to write the results (plots beside it)")
    p.add_argument("--predict", action=argparse.BooleanOptionalAction, default=True,
                   help="measure engine profiles and compare duet plan's simulated latencies with the run's")
    p.add_argument("--quick", action="store_true", help="a few requests at one rate (tests), not for figures")


def run(args: argparse.Namespace) -> int:
    rates = args.rates or (QUICK_RATES if args.quick else RATES)
    n = args.requests or (6 if args.quick else 64)
    args.output_mean = args.output_mean or (4.0 if args.quick else 32.0)
    if (n < 1 or not 0 <= args.image_fraction <= 1 or args.output_mean < 1 or args.colocated_threads < 1
            or args.images < 0 or args.prefill_batched_tokens < 0 or args.num_prefill < 1):
        print("duet: error: --requests, --output-mean and --colocated-threads must be >= 1, --images and "
              "--prefill-batched-tokens >= 0 and "
              "--image-fraction in [0, 1]", file=sys.stderr)
        return 2
    model_dir = resolve_model(args.model_dir)
    rows, profiles = _with_ray(lambda: _measure(args, model_dir, rates, n))
    crit = criteria(rows, args.tpot_slo)
    print(serve_table(rows))
    print("disaggregated TTFT p50 by stage, ms:")
    print(breakdown_table(rows))
    if args.num_prefill > 1:
        print(prefill_table(rows))
    for r in rows:
        print(f"at {r['rate']:g} req/s the front-end process spent "
              f"{fmt(r['disaggregated'].get('frontend_cpu_ms_per_request'))} ms of CPU per request "
              "(validation, tokenization, image decoding, placement; the load generator included)")
    for c in crit["checks"]:
        print(f"at {c['rate']:g} req/s (colocated p99 TPOT over SLO): p99 TPOT disagg/colocated "
              f"{fmt(c['p99_tpot_ratio'], 2)} (<= {MAX_TPOT_RATIO}), goodput {fmt(c['goodput_ratio'], 2)}x "
              f"(>= {MIN_GOODPUT_RATIO}) -> {'ok' if c['ok'] else 'MISSED'}")
    if crit["met"] is not None:
        print(f"serving criterion {'met at ' + _join(crit['met_at']) + ' req/s' if crit['met'] else 'NOT met'}")
    if crit["rates_colocated_wins"]:
        print(f"colocated goodput higher at {_join(crit['rates_colocated_wins'])} req/s")
    if crit["planner"]:
        print(serve_predict.table(rows))
        for c in crit["planner"]:
            print(f"at {c['rate']:g} req/s duet plan's disaggregated TTFT/TPOT p50/p90 within "
                  f"{fmt(100 * (c['max_abs_error'] or 0))}% of measured (<= {100 * serve_predict.TOLERANCE:g}%) -> "
                  f"{'ok' if c['ok'] else 'MISSED'}")
        for r in rows:
            pred, meas = r["predicted"]["disaggregated"], r["disaggregated"].get("prefill_cpu_s_per_request")
            print(f"at {r['rate']:g} req/s the prefill core spent {fmt(ms(meas))} ms per request "
                  f"(planner: {fmt(ms(pred['prefill_cpu_s_per_request']))} ms)")
        met = crit["planner_met"]
        print(f"planner criterion {'met at ' + _join(crit['planner_met_at']) + ' req/s' if met else 'NOT met'}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    pngs = plots(rows, out.parent)
    print("plots: " + (", ".join(pngs) if pngs else "skipped (matplotlib not installed)"))
    write_json(out, {"model_dir": str(model_dir), "quick": args.quick, "requests_per_rate": n,
                     "workload": {"image_fraction": args.image_fraction, "images": args.images,
                                  "output_mean": args.output_mean,
                                  "output_max": args.output_max, "seed": args.seed},
                     "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo},
                     "colocated_threads": args.colocated_threads, "kv_transport": args.kv_transport,
                     "prefill_batched_tokens": args.prefill_batched_tokens or None,
                     "prefill_policy": args.prefill_policy, "num_prefill": args.num_prefill,
                     "rates": rows, "criteria": crit, "plots": pngs,
                     "profiles": {k: v.__dict__ for k, v in (profiles or {}).items()},
                     "timestamp": dt.datetime.now(dt.timezone.utc).isoformat()})
    return 0


def resolve_model(name: str | None) -> Path:
    """A checkpoint directory from ``model_dir``: None -> the demo model, ``bench`` -> the bench model."""
    from duet_bench.engine_bench import bench_model_dir
    from cluster.demo import default_model_dir

    return default_model_dir() if not name else bench_model_dir() if name == "bench" else Path(name)


def _with_ray(fn):
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    try:
        return fn()
    finally:
        if started:
            ray.shutdown()


def _rates(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(t) for t in text.split(",") if t)
    except ValueError:
        vals = ()
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"--rates must be positive numbers separated by commas, got {text!r}")
    return vals


def _join(xs) -> str:
    return ",".join(f"{x:g}" for x in xs)
