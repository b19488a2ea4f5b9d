"""``duet bench quality [MODEL_DIR]``: exact-match accuracy of greedy answers on the demo task's held-out set.

The held-out set comes from :func:`duet_testing.demo_tasks.make_dataset` with a seed the training stream never uses,
balanced across question types; ``--images outside`` draws its scenes with a second program instead
(:mod:`duet_testing.outside_shapes`: other canvas sizes and aspect ratios, palettes, rasteriser) and ``--images
grid96`` in the LLaVA fixture's fixed 96x96 style. Accuracy is reported per question type and per image size (the
longer side of a question's first image). Each question goes through the checkpoint's chat template, greedy decoding, and an
exact string comparison with the answer. ``--mode`` selects the serving path (``local``: the offline engine;
``disagg``: one prefill and one decode actor on a local Ray cluster, KV over ``--kv-transport``) and
``--kv-compression`` the KV policy on the wire (disagg only).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from collections import defaultdict
from pathlib import Path

from cluster.report import fmt, format_table, write_json

HELD_OUT_SEED = 1_000_003
MODES = ("local", "disagg")
IMAGE_SETS = ("varied", "outside", "grid96")
SIZE_BUCKETS = ((128, "< 128 px"), (256, "128-255 px"), (512, "256-511 px"), (None, ">= 512 px"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", help="checkpoint directory (default: the shipped demo model)")
    p.add_argument("--n", type=int, default=500, help="held-out examples (balanced over question types)")
    p.add_argument("--images", default="varied", choices=IMAGE_SETS,
                   help="how the scenes are drawn: the training generator's style (varied), a second program "
                        "(outside), or the LLaVA fixture's 96x96 grid (grid96)")
    p.add_argument("--seed", type=int, default=HELD_OUT_SEED, help="held-out set seed")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--mode", default="local", choices=MODES, help="serving path to evaluate")
    p.add_argument("--kv-compression", default="none", metavar="POLICY",
                   help="KV compression on the wire (--mode disagg): none, default, aggressive or a JSON policy")
    p.add_argument("--kv-transport", default="gloo", choices=["gloo", "grpc"], help="KV transport (--mode disagg)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--json", default="bench_out/quality.json", help="where to write the results")


def prompts_for(tok, examples) -> list[dict]:
    """The engine prompts of ``examples`` (chat template applied, images attached)."""
    return [{"prompt": tok.apply_chat_template([{"role": "user", "content": e.question}]),
             "multi_modal_data": {"image": e.images()}} for e in examples]


def evaluate(llm, examples, *, max_tokens: int = 48) -> list[dict]:
    """Greedy answers for ``examples`` from an offline :class:`engine.LLM`; one record per example."""
    from engine import SamplingParams

    outs = llm.generate(prompts_for(llm.get_tokenizer(), examples), SamplingParams(temperature=0, max_tokens=max_tokens))
    return records(examples, [o.outputs[0].text for o in outs])


def evaluate_disagg(cluster, examples, *, max_tokens: int = 48) -> list[dict]:
    """Greedy answers for ``examples`` through a :class:`cluster.control.disagg.DisaggCluster`."""
    from engine import SamplingParams

    outs = cluster.generate_batch(prompts_for(cluster.tokenizer, examples),
                                  SamplingParams(temperature=0, max_tokens=max_tokens))
    return records(examples, [c.text for c in outs])


def records(examples, texts: list[str]) -> list[dict]:
    """One record per example: question type, image size bucket, answer, prediction, exact match."""
    return [{"qtype": e.qtype, "size": size_bucket(e.scenes[0]), "question": e.question, "answer": e.answer,
             "prediction": t.strip(), "match": t.strip() == e.answer} for e, t in zip(examples, texts, strict=True)]


def size_bucket(scene) -> str:
    """The bucket of a scene's longer side (:data:`SIZE_BUCKETS`)."""
    side = max(scene.width, scene.height)
    return next(name for limit, name in SIZE_BUCKETS if limit is None or side < limit)


def dataset(images: str, seed: int, n: int) -> list:
    """``n`` held-out examples drawn in the ``images`` set's way."""
    if images == "outside":
        from duet_testing.outside_shapes import make_dataset as outside

        return outside(seed, n)
    from duet_testing.demo_tasks import make_dataset

    return make_dataset(seed, n, style=images)


def summarize(records: list[dict]) -> dict:
    total = sum(r["match"] for r in records)
    return {"overall": {"n": len(records), "correct": total, "accuracy": total / max(1, len(records))},
            "per_type": _grouped(records, "qtype"), "per_size": _grouped(records, "size")}


def _grouped(records: list[dict], key: str) -> dict:
    groups: dict[str, list[bool]] = defaultdict(list)
    for r in records:
        groups[r[key]].append(r["match"])
    order = [name for _, name in SIZE_BUCKETS] if key == "size" else sorted(groups)
    return {g: {"n": len(groups[g]), "correct": sum(groups[g]), "accuracy": sum(groups[g]) / len(groups[g])}
            for g in order if g in groups}


def run(args: argparse.Namespace) -> int:
    from cluster.demo import default_model_dir
    from engine import LLM

    if args.n < 1:
        print("duet: error: --n must be >= 1", file=sys.stderr)
        return 2
    if args.mode == "local" and args.kv_compression != "none":
        print("duet: error: --kv-compression applies to --mode disagg (local serving moves no KV)", file=sys.stderr)
        return 2
    model_dir = Path(args.model_dir) if args.model_dir else default_model_dir()
    examples = dataset(args.images, args.seed, args.n)
    if args.mode == "local":
        llm = LLM(model_dir, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs)
        t0 = time.perf_counter()
        recs = evaluate(llm, examples)
        wall = time.perf_counter() - t0
    else:
        recs, wall = _run_disagg(args, model_dir, examples)
    summary = summarize(recs)
    o = summary["overall"]
    for key, title in (("per_type", "question type"), ("per_size", "image size")):
        rows = [[q, str(s["n"]), str(s["correct"]), f"{100 * s['accuracy']:.1f}"] for q, s in summary[key].items()]
        rows.append(["overall", str(o["n"]), str(o["correct"]), f"{100 * o['accuracy']:.1f}"])
        print(format_table([title, "n", "correct", "accuracy %"], rows))
    print(f"images {args.images}, mode {args.mode}, kv-compression {args.kv_compression}, dtype {args.dtype}: "
          f"{fmt(wall, 1)} s for {o['n']} questions")
    wrong = [r for r in recs if not r["match"]][:5]
    for r in wrong:
        print(f"  miss [{r['qtype']}] {r['question']!r}: want {r['answer']!r}, got {r['prediction']!r}",
              file=sys.stderr)
    write_json(Path(args.json), {
        "model_dir": str(model_dir), "images": args.images, "mode": args.mode, "kv_transport": args.kv_transport, "kv_compression": args.kv_compression, "dtype": args.dtype,
        "seed": args.seed, "n": args.n, "wall_s": wall, **summary, "misses": [r for r in recs if not r["match"]],
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat()})
    return 0


def _run_disagg(args: argparse.Namespace, model_dir: Path, examples) -> tuple[list[dict], float]:
    import os

    import ray

    from cluster.control.disagg import DisaggCluster
    from cluster.control.spec import ClusterSpec

    spec = ClusterSpec(model_dir=str(model_dir), transport=args.kv_transport, dtype=args.dtype,
                       kv_compression=args.kv_compression, max_num_seqs=args.max_num_seqs,
                       gpus_per_worker=1.0 if args.device.startswith("cuda") else 0.0,
                       local_prefill_tokens=0)  # every prompt through the KV transfer and its compression
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    cluster = DisaggCluster(spec)
    try:
        t0 = time.perf_counter()
        recs = evaluate_disagg(cluster, examples)
        return recs, time.perf_counter() - t0
    finally:
        cluster.shutdown()
        if started:
            ray.shutdown()
