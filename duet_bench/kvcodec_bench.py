"""``duet bench kv-codec [MODEL_DIR]``: what each KV compression policy saves on the wire and what it costs.

For every policy (default: ``none``, ``default``, ``aggressive``), in one run on the demo model (or MODEL_DIR):

* bytes -- the real prompts' KV as the prefill worker hands it to its sender (captured, all layers): bytes per text
  token and per visual token as encoded (codes + scales + masks, from the codec's own accounting), and the ratios
  against the raw pool dtype and against float32 / bfloat16 of the same tokens;
* speed -- encode and decode GB/s of those layers (uncompressed bytes / seconds, best of 3), and whether encode +
  decode is faster than sending the saved bytes over gloo at the rate this run measures between two gloo managers
  (64 MiB, uncompressed, checksums included; or ``--gloo-gbps``);
* quality -- through an in-process prefill -> decode pair (the full frame path): greedy agreement with the
  uncompressed cache over ``--prompts`` prompts x up to ``--tokens`` tokens (each reference answer up to its end of
  turn: tokens past it are not part of any answer), mean next-token KL divergence (decode steps whose prefix still
  agrees), and demo-task exact-match accuracy on ``--n`` held-out questions;
* end to end -- TTFT of a 1 prefill + 1 decode Ray cluster over gloo and gRPC (``--transports``; ``--skip-e2e``
  to leave it out) on prompts of ``--e2e-images`` images each, median of ``--e2e-requests``.

``--model qwen3-vl-moe`` runs :mod:`duet_bench.qwen_kvcodec` instead: bytes and greedy agreement per policy
and per ``--image-sizes`` side on the Qwen3-VL-MoE bench model. Both modes measure with
:mod:`duet_bench.kvcodec_measure` (captured bytes, codec speed, greedy agreement, KL).

Criteria of the issue: ``default`` >= 99% agreement and accuracy within 1 point of ``none``; ``aggressive`` >= 95%
agreement and within 3 points; visual bytes ``default`` >= 3.5x under float32 and >= 1.8x under bfloat16,
``aggressive`` >= 7x under float32.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from duet_bench.kvcodec_measure import (
    agreement,
    byte_summary,
    capture_layers,
    codec_measure,
    mean_kl,
    policies_from_args,
    quality_runs,
)
from duet_bench.qwen_bench import image_sizes
from cluster.report import fmt, format_table, write_json

POLICIES = ("none", "default", "aggressive")
CRITERIA = {"default": {"agreement": 0.99, "accuracy_drop": 1.0, "visual_vs_float32": 3.5, "visual_vs_bfloat16": 1.8},
            "aggressive": {"agreement": 0.95, "accuracy_drop": 3.0, "visual_vs_float32": 7.0}}
AGREEMENT_SEED = 2_000_003  # prompts for agreement / KL (not the accuracy set, not training)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", help="checkpoint directory (default: the shipped demo model)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated policy names (JSON policies: repeat --policy)")
    p.add_argument("--policy", action="append", default=[], metavar="JSON", help="an extra custom policy")
    p.add_argument("--model", choices=("llava-moe", "qwen3-vl-moe"), default="llava-moe",
                   help="llava-moe: the demo model (all measurements); qwen3-vl-moe: bytes and agreement per image "
                        "size on the Qwen bench model (duet_bench.qwen_kvcodec)")
    p.add_argument("--image-sizes", type=image_sizes, default=None,
                   help="qwen3-vl-moe: comma list of square image sides (default 256,512,1024)")
    p.add_argument("--prompts", type=int, default=None,
                   help="prompts for greedy agreement and KL (default 32; qwen3-vl-moe: 4 per image size)")
    p.add_argument("--tokens", type=int, default=32, help="most tokens generated per prompt (greedy, stops at EOS)")
    p.add_argument("--n", type=int, default=200, help="held-out questions for task accuracy (0: skip)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--transports", default="gloo,grpc", help="end-to-end TTFT transports")
    p.add_argument("--e2e-images", type=int, default=8, help="images per end-to-end prompt")
    p.add_argument("--e2e-requests", type=int, default=5, help="end-to-end requests per policy and transport")
    p.add_argument("--skip-e2e", action="store_true", help="leave out the Ray end-to-end TTFT runs")
    p.add_argument("--gloo-gbps", type=float, default=None,
                   help="gloo rate for the encode+decode-vs-wire check (default: measured in this run)")
    p.add_argument("--json", default="bench_out/kv_codec.json", help="where to write the results")


# ----------------------------------------------------------------------------------------------------- pure helpers
def check(results: dict[str, dict]) -> dict[str, dict[str, bool | None]]:
    """Which criteria each named policy meets (None: not measured)."""
    base = results.get("none", {}).get("accuracy")
    out = {}
    for name, crit in CRITERIA.items():
        r = results.get(name)
        if r is None:
            continue
        acc = r.get("accuracy")
        vis = r["bytes"]["visual"]
        out[name] = {
            "agreement": r["agreement"] >= crit["agreement"],
            "accuracy": None if acc is None or base is None else (base - acc) * 100 <= crit["accuracy_drop"],
            "visual_vs_float32": vis["vs_float32"] is not None and vis["vs_float32"] >= crit["visual_vs_float32"],
        }
        if "visual_vs_bfloat16" in crit:
            out[name]["visual_vs_bfloat16"] = (vis["vs_bfloat16"] is not None
                                               and vis["vs_bfloat16"] >= crit["visual_vs_bfloat16"])
    return out


# ------------------------------------------------------------------------------------------------------ measuring
def e2e_ttft(model_dir: Path, dtype: str, policy_spec: str, transport: str, prompts: list[dict]) -> dict:
    """Median TTFT and transfer figures of ``prompts`` sent one at a time through a 1P+1D Ray cluster."""
    from cluster.control.disagg import DisaggCluster
    from cluster.control.spec import ClusterSpec
    from engine import SamplingParams

    spec = ClusterSpec(model_dir=str(model_dir), transport=transport, dtype=dtype, kv_compression=policy_spec,
                       local_prefill_tokens=0)  # every prompt over the wire: the codec is what this measures
    cluster = DisaggCluster(spec)
    try:
        cluster.generate_batch([prompts[0]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
        runs = [cluster.generate_batch([p], SamplingParams(temperature=0, max_tokens=2))[0] for p in prompts[1:]]
    finally:
        cluster.shutdown()
    ttfts = sorted(c.ttft_s for c in runs)
    xfer = [c.kv_transfer or {} for c in runs]
    secs = sum(x.get("seconds", 0.0) for x in xfer)
    return {"ttft_ms": 1000 * ttfts[len(ttfts) // 2],
            "wire_bytes": sum(x.get("wire_bytes", x.get("bytes", 0)) for x in xfer) / len(xfer),
            "transfer_seconds": secs / len(xfer)}


def gloo_gbps(nbytes: int = 64 << 20, layers: int = 4, reps: int = 3) -> float:
    """Uncompressed KV rate of the gloo transport between two managers in this process (identity codec, crc32
    included): best of ``reps`` transfers of ``nbytes`` in ``layers`` layer frames, after a warm-up that builds
    the pair."""
    from kv_transfer import KVLayout, KVPoll
    from kv_transfer.gloo.manager import Manager

    layout = KVLayout(layers, 16, 8, 128, "float32")
    blocks = max(1, nbytes // layers // layout.layer_nbytes(1))
    k = torch.randn(layout.block_shape(blocks))
    best = 0.0
    with Manager(insecure=True) as src, Manager(insecure=True) as dst:
        for rep in range(reps + 1):
            lease = dst.lease(f"rate-{rep}", num_blocks=blocks, layout=layout)
            dst.expect(lease, lambda *a, **kw: None)
            t0 = time.perf_counter()
            sender = src.sender(lease)
            for layer in range(layers):
                sender.send_layer(layer, k, k)
            sender.finish({"first_token": 0})
            if sender.wait(120) != KVPoll.SUCCESS:
                raise RuntimeError(f"gloo rate transfer failed: {sender.failure_exception()}")
            if rep:
                best = max(best, layout.transfer_nbytes(blocks) / (time.perf_counter() - t0) / 1e9)
    return best


def synthetic_speed(policy, *, tokens: int = 2048, kv_heads: int = 8, head_dim: int = 128, visual: float = 0.75,
                    reps: int = 3) -> dict:
    """Codec speed on one large float32 layer (``tokens`` x ``kv_heads`` x ``head_dim``, the middle ``visual`` share
    of the tokens visual), where per-call overhead no longer dominates as it does on the demo model's small layers:
    encode / decode GB/s (uncompressed bytes / best time) and the link rate below which compressing pays
    (``saved bytes / (encode + decode time)``)."""
    from kv_transfer import KVLayout
    from kv_transfer.codec import decode_layer, encode_layer
    from kv_transfer.compression import CodecContext, codec_for

    g = torch.Generator().manual_seed(0)
    bs = 16
    k = torch.randn(-(-tokens // bs), bs, kv_heads, head_dim, generator=g)
    v = torch.randn(k.shape, generator=g)
    vis = torch.zeros(tokens, dtype=torch.bool)
    lo = int(tokens * (1 - visual) / 2)
    vis[lo:lo + int(tokens * visual)] = True
    ctx = CodecContext(num_tokens=tokens, visual=vis, k_channel_score=k.flatten(0, 1)[:tokens].norm(dim=0),
                       v_channel_score=v.flatten(0, 1)[:tokens].norm(dim=0),
                       token_score=k.flatten(0, 1)[:tokens].flatten(1).norm(dim=1))
    layout = KVLayout(1, bs, kv_heads, head_dim, "float32")
    codec = codec_for(policy)
    enc_s = dec_s = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        header, payload = encode_layer("synthetic", 0, k, v, codec, ctx)
        t1 = time.perf_counter()
        decode_layer(header, payload, layout)
        t2 = time.perf_counter()
        enc_s, dec_s = min(enc_s, t1 - t0), min(dec_s, t2 - t1)
    raw = 2 * tokens * kv_heads * head_dim * 4
    saved = raw - payload.numel()
    return {"tokens": tokens, "kv_heads": kv_heads, "head_dim": head_dim, "raw_bytes": raw,
            "wire_bytes": payload.numel(), "encode_gbps": raw / enc_s / 1e9, "decode_gbps": raw / dec_s / 1e9,
            "break_even_gbps": saved / (enc_s + dec_s) / 1e9 if saved > 0 else None}


# ------------------------------------------------------------------------------------------------------------ run
def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from duet_bench.quality_bench import HELD_OUT_SEED, prompts_for
    from cluster.demo import default_model_dir
    from duet_testing.demo_tasks import make_dataset
    from engine import EngineConfig
    from engine.config import ModelConfig
    from engine.tokenizer import Tokenizer
    from kv_transfer import KVLayout
    from kv_transfer.compression import InvalidPolicy

    if args.model == "qwen3-vl-moe":
        from duet_bench.qwen_kvcodec import run as run_qwen

        return run_qwen(args)
    args.prompts = 32 if args.prompts is None else args.prompts
    try:
        policies = policies_from_args(args)
    except InvalidPolicy as e:
        print(f"duet: error: {e}", file=sys.stderr)
        return 2
    if args.prompts < 1 or args.tokens < 1 or args.n < 0:
        print("duet: error: --prompts and --tokens must be >= 1, --n >= 0", file=sys.stderr)
        return 2
    model_dir = Path(args.model_dir) if args.model_dir else default_model_dir()
    cfg = ModelConfig.from_pretrained(model_dir)
    tok = Tokenizer.from_pretrained(model_dir)
    config = EngineConfig(dtype=args.dtype, max_num_seqs=64, num_kv_blocks=4096, block_size=16)
    layout = KVLayout(cfg.text.num_layers, config.block_size, cfg.text.num_kv_heads, cfg.text.head_dim, args.dtype)
    itemsize = torch.empty((), dtype=layout.torch_dtype).element_size()
    raw_per_token = 2 * cfg.text.num_layers * cfg.text.num_kv_heads * cfg.text.head_dim * itemsize
    agree_prompts = prompts_for(tok, make_dataset(AGREEMENT_SEED, args.prompts))
    examples = make_dataset(HELD_OUT_SEED, args.n) if args.n else []
    results: dict[str, dict] = {}
    ref = None
    for name, policy in policies:
        _log(f"[kv-codec] {name}: bytes and codec speed")
        captured = capture_layers(model_dir, config, agree_prompts, policy)
        m = codec_measure(captured, policy, layout)
        _log(f"[kv-codec] {name}: agreement, KL, accuracy")
        q = quality_runs(model_dir, config, policy, agree_prompts, args.tokens, examples)
        if ref is None:
            ref = q
        results[name] = {
            "policy": None if policy is None else policy.to_dict(),
            "bytes": byte_summary(m["stats"], cfg.text.num_layers, raw_per_token, itemsize),
            "raw_bytes": m["raw_bytes"], "wire_bytes": m["wire_bytes"],
            "ratio_vs_raw": m["raw_bytes"] / m["wire_bytes"] if m["wire_bytes"] else None,
            "encode_gbps": m["encode_gbps"], "decode_gbps": m["decode_gbps"],
            "codec_s": m["encode_s"] + m["decode_s"],
            "synthetic": synthetic_speed(policy),
            "agreement": agreement(ref["tokens"], q["tokens"]),
            "kl": mean_kl(ref["tokens"], ref["logits"], q["tokens"], q["logits"]),
            "accuracy": None if q["accuracy"] is None else q["accuracy"]["overall"]["accuracy"],
            "failed_requests": q["failed"],
            "accuracy_per_type": None if q["accuracy"] is None else
            {k: v["accuracy"] for k, v in q["accuracy"]["per_type"].items()},
        }
    e2e_gloo_gbps = args.gloo_gbps
    if not args.skip_e2e:
        import ray

        started = not ray.is_initialized()
        if started:
            ray.init(num_cpus=max(os.cpu_count() or 2, 2), include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        try:
            image_prompt = "<image>" * args.e2e_images + "How many shapes are there?"
            ex = make_dataset(AGREEMENT_SEED + 1, args.e2e_requests + 1, qtypes=("count",))
            e2e_prompts = [{"prompt": tok.apply_chat_template([{"role": "user", "content": image_prompt}]),
                            "multi_modal_data": {"image": [e.images()[0]] * args.e2e_images}} for e in ex]
            for name, policy in policies:
                spec = "none" if policy is None else json.dumps(policy.to_dict())
                for transport in args.transports.split(","):
                    _log(f"[kv-codec] {name}: end-to-end over {transport}")
                    results[name].setdefault("e2e", {})[transport] = e2e_ttft(model_dir, args.dtype, spec, transport,
                                                                             e2e_prompts)
        finally:
            if started:
                ray.shutdown()
    if e2e_gloo_gbps is None:
        _log("[kv-codec] gloo wire rate")
        e2e_gloo_gbps = gloo_gbps()
    for r in results.values():
        saved = r["raw_bytes"] - r["wire_bytes"]
        r["saved_send_s"] = saved / (e2e_gloo_gbps * 1e9) if e2e_gloo_gbps else None
        r["codec_pays"] = None if r["saved_send_s"] is None or saved <= 0 else r["codec_s"] < r["saved_send_s"]
    crit = check(results)
    print(_table(results, args))
    print()
    print(_speed_table(results, e2e_gloo_gbps))
    for name, c in crit.items():
        print(f"{name}: " + ", ".join(f"{k} {'ok' if v else ('n/a' if v is None else 'MISSED')}" for k, v in c.items()))
    if e2e_gloo_gbps:
        print(f"gloo rate for the codec-vs-wire check: {fmt(e2e_gloo_gbps, 3)} GB/s")
    write_json(Path(args.json), {"model_dir": str(model_dir), "dtype": args.dtype, "prompts": args.prompts,
                                 "tokens": args.tokens, "n": args.n, "results": results, "criteria": crit,
                                 "gloo_gbps": e2e_gloo_gbps,
                                 "timestamp": dt.datetime.now(dt.timezone.utc).isoformat()})
    return 0


def _speed_table(results: dict[str, dict], gloo: float | None) -> str:
    rows = []
    for name, r in results.items():
        sy = r["synthetic"]
        be = sy["break_even_gbps"]
        rows.append([name, f"{sy['tokens']}x{sy['kv_heads']}x{sy['head_dim']}", fmt(sy["raw_bytes"] / sy["wire_bytes"], 2),
                     fmt(sy["encode_gbps"], 2), fmt(sy["decode_gbps"], 2), fmt(be, 3),
                     "-" if be is None or gloo is None else ("yes" if be > gloo else "no")])
    return format_table(["policy", "layer (T x KVH x D, f32)", "x raw", "enc GB/s", "dec GB/s",
                         "pays below GB/s", "pays on gloo"], rows)


def _table(results: dict[str, dict], args: argparse.Namespace) -> str:
    header = ["policy", "text B/tok", "visual B/tok", "visual x f32", "visual x bf16", "all x raw", "enc GB/s",
              "dec GB/s", "codec<wire", "agree %", "KL", "acc %", "failed"]
    transports = [t for t in args.transports.split(",") if not args.skip_e2e]
    header += [f"ttft {t} ms" for t in transports]
    rows = []
    for name, r in results.items():
        b = r["bytes"]
        row = [name, fmt(b["text"]["bytes_per_token"], 0), fmt(b["visual"]["bytes_per_token"], 0),
               fmt(b["visual"]["vs_float32"], 2), fmt(b["visual"]["vs_bfloat16"], 2), fmt(r["ratio_vs_raw"], 2),
               fmt(r["encode_gbps"], 2), fmt(r["decode_gbps"], 2),
               "-" if r["codec_pays"] is None else ("yes" if r["codec_pays"] else "no"),
               fmt(100 * r["agreement"], 1), f"{r['kl']:.2e}",
               "-" if r["accuracy"] is None else fmt(100 * r["accuracy"], 1), str(r["failed_requests"])]
        row += [fmt(r.get("e2e", {}).get(t, {}).get("ttft_ms"), 1) for t in transports]
        rows.append(row)
    return format_table(header, rows)
