"""``duet bench kv-codec --model qwen3-vl-moe [MODEL_DIR]``: what each KV compression policy saves and costs on a
Qwen3-VL-MoE checkpoint, per image size.

For every ``--image-sizes`` side and every policy (the first is always ``none``, the reference), ``--prompts``
one-image prompts of that size (:class:`~duet_bench.qwen_bench.QwenPrompts`: fresh random pixels and text ids,
so the visual-token count per request follows the image, 64 / 256 / 1024 at 256² / 512² / 1024²):

* bytes -- the prompts' KV as the prefill worker hands it to its sender (captured, all layers), encoded by the
  policy's codec: bytes per text and per visual token and the ratios against float32 / bfloat16 / the pool dtype
  (:func:`duet_bench.kvcodec_measure.byte_summary`);
* quality -- through an in-process prefill -> decode pair (:class:`~cluster.control.local_pair.LocalPair`, M-RoPE delta in
  the hand-off): greedy agreement with ``none`` over up to ``--tokens`` tokens and the mean next-token KL
  (:func:`~duet_bench.kvcodec_measure.agreement`, :func:`~duet_bench.kvcodec_measure.mean_kl`).

The checkpoint has random weights, so there is no task accuracy and no end-to-end Ray run here; the LLaVA mode of
``duet bench kv-codec`` measures those. Prints a table, writes ``--json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
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
from duet_bench.qwen_bench import DEFAULT_IMAGE_SIZES, QwenPrompts, qwen_bench_model_dir
from cluster.report import fmt, format_table, log, write_json

DEFAULT_PROMPTS = 4


def measure_size(model_dir: Path, config, layout, policies: list, prompts: list[dict], tokens: int, *,
                 image_token_id: int, raw_per_token: float, itemsize: int) -> dict[str, dict]:
    """Per policy: byte summary and quality of ``prompts`` (the first policy is the reference)."""
    results, ref = {}, None
    for name, policy in policies:
        m = codec_measure(capture_layers(model_dir, config, prompts, policy), policy, layout)
        # one request between allocation and first token at a time: four 1024² prefills queued together outlast
        # the decode side's lease on a 2-core machine
        q = quality_runs(model_dir, config, policy, prompts, tokens, [], window=1)
        ref = ref or q
        stats = m["stats"] if policy is not None else _identity_stats(prompts, image_token_id, layout.num_layers,
                                                                         raw_per_token)
        results[name] = {
            "policy": None if policy is None else policy.to_dict(),
            "bytes": byte_summary(stats, layout.num_layers, raw_per_token, itemsize),
            "raw_bytes": m["raw_bytes"], "wire_bytes": m["wire_bytes"],
            "ratio_vs_raw": m["raw_bytes"] / m["wire_bytes"] if m["wire_bytes"] else None,
            "agreement": agreement(ref["tokens"], q["tokens"]),
            "kl": mean_kl(ref["tokens"], ref["logits"], q["tokens"], q["logits"]),
            "generated_tokens": [len(t) for t in q["tokens"]]}
    return results


def _identity_stats(prompts: list[dict], image_token_id: int, num_layers: int, raw_per_token: float) -> list[dict]:
    """Per-layer stats of the uncompressed wire, split by modality from the prompts' ids (the identity codec has no
    visual mask of its own): every prompt token at raw size."""
    visual = sum(sum(t == image_token_id for t in p["prompt_token_ids"]) for p in prompts)
    text = sum(len(p["prompt_token_ids"]) for p in prompts) - visual
    per_layer = raw_per_token / num_layers
    return [{"text": {"tokens": text, "dropped": 0, "bytes": text * per_layer},
             "visual": {"tokens": visual, "dropped": 0, "bytes": visual * per_layer}}] * num_layers


def table(sizes: dict[str, dict]) -> str:
    header = ["image", "visual tok/req", "policy", "text B/tok", "visual B/tok", "visual x f32", "visual x bf16",
              "all x raw", "agree %", "KL"]
    rows = []
    for key, s in sizes.items():
        for name, r in s["policies"].items():
            b = r["bytes"]
            rows.append([key, str(s["visual_tokens"]), name, fmt(b["text"]["bytes_per_token"], 0),
                         fmt(b["visual"]["bytes_per_token"], 0), fmt(b["visual"]["vs_float32"], 2),
                         fmt(b["visual"]["vs_bfloat16"], 2), fmt(r["ratio_vs_raw"], 2),
                         fmt(100 * r["agreement"], 1), f"{r['kl']:.2e}"])
    return format_table(header, rows)


def run(args: argparse.Namespace) -> int:
    from engine import EngineConfig
    from engine.config import ModelConfig
    from kv_transfer import KVLayout
    from kv_transfer.compression import InvalidPolicy

    try:
        policies = policies_from_args(args)
    except InvalidPolicy as e:
        print(f"duet: error: {e}", file=sys.stderr)
        return 2
    n_prompts = DEFAULT_PROMPTS if args.prompts is None else args.prompts
    if n_prompts < 1 or args.tokens < 1:
        print("duet: error: --prompts and --tokens must be >= 1", file=sys.stderr)
        return 2
    model_dir = Path(args.model_dir) if args.model_dir else qwen_bench_model_dir()
    sides = args.image_sizes or list(DEFAULT_IMAGE_SIZES)
    cfg = ModelConfig.from_pretrained(model_dir)
    config = EngineConfig(dtype=args.dtype, max_num_seqs=64, num_kv_blocks=4096, block_size=16)
    t = cfg.text
    layout = KVLayout(t.num_layers, config.block_size, t.num_kv_heads, t.head_dim, args.dtype)
    itemsize = torch.empty((), dtype=layout.torch_dtype).element_size()
    raw_per_token = 2 * t.num_layers * t.num_kv_heads * t.head_dim * itemsize
    gen = QwenPrompts(model_dir, seed=0)
    sizes = {}
    for side in sides:
        prompts = []
        for i in range(n_prompts):
            ids, image = gen.make(side, i)
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}})
        log(f"[kv-codec] {side}x{side}: {n_prompts} prompts x {gen.num_visual_tokens(side)} visual tokens, "
            f"policies {', '.join(n for n, _ in policies)}")
        sizes[f"{side}x{side}"] = {
            "image_side": side, "visual_tokens": gen.num_visual_tokens(side),
            "prompt_tokens": len(prompts[0]["prompt_token_ids"]),
            "policies": measure_size(model_dir, config, layout, policies, prompts, args.tokens,
                                     image_token_id=gen.image_token_id, raw_per_token=raw_per_token,
                                     itemsize=itemsize)}
    print(table(sizes))
    path = write_json(Path(args.json), {
        "model_dir": str(model_dir), "model": "qwen3-vl-moe", "dtype": args.dtype, "prompts": n_prompts,
        "tokens": args.tokens, "policies": [n for n, _ in policies], "sizes": sizes,
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat()})
    log(f"wrote {path}")
    return 0
