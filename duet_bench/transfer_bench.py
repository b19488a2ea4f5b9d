"""``duet bench transfer [MODEL_DIR]``: what handing the KV cache from a prefill to a decode worker costs.

Workload: one prompt per length (default 512, 2048, 4096 tokens), half of it image tokens -- ``k = round(len / 2 /
tokens_per_image)`` images of random pixels (fixed seed), spread evenly through random text ids -- greedy, 2 new
tokens, one request at a time, fresh ids and images for every repeat (no prefix- or vision-cache hit).

Per length it measures, all in one run:

* local -- TTFT of the in-process ``engine.LLM`` (same engine config, torch threads = a worker's CPUs);
* per transport, a 1 prefill + 1 decode :class:`~cluster.control.disagg.DisaggCluster` with ``stream_layers=True``
  ("layer-wise": each layer leaves right after its compute) and another with ``stream_layers=False`` ("whole": the
  whole cache after prefill): TTFT, KV bytes and the exposed transfer time (last layer's arrival on the decode side
  minus the end of the prefill's last layer compute), and the leaked blocks after shutdown;
* transfer GB/s -- from the *whole* runs, where layers go back to back: the decode side times the first to the last
  layer's arrival, which spans ``layers - 1`` layers (:func:`transfer_gbps`). In layer-wise runs that span is
  paced by compute, so its rate (``layerwise.gbps`` in the JSON) is not the wire's;
* memcpy GB/s -- ``dst.copy_(src)`` of the same number of bytes in this process (best of 5), the loopback ceiling;
* with ``--auth both`` (default), the cost of the authenticated data plane: per transport a second *whole* cluster
  with ``data_plane_auth: off`` runs right after the ``hmac`` one (the default, measured above), and the table gives
  its GB/s and hmac / off (``auth_over_off`` in the JSON). ``--auth hmac`` skips it; ``--auth off`` measures
  everything without authentication.

Criteria of the issue: exposed layer-wise / exposed whole <= 0.25 at 2048 tokens (1 / layers is ideal), and gRPC
GB/s / gloo GB/s >= 0.5. ``--repeat N`` keeps the best of N per figure (least time, highest rate). ``--quick``:
tiny model and lengths (tests), not for figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import PIL.Image
import torch

from cluster.report import fmt, format_table, log, ms, write_json

PROMPT_LENS = (512, 2048, 4096)
QUICK_PROMPT_LENS = (16, 32)
TRANSPORTS = ("gloo", "grpc")
MODES = ("layerwise", "whole")
MAX_TOKENS = 2
CRITERION_LEN = 2048
MAX_EXPOSED_RATIO = 0.25
MIN_GRPC_OVER_GLOO = 0.5


# ----------------------------------------------------------------------------------------------------- pure helpers
def num_images(prompt_len: int, tokens_per_image: int) -> int:
    """Images that make about half of a ``prompt_len`` prompt: ``round(len / 2 / tpi)``, never more than fit."""
    assert prompt_len >= 1 and tokens_per_image >= 1
    return min(round(prompt_len / 2 / tokens_per_image), prompt_len // tokens_per_image)


def make_prompt(prompt_len: int, *, tokens_per_image: int, image_token_id: int, text_ids: Sequence[int],
                image_size: int, seed: int, variant: int = 0) -> dict:
    """``{"prompt_token_ids": [...], "multi_modal_data": {"image": [...]}}`` of exactly ``prompt_len`` ids.

    The text (random picks from ``text_ids``) is cut into ``k + 1`` near-equal runs with one image's placeholders
    between neighbours. Deterministic in ``(seed, prompt_len, variant)``; ``variant`` >= 0 (e.g. the repeat index)
    changes ids and pixels, not the shape.
    """
    rng = np.random.default_rng([seed, prompt_len, variant])
    k = num_images(prompt_len, tokens_per_image)
    text = np.asarray(text_ids)[rng.integers(0, len(text_ids), prompt_len - k * tokens_per_image)].tolist()
    cuts = np.linspace(0, len(text), k + 2).round().astype(int)
    ids: list[int] = text[:cuts[1]]
    for i in range(k):
        ids += [image_token_id] * tokens_per_image + text[cuts[i + 1]:cuts[i + 2]]
    prompt: dict = {"prompt_token_ids": ids}
    if k:
        prompt["multi_modal_data"] = {"image": [PIL.Image.fromarray(
            rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8)) for _ in range(k)]}
    return prompt


def transfer_gbps(nbytes: int, layers: int, span_s: float) -> float | None:
    """GB/s of a transfer whose ``layers`` equal layers arrived over ``span_s`` (first to last arrival): the span
    holds ``layers - 1`` of them. ``None`` when unmeasurable (one layer, no span)."""
    if layers < 2 or span_s <= 0:
        return None
    return nbytes * (layers - 1) / layers / span_s / 1e9


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or ``None`` when either is missing or ``den`` is not positive."""
    return None if num is None or den is None or den <= 0 else num / den


def best_of(runs: Sequence[dict]) -> dict:
    """Best per figure over repeats: least of ``*_s`` keys, most of ``*gbps`` keys; other keys from the first run.
    ``None`` values are skipped (a figure missing in every run stays ``None``)."""
    out = dict(runs[0])
    for key in out:
        vals = [r[key] for r in runs if r.get(key) is not None]
        if key.endswith("_s"):
            out[key] = min(vals, default=None)
        elif key.endswith("gbps"):
            out[key] = max(vals, default=None)
    return out


def criteria(results: dict[int, dict], transports: Sequence[str]) -> dict:
    """The issue's two checks at 2048 tokens (or the longest prompt measured when 2048 is not)."""
    at = CRITERION_LEN if CRITERION_LEN in results else max(results)
    r = results[at]
    exposed = {t: r["transports"][t]["exposed_ratio"] for t in transports}
    out = {"prompt_len": at, "exposed_ratio": exposed, "max_exposed_ratio": MAX_EXPOSED_RATIO,
           "exposed_ok": all(v is not None and v <= MAX_EXPOSED_RATIO for v in exposed.values())}
    if {"gloo", "grpc"} <= set(transports):
        g = r["grpc_over_gloo"]
        out |= {"grpc_over_gloo": g, "min_grpc_over_gloo": MIN_GRPC_OVER_GLOO,
                "grpc_ok": g is not None and g >= MIN_GRPC_OVER_GLOO}
    return out


def engine_setup(prompt_lens: Sequence[int], quick: bool) -> dict:
    """Engine fields shared by the local engine and every worker: room for the longest prompt in one prefill chunk
    (so layer-wise streaming covers the whole prompt) and twice its blocks."""
    (block, model_len), longest = ((4, 128) if quick else (16, 8192)), max(prompt_lens) + MAX_TOKENS
    return {"dtype": "float32", "block_size": block, "max_num_seqs": 4, "max_model_len": max(model_len, longest),
            "num_kv_blocks": 2 * math.ceil(longest / block) + 4,
            "max_num_batched_tokens": max(4096, max(prompt_lens))}


# ------------------------------------------------------------------------------------------------------ measurement
def memcpy_gbps(nbytes: int, reps: int = 5) -> float:
    """GB/s of ``dst.copy_(src)`` for ``nbytes`` uint8 on the CPU (best of ``reps``, after one untimed copy)."""
    src = torch.full((max(1, nbytes),), 7, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return src.numel() / best / 1e9


def _local(model_dir: Path, setup: dict, prompts: list[dict[int, dict]], warm: dict, threads: int) -> dict:
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)  # a worker's thread count, so local and disaggregated prefill compare fairly
    try:
        llm = LLM(model_dir, **setup)
        llm.generate([warm], params)
        runs: dict[int, list[dict]] = {n: [] for n in prompts[0]}
        for variant in prompts:
            for n, p in variant.items():
                out = llm.generate([p], params)[0]
                runs[n].append({"ttft_s": out.metrics.ttft_s, "tokens": out.outputs[0].token_ids})
                log(f"local {n} tokens: TTFT {fmt(ms(out.metrics.ttft_s))} ms")
    finally:
        torch.set_num_threads(saved)
    return runs


def _cluster(model_dir: Path, setup: dict, transport: str, mode: str, prompts: list[dict[int, dict]],
             warm: dict, auth: str = "hmac") -> tuple[dict[int, list[dict]], dict]:
    from cluster.control.disagg import DisaggCluster
    from cluster.control.spec import ClusterSpec
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    spec = ClusterSpec(model_dir=str(model_dir), num_prefill=1, num_decode=1, transport=transport,
                       cpus_per_worker=1, stream_layers=mode == "layerwise", data_plane_auth=auth,
                       local_prefill_tokens=0, **setup)  # every prompt over the transport: what this measures
    t0 = time.perf_counter()
    cluster = DisaggCluster(spec)
    info: dict = {"startup_s": time.perf_counter() - t0}
    try:
        cluster.generate_batch([warm], params)
        runs: dict[int, list[dict]] = {n: [] for n in prompts[0]}
        for variant in prompts:
            for n, p in variant.items():
                c = cluster.generate_batch([p], params)[0]
                kv = c.kv_transfer or {}
                nbytes, layers, span = kv.get("bytes", 0), kv.get("layers", 0), kv.get("seconds", 0.0)
                runs[n].append({"ttft_s": c.ttft_s, "bytes": nbytes, "layers": layers, "span_s": span,
                                "exposed_s": kv.get("exposed_seconds"), "gbps": transfer_gbps(nbytes, layers, span),
                                "tokens": c.token_ids})
                log(f"{transport}/{mode}/{auth} {n} tokens: TTFT {fmt(ms(c.ttft_s))} ms, {nbytes / 1e6:.1f} MB, "
                     f"exposed {fmt(ms(kv.get('exposed_seconds')), 2)} ms")
        info["held_blocks"] = cluster.check_no_leaks()
    finally:
        cluster.shutdown()
    info["leaked_blocks"] = sum(info.get("held_blocks", {}).values())
    return runs, info


def _summarise(local: dict, clusters: dict, transports: Sequence[str], images: dict[int, int],
               no_auth: dict | None = None) -> dict[int, dict]:
    """Best-of figures per prompt length; tokens of every disaggregated run compared with the local engine's.
    ``no_auth``: transport -> the runs of a *whole* cluster without data-plane authentication (``--auth both``)."""
    results: dict[int, dict] = {}
    for n, local_runs in local.items():
        ref = [r["tokens"] for r in local_runs]
        row: dict = {"prompt_len": n, "num_images": images[n], "local": {"ttft_s": best_of(local_runs)["ttft_s"]},
                     "transports": {}}
        for t in transports:
            modes = {m: clusters[t, m][0][n] for m in MODES}
            fig = {m: {k: v for k, v in best_of(runs).items() if k != "tokens"} for m, runs in modes.items()}
            fig["tokens_match"] = all([r["tokens"] for r in runs] == ref for runs in modes.values())
            fig["transfer_gbps"] = fig["whole"]["gbps"]
            fig["exposed_ratio"] = ratio(fig["layerwise"]["exposed_s"], fig["whole"]["exposed_s"])
            if no_auth:
                off = no_auth[t][0][n]
                fig["tokens_match"] = fig["tokens_match"] and [r["tokens"] for r in off] == ref
                fig["auth_off_gbps"] = best_of(off)["gbps"]
                fig["auth_over_off"] = ratio(fig["transfer_gbps"], fig["auth_off_gbps"])
            row["transports"][t] = fig
        nbytes = row["transports"][transports[0]]["whole"]["bytes"]
        row["kv_bytes"], row["memcpy_gbps"] = nbytes, memcpy_gbps(nbytes)
        if {"gloo", "grpc"} <= set(transports):
            row["grpc_over_gloo"] = ratio(row["transports"]["grpc"]["transfer_gbps"],
                                          row["transports"]["gloo"]["transfer_gbps"])
        results[n] = row
    return results


def transfer_table(results: dict[int, dict]) -> str:
    header = ["prompt", "transport", "KV MB", "GB/s", "GB/s no auth", "auth/none", "memcpy GB/s", "TTFT local ms", "TTFT lw ms", "TTFT whole ms",
              "exposed lw ms", "exposed whole ms", "lw/whole", "grpc/gloo", "same tokens"]
    rows = []
    for n, r in results.items():
        for t, f in r["transports"].items():
            rows.append([f"{n} ({r['num_images']} img)", t, fmt(r["kv_bytes"] / 1e6, 2), fmt(f["transfer_gbps"], 2),
                         fmt(f.get("auth_off_gbps"), 2), fmt(f.get("auth_over_off"), 2),
                         fmt(r["memcpy_gbps"], 2), fmt(ms(r["local"]["ttft_s"])), fmt(ms(f["layerwise"]["ttft_s"])),
                         fmt(ms(f["whole"]["ttft_s"])), fmt(ms(f["layerwise"]["exposed_s"]), 2),
                         fmt(ms(f["whole"]["exposed_s"]), 2), fmt(f["exposed_ratio"], 3),
                         fmt(r.get("grpc_over_gloo"), 2) if t == "grpc" else "-", "yes" if f["tokens_match"] else "NO"])
    return format_table(header, rows)



# ------------------------------------------------------------------------------------------------------------ main
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", help="checkpoint directory (default: the bench model; with --quick a "
                                                "tiny random model made for the run)")
    p.add_argument("--prompt-lens", type=_lens, default=None,
                   help=f"comma list of prompt lengths (default {','.join(map(str, PROMPT_LENS))})")
    p.add_argument("--transports", type=_transports, default=None, help="comma list of gloo,grpc (default both; "
                                                                        "gloo with --quick)")
    p.add_argument("--auth", choices=["both", "hmac", "off"], default="both",
                   help="data-plane authentication of the clusters: both (default: hmac, plus a whole-cache run "
                        "without it per transport, for its cost), hmac, or off")
    p.add_argument("--repeat", type=_positive, default=1, help="measure each figure N times, keep the best")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and images")
    p.add_argument("--json", default="bench_out/transfer.json", help="where to write the results")
    p.add_argument("--quick", action="store_true", help="tiny smoke configuration (tests), not for figures")
    p.add_argument("--model", choices=("llava-moe", "qwen3.5-moe"), default="llava-moe",
                   help="llava-moe: the figures above; qwen3.5-moe: TTFT local / transformers / per transport and "
                        "KV vs GDN state bytes per request (duet_bench.qwen35_bench)")


def _lens(text: str) -> list[int]:
    parts = [s for s in text.replace(" ", "").split(",") if s]
    if not parts or not all(s.isdigit() and int(s) >= 1 for s in parts):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return [int(s) for s in parts]


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _transports(text: str) -> list[str]:
    names = [s for s in text.replace(" ", "").split(",") if s]
    if not names or set(names) - set(TRANSPORTS):
        raise argparse.ArgumentTypeError(f"unknown transport(s) in {text!r}; choose from {','.join(TRANSPORTS)}")
    return [t for t in TRANSPORTS if t in names]



def _model_dir(args: argparse.Namespace, tmp: Path) -> Path:
    if args.model_dir:
        return Path(args.model_dir)
    if args.quick:
        from duet_testing.checkpoints import make_tiny_checkpoint

        return make_tiny_checkpoint(tmp / "m")
    from duet_bench.engine_bench import bench_model_dir

    return bench_model_dir()


def run(args: argparse.Namespace) -> int:
    """Measure, print the table and the criteria, write the JSON. Starts (and then stops) Ray only if it is down."""
    import ray

    from duet_bench.engine_workload import usable_token_ids
    from engine.config import ModelConfig
    from engine.errors import InvalidRequestError

    if args.model == "qwen3.5-moe":
        from duet_bench.qwen35_bench import run_transfer

        started = not ray.is_initialized()
        if started:
            ray.init(num_cpus=max(os.cpu_count() or 2, 2), include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        try:
            return run_transfer(args)
        finally:
            if started:
                ray.shutdown()

    with tempfile.TemporaryDirectory(prefix="duet-transfer-") as tmp:
        model_dir = _model_dir(args, Path(tmp))
        cfg = ModelConfig.from_pretrained(model_dir)
        if cfg.vision is None:
            raise InvalidRequestError(f"{model_dir} has no vision tower; the transfer bench needs image prompts")
        lens = sorted(set(args.prompt_lens or (QUICK_PROMPT_LENS if args.quick else PROMPT_LENS)))
        transports = args.transports or (["gloo"] if args.quick else list(TRANSPORTS))
        setup = engine_setup(lens, args.quick)
        shape = {"tokens_per_image": cfg.tokens_per_image, "image_token_id": int(cfg.image_token_index),
                 "text_ids": usable_token_ids(model_dir), "image_size": cfg.vision.image_size, "seed": args.seed}
        prompts = [{n: make_prompt(n, **shape, variant=r) for n in lens} for r in range(args.repeat)]
        warm = make_prompt(min(lens), **shape, variant=args.repeat)  # own ids and images: nothing measured hits a cache
        load_start = os.getloadavg()
        started = not ray.is_initialized()
        if started:
            ray.init(num_cpus=max(os.cpu_count() or 2, 2), include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        try:
            log(f"local engine on {model_dir}")
            local = _local(model_dir, setup, prompts, warm, threads=1)
            auth = "off" if args.auth == "off" else "hmac"
            clusters, no_auth = {}, {}
            for t in transports:
                for m in MODES:
                    clusters[t, m] = _cluster(model_dir, setup, t, m, prompts, warm, auth)
                if args.auth == "both":  # right after its hmac twin, on the same prompts
                    no_auth[t] = _cluster(model_dir, setup, t, "whole", prompts, warm, "off")
        finally:
            if started:
                ray.shutdown()
    results = _summarise(local, clusters, transports, {n: num_images(n, cfg.tokens_per_image) for n in lens},
                         no_auth)
    doc = {"model_dir": str(model_dir),
           "config": {"prompt_lens": lens, "transports": transports, "repeat": args.repeat, "seed": args.seed,
                      "auth": args.auth,
                      "quick": args.quick, "max_tokens": MAX_TOKENS, "engine": setup, "cpus_per_worker": 1,
                      "tokens_per_image": cfg.tokens_per_image, "num_layers": cfg.text.num_layers},
           "results": {str(n): r for n, r in results.items()},
           "clusters": {f"{t}/{m}": info for (t, m), (_, info) in clusters.items()}
           | {f"{t}/whole/auth-off": info for t, (_, info) in no_auth.items()},
           "leaked_blocks": sum(info["leaked_blocks"] for _, info in [*clusters.values(), *no_auth.values()]),
           "criteria": criteria(results, transports), "torch_threads": torch.get_num_threads(),
           "load_average": {"start": load_start, "end": os.getloadavg()},
           "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    path = write_json(args.json, doc)
    print(transfer_table(results))
    print(_criteria_line(doc["criteria"], cfg.text.num_layers))
    load = {k: " ".join(f"{x:.2f}" for x in v) for k, v in doc["load_average"].items()}
    print(f"load average: start {load['start']}, end {load['end']}; leaked blocks: {doc['leaked_blocks']}")
    log(f"wrote {path}")
    return 0


def _criteria_line(c: dict, layers: int) -> str:
    exposed = ", ".join(f"{t} {fmt(v, 3)}" for t, v in c["exposed_ratio"].items())
    line = (f"at {c['prompt_len']} tokens: exposed layer-wise/whole {exposed} (<= {MAX_EXPOSED_RATIO}: "
            f"{'ok' if c['exposed_ok'] else 'FAIL'}; ideal 1/{layers} = {1 / layers:.3f})")
    if "grpc_ok" in c:
        line += (f"; grpc/gloo GB/s {fmt(c['grpc_over_gloo'], 2)} (>= {MIN_GRPC_OVER_GLOO}: "
                 f"{'ok' if c['grpc_ok'] else 'FAIL'})")
    return line
