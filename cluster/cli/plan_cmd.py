"""``duet plan``: print the planner's recommendation (:mod:`cluster.planner.planner`) as a table, and write it as JSON.

The profile comes from ``--profile FILE`` (e.g. ``deploy/profiles/h100-moe-assumed.json``) or
``--profile-from-bench``, which measures this machine's engine on the demo model in a few seconds
(:func:`measure_profile`: prefill at several prompt lengths, with and without an image; decode steps at several batch
sizes; the KV transfer cost per token from a ``duet bench transfer`` JSON when one exists) and fits the profile's
linear terms by least squares (:func:`fit_line`). ``--save-profile`` keeps it for later runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cluster.report import fmt, format_table, write_json

if TYPE_CHECKING:
    from cluster.planner.planner import Plan, Profile


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--profile", help="profile JSON (see deploy/profiles/)")
    src.add_argument("--profile-from-bench", action="store_true",
                     help="measure a profile of this machine's engine on the demo model (seconds)")
    p.add_argument("--save-profile", help="with --profile-from-bench: write the measured profile here")
    p.add_argument("--model-dir", help="with --profile-from-bench: the checkpoint to measure (default: the demo model; "
                                       "a Qwen3-VL one also gives the vision tower's cost per image token)")
    p.add_argument("--transfer-json", default="bench_out/transfer.json",
                   help="with --profile-from-bench: a `duet bench transfer` result to take the KV cost from")
    p.add_argument("--gpus", type=int, default=8, help="total GPU (worker) budget")
    p.add_argument("--rate", type=float, default=0.0, help="workload arrival rate, req/s (0: maximise goodput)")
    p.add_argument("--prompt-mean", type=float, default=512)
    p.add_argument("--prompt-cv", type=float, default=0.5)
    p.add_argument("--output-mean", type=float, default=128)
    p.add_argument("--output-cv", type=float, default=0.5)
    p.add_argument("--image-fraction", type=float, default=0.0)
    p.add_argument("--images", type=int, default=1, help="images per image request")
    p.add_argument("--tokens-per-image", type=int, default=256)
    p.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT p90 target, seconds")
    p.add_argument("--tpot-slo", type=float, default=0.1, help="TPOT p90 target, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench_out/plan.json", help="where to write the plan")


def run(args: argparse.Namespace) -> int:
    from cluster.planner.planner import SLO, Profile, Workload, plan  # imports the engine (torch): not at parse time

    if args.profile:
        profile = Profile.load(args.profile)
    else:
        profile = measure_profile(Path(args.transfer_json), model_dir=Path(args.model_dir) if args.model_dir else None)
        if args.save_profile:
            write_json(args.save_profile, profile.__dict__)
    workload = Workload(rate=args.rate, prompt_mean=args.prompt_mean, prompt_cv=args.prompt_cv,
                        output_mean=args.output_mean, output_cv=args.output_cv, image_fraction=args.image_fraction,
                        images=args.images, tokens_per_image=args.tokens_per_image)
    slo = SLO(ttft_p90_s=args.ttft_slo, tpot_p90_s=args.tpot_slo)
    t0 = time.perf_counter()
    result = plan(profile, workload, slo, args.gpus, seed=args.seed)
    took = time.perf_counter() - t0
    print(plan_table(result))
    print(f"recommended: {result.recommended.value} ({result.reason}); planned in {took:.2f} s; "
          f"profile: {profile.source}")
    write_json(args.json, {"profile": profile.__dict__, "workload": workload.__dict__, "slo": slo.__dict__,
                           "plan": result.to_dict(), "plan_s": took})
    return 0


def plan_table(pl: Plan) -> str:
    header = ["mode", "prefill", "decode", "goodput req/s", "per GPU", "GPUs for rate"]
    need = pl.needed
    rows = [["disaggregated", str(pl.prefill), str(pl.decode), fmt(pl.disaggregated_goodput, 2),
             fmt(pl.disaggregated_goodput / pl.gpus, 3), fmt(need.get("disaggregated_gpus"))],
            ["colocated", "-", "-", fmt(pl.colocated_goodput, 2), fmt(pl.colocated_goodput / pl.gpus, 3),
             fmt(need.get("colocated_gpus"))]]
    out = format_table(header, rows)
    if pl.predicted:
        pr = pl.predicted
        out += (f"\npredicted ({pr['mode']} at {pr['rate']:.3g} req/s): TTFT p50/p90 {fmt(pr['ttft_p50_s'] * 1e3)}/"
                f"{fmt(pr['ttft_p90_s'] * 1e3)} ms, TPOT p50/p90 {fmt(pr['tpot_p50_s'] * 1e3, 2)}/"
                f"{fmt(pr['tpot_p90_s'] * 1e3, 2)} ms")
    return out


def fit_line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` with both terms clipped at 0 (a profile has no negative cost)."""
    b, a = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return max(0.0, float(a)), max(0.0, float(b))


def fit_quadratic(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least-squares ``y = a + b x + c x^2`` with every term >= 0 (refit without a term that came out negative)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    cols = [np.ones_like(x), x, x * x]
    keep = [0, 1, 2]
    while True:
        coef = np.linalg.lstsq(np.stack([cols[k] for k in keep], 1), y, rcond=None)[0]
        if (coef >= 0).all() or len(keep) == 1:
            out = [0.0, 0.0, 0.0]
            for k, v in zip(keep, coef, strict=True):
                out[k] = max(0.0, float(v))
            return out[0], out[1], out[2]
        keep.pop(int(np.argmin(coef)))


def best_of(measure, repeats: int = 3) -> float:
    """The fastest of ``repeats`` measurements: the first run of a new shape pays one-off allocations (a decode step
    at one sequence came out 2x slow, and the batch fit through it lost its per-sequence cost)."""
    return min(measure() for _ in range(max(1, repeats)))


def measure_profile(transfer_json: Path | None = None, *, model_dir: Path | None = None, threads: int = 1,
                    lens=(16, 64, 192, 384, 768, 1280), batches=(1, 4, 16), contexts=(32, 512)) -> Profile:
    """A profile of the in-process engine on ``model_dir`` (default: the demo model) with ``threads`` torch threads
    (1: one worker's core): prefill at the ``lens`` (prompt tokens) the model's context allows, fitted with a
    quadratic term (attention), and once with an image; decode steps at ``batches`` sequences of ``contexts[0]``
    tokens, and at ``contexts[-1]`` for the per-context-token term. Every point is the best of three runs
    (:func:`best_of`)."""
    import PIL.Image
    import torch

    from cluster.demo import default_model_dir
    from cluster.planner.planner import Profile
    from engine import LLM, SamplingParams

    model = Path(model_dir) if model_dir else default_model_dir()
    cfg = json.loads((model / "config.json").read_text())
    img_id, tpi = cfg.get("image_token_index"), cfg.get("image_seq_length")
    size = (cfg.get("vision_config") or {}).get("image_size", 96)
    text_cfg = cfg.get("text_config", cfg)
    vocab = text_cfg.get("vocab_size", 256)
    max_pos = text_cfg.get("max_position_embeddings", 4096)
    lens = [n for n in lens if 2 * n <= max_pos] or list(lens[:1])
    contexts = [c for c in contexts if c + 32 <= max_pos]  # a decode of 16 tokens must fit
    if len(contexts) < 2:
        contexts = [max(16, max_pos // 8), max_pos // 2]
    rng = np.random.default_rng(0)
    text = lambda n: rng.integers(10, min(200, vocab), n).tolist()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        llm = LLM(model, dtype="float32", max_num_seqs=max(batches),
                  max_model_len=min(max_pos, 2 * max(*lens, *contexts, 64)),
                  max_num_batched_tokens=max(4096, 2 * max(lens)), enable_prefix_caching=False)
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        llm.generate([{"prompt_token_ids": text(32)}], one)  # warm-up
        best = lambda p: best_of(lambda: llm.generate([p], one)[0].metrics.ttft_s)
        pre = [best({"prompt_token_ids": text(n)}) for n in lens]
        base, per_tok, per_tok2 = fit_quadratic(np.array(lens), np.array(pre))
        per_image = per_visual = 0.0
        if img_id is not None and tpi:
            n = max(lens[len(lens) // 2], tpi + 32)
            image = PIL.Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
            with_img = best({"prompt_token_ids": text(n - tpi) + [img_id] * tpi, "multi_modal_data": {"image": [image]}})
            per_image = max(0.0, with_img - (base + n * per_tok + n * n * per_tok2))
        elif cfg.get("image_token_id") is not None and cfg.get("vision_start_token_id") is not None:
            per_visual = _grid_image_cost(llm, cfg, model, rng)

        def step_s(b: int, ctx: int) -> float:
            def once() -> float:
                outs = llm.generate([{"prompt_token_ids": text(ctx)} for _ in range(b)],
                                    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
                return float(np.median([o.tpot_s() for o in outs]))
            return best_of(once)
        steps = [step_s(b, contexts[0]) for b in batches]
        d_base, d_seq = fit_line(np.array(batches), np.array(steps))
        k = len(batches) // 2
        b = batches[k]
        per_ctx = max(0.0, (step_s(b, contexts[-1]) - steps[k]) / (b * (contexts[-1] - contexts[0])))
    finally:
        torch.set_num_threads(saved)
    per_kv_token, note = 0.0, "transfer not measured (0)"
    if transfer_json and transfer_json.exists():
        res = json.loads(transfer_json.read_text())["results"]
        row = res[max(res, key=int)]
        exposed = next(iter(row["transports"].values()))["layerwise"]["exposed_s"] or 0.0
        per_kv_token, note = exposed / row["prompt_len"], f"transfer from {transfer_json}"
    return Profile(prefill_base_s=base, prefill_per_token_s=per_tok, prefill_per_token2_s=per_tok2,
                   prefill_per_image_s=per_image, prefill_per_visual_token_s=per_visual,
                   decode_base_s=d_base, decode_per_seq_s=d_seq, decode_per_ctx_token_s=per_ctx, max_decode_batch=64,
                   transfer_per_token_s=per_kv_token,
                   source=f"measured: {model.name}, engine.LLM, {threads} thread(s), {time.strftime('%Y-%m-%d')}; "
                          f"{note}")


def _grid_image_cost(llm, cfg: dict, model: Path, rng) -> float:
    """Qwen3-VL (an image's tokens follow its size): the vision tower's seconds per image token, as the engine
    times its tower calls (``metrics.vision_s``) for a prompt of the largest distinct images (up to 4) the engine's
    context holds, the best of three runs with the vision cache cleared before each."""
    import PIL.Image

    from engine import SamplingParams
    from engine.models.qwen3_vl.image_processor import QwenVLImageProcessor

    proc = QwenVLImageProcessor.from_pretrained(model)
    pad, start, end = cfg["image_token_id"], cfg["vision_start_token_id"], cfg["vision_end_token_id"]
    room = llm.engine.max_model_len - 16  # the prompt's text and one generated token
    fits = [(s, v) for s in (64, 128, 256, 512, 1024) if (v := proc.num_visual_tokens(s, s)) + 2 <= room]
    if not fits:
        return 0.0
    side, v = max(fits, key=lambda x: (x[1], -x[0]))
    k = max(1, min(4, room // (v + 2)))
    vocab = cfg.get("text_config", cfg).get("vocab_size", 256)
    ids = [int(t) for t in rng.integers(10, min(200, vocab), 8)]
    for _ in range(k):
        ids += [start] + [pad] * v + [end]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def once() -> float:
        llm.engine.clear_vision_cache()
        images = [PIL.Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)) for _ in range(k)]
        out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], one)[0]
        return out.metrics.vision_s / (k * v)
    return best_of(once)


def _main() -> int:  # pragma: no cover
    p = argparse.ArgumentParser(prog="duet plan")
    add_arguments(p)
    return run(p.parse_args())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_main())
