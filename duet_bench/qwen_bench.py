"""``duet bench engine --model qwen3-vl-moe [MODEL_DIR]``: time to first token of one image prompt, Duet against
transformers' ``Qwen3VLMoeForConditionalGeneration``, same checkpoint, same run.

One request per measurement: ``<|im_start|>`` + 8 text ids + ``<|vision_start|>`` + n image ids + ``<|vision_end|>``
+ 8 text ids, for one square image of each ``--image-sizes`` side (n = the processor's visual-token count: 64, 256,
1024 at 256², 512², 1024² with patch 16, merge 2). Both sides start from the same PIL image and prompt ids:

* Duet -- ``LLM.generate(max_tokens=1)`` (preprocessing, vision tower, prefill, first token), wall clock; the
  request's own ``metrics.ttft_s`` is recorded beside it;
* transformers -- ``QwenVLImageProcessor`` (the same preprocessing, which transformers' processor reproduces) then
  ``generate(max_new_tokens=1, do_sample=False)`` (its vision tower and prefill), wall clock; sdpa attention, the
  default experts implementation, no EOS.

Prefill tokens/s = prompt tokens (text + visual) / TTFT. Fairness: one process, so both sides use the same torch
threads; every measurement has a fresh random image and fresh text ids (no vision-cache or prefix-cache hit: the
JSON records the hits, always 0); one warm-up per size and side; rounds alternate which side goes first and the table
quotes per-size medians over ``--repeat`` rounds (the machine may be shared); the load average is recorded.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import PIL.Image
import torch

from cluster.report import fmt, format_table, log, ms, write_json
from duet_bench.engine_workload import usable_token_ids
from duet_testing.qwen_checkpoints import QwenTinySpec

QWEN_BENCH_MODEL_NAME = "bench-qwen3-vl-moe-v1"
# Qwen3-VL-30B-A3B's shapes scaled to a 2-core CPU (~60M parameters, 17M of them in the vision tower).
QWEN_BENCH_SPEC = QwenTinySpec(
    text="qwen3_vl_moe", vocab_size=1024, hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4, head_dim=64,
    intermediate_size=1536, moe_intermediate_size=128, num_experts=32, top_k=4, mrope_section=(12, 10, 10),
    vision_depth=12, vision_hidden=256, vision_heads=4, vision_intermediate=1024, num_position_embeddings=2304,
    deepstack_visual_indexes=(2, 5, 8), min_pixels=64 * 64, max_pixels=1024 * 1024, dtype="float32")
DEFAULT_IMAGE_SIZES = (256, 512, 1024)
QUICK_IMAGE_SIZES = (32, 64)
DEFAULT_ROUNDS = 5
TEXT_BEFORE = TEXT_AFTER = 8
WARM_UP_VARIANT = 1 << 30


def qwen_bench_model_dir() -> Path:
    """The default Qwen bench checkpoint, built once into ``$DUET_HOME/models``."""
    from cluster.demo import cached_model, duet_home
    from duet_testing.qwen_checkpoints import make_tiny_qwen_checkpoint

    if not (duet_home() / "models" / QWEN_BENCH_MODEL_NAME / "config.json").is_file():
        log(f"building the Qwen bench model into {duet_home() / 'models' / QWEN_BENCH_MODEL_NAME} (once)")
    return cached_model(QWEN_BENCH_MODEL_NAME, lambda p: make_tiny_qwen_checkpoint(p, QWEN_BENCH_SPEC))


def image_sizes(text: str) -> list[int]:
    """``--image-sizes``: comma-separated square sides in pixels."""
    try:
        sizes = [int(s) for s in text.replace(" ", "").split(",") if s]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--image-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--image-sizes must be positive, got {text!r}")
    return sizes


class QwenPrompts:
    """Fresh one-image prompts of a Qwen3-VL checkpoint: random text ids (no special or image id), random pixels."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        from engine.models.qwen3_vl.image_processor import QwenVLImageProcessor

        raw = json.loads((model_dir / "config.json").read_text())
        self.image_token_id = int(raw["image_token_id"])
        self.vision_start, self.vision_end = int(raw["vision_start_token_id"]), int(raw["vision_end_token_id"])
        self.processor = QwenVLImageProcessor.from_pretrained(model_dir)
        self.text_ids = np.setdiff1d(usable_token_ids(model_dir), [self.image_token_id, self.vision_start,
                                                                   self.vision_end])
        self.seed = seed

    def num_visual_tokens(self, side: int) -> int:
        return self.processor.num_visual_tokens(side, side)

    def make(self, side: int, variant: int) -> tuple[list[int], PIL.Image.Image]:
        """Deterministic in (seed, side, variant); a different variant gives different ids and pixels."""
        rng = np.random.default_rng([self.seed, side, variant])
        text = self.text_ids[rng.integers(0, len(self.text_ids), TEXT_BEFORE + TEXT_AFTER)].tolist()
        ids = (text[:TEXT_BEFORE] + [self.vision_start] + [self.image_token_id] * self.num_visual_tokens(side)
               + [self.vision_end] + text[TEXT_BEFORE:])
        return ids, PIL.Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))


def duet_ttft(llm, ids: list[int], image: PIL.Image.Image) -> dict:
    from engine import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}}],
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    wall = time.perf_counter() - t0
    return {"ttft_s": wall, "metrics_ttft_s": out.metrics.ttft_s, "prefill_tokens_per_s": len(ids) / wall,
            "first_token": out.outputs[0].token_ids[0], "prefix_cache_hit_tokens": out.num_cached_tokens}


def load_hf_qwen(model_dir: Path, dtype: str):
    import transformers

    mt = json.loads((model_dir / "config.json").read_text())["model_type"]
    cls = (transformers.Qwen3VLMoeForConditionalGeneration if mt == "qwen3_vl_moe"
           else transformers.Qwen3VLForConditionalGeneration)
    model = cls.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    model.generation_config.do_sample = False
    return model


@torch.inference_mode()
def hf_ttft(model, processor, image_token_id: int, ids: list[int], image: PIL.Image.Image) -> dict:
    t0 = time.perf_counter()
    pv, grid = processor([image])
    t1 = time.perf_counter()
    inp = torch.tensor([ids])
    out = model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), pixel_values=pv, image_grid_thw=grid,
                         mm_token_type_ids=(inp == image_token_id).int(), max_new_tokens=1, do_sample=False)
    wall = time.perf_counter() - t0
    return {"ttft_s": wall, "preprocess_s": t1 - t0, "prefill_tokens_per_s": len(ids) / wall,
            "first_token": int(out[0, len(ids)])}


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def measure(llm, hf, prompts: QwenPrompts, sizes: list[int], rounds: int) -> dict[str, dict]:
    """Warm-up, then ``rounds`` rounds over every size, alternating which side goes first; per size the raw rounds
    and their medians."""
    def duet(ids, im):
        return duet_ttft(llm, ids, im)

    def hf_(ids, im):
        return hf_ttft(hf, prompts.processor, prompts.image_token_id, ids, im)

    for side in sizes:  # warm-up on a variant no round uses
        ids, im = prompts.make(side, WARM_UP_VARIANT)
        duet(ids, im), hf_(ids, im)
    raw: dict[int, dict[str, list[dict]]] = {s: {"duet": [], "hf": []} for s in sizes}
    for r in range(rounds):
        for side in sizes:
            ids, im = prompts.make(side, r)
            order = (("duet", duet), ("hf", hf_)) if r % 2 == 0 else (("hf", hf_), ("duet", duet))
            for name, fn in order:
                raw[side][name].append(fn(ids, im))
            d, h = raw[side]["duet"][-1], raw[side]["hf"][-1]
            log(f"{side}² round {r + 1}/{rounds}: duet {ms(d['ttft_s']):.0f} ms, transformers {ms(h['ttft_s']):.0f} ms")
    out = {}
    for side in sizes:
        d, h = raw[side]["duet"], raw[side]["hf"]
        prompt_tokens = TEXT_BEFORE + TEXT_AFTER + 2 + prompts.num_visual_tokens(side)
        med = {"duet": {k: _median(d, k) for k in ("ttft_s", "metrics_ttft_s", "prefill_tokens_per_s")},
               "hf": {k: _median(h, k) for k in ("ttft_s", "preprocess_s", "prefill_tokens_per_s")}}
        out[f"{side}x{side}"] = {
            "image_side": side, "visual_tokens": prompts.num_visual_tokens(side), "prompt_tokens": prompt_tokens,
            "duet": med["duet"], "hf": med["hf"],
            "ttft_ratio": med["duet"]["ttft_s"] / med["hf"]["ttft_s"],
            "prefill_speedup": med["duet"]["prefill_tokens_per_s"] / med["hf"]["prefill_tokens_per_s"],
            "first_tokens_match": sum(a["first_token"] == b["first_token"] for a, b in zip(d, h, strict=True)),
            "prefix_cache_hit_tokens": sum(x["prefix_cache_hit_tokens"] for x in d),
            "rounds": {"duet": d, "hf": h}}
    return out


def table(results: dict[str, dict]) -> str:
    header = ["image", "visual tok", "prompt tok", "duet ttft ms", "hf ttft ms", "duet/hf ttft", "duet tok/s",
              "hf tok/s", "duet/hf tok/s", "same 1st tok"]
    rows = [[k, str(r["visual_tokens"]), str(r["prompt_tokens"]), fmt(ms(r["duet"]["ttft_s"])),
             fmt(ms(r["hf"]["ttft_s"])), fmt(r["ttft_ratio"], 2), fmt(r["duet"]["prefill_tokens_per_s"]),
             fmt(r["hf"]["prefill_tokens_per_s"]), fmt(r["prefill_speedup"], 2),
             f"{r['first_tokens_match']}/{len(r['rounds']['duet'])}"] for k, r in results.items()]
    return format_table(header, rows)


def run(args: argparse.Namespace) -> int:
    from engine import LLM

    model_dir = Path(args.model_dir) if args.model_dir else qwen_bench_model_dir()
    sizes = args.image_sizes or list(QUICK_IMAGE_SIZES if args.quick else DEFAULT_IMAGE_SIZES)
    rounds = args.repeat or (1 if args.quick else DEFAULT_ROUNDS)
    load_start = os.getloadavg()
    prompts = QwenPrompts(model_dir, args.seed)
    longest = TEXT_BEFORE + TEXT_AFTER + 2 + max(prompts.num_visual_tokens(s) for s in sizes)
    log(f"loading {model_dir} into Duet and transformers ({args.dtype}, {torch.get_num_threads()} torch threads)")
    llm = LLM(model_dir, dtype=args.dtype, device=args.device, max_model_len=longest + 16,
              max_num_batched_tokens=max(4096, longest))
    hf = load_hf_qwen(model_dir, args.dtype)
    results = measure(llm, hf, prompts, sizes, rounds)
    cfg = llm.engine.config
    doc = {"model_dir": str(model_dir), "model": "qwen3-vl-moe",
           "spec": asdict(QWEN_BENCH_SPEC) if not args.model_dir else None,
           "config": {"dtype": args.dtype, "device": args.device, "seed": args.seed, "rounds": rounds,
                      "quick": args.quick, "image_sizes": sizes, "statistic": "median over rounds",
                      "duet": {"max_num_batched_tokens": cfg.max_num_batched_tokens, "block_size": cfg.block_size,
                               "enable_prefix_caching": cfg.enable_prefix_caching},
                      "hf": {"attn_implementation": hf.config._attn_implementation,
                             "experts_implementation": hf.get_experts_implementation(),
                             "timed": "QwenVLImageProcessor + generate(max_new_tokens=1)"}},
           "sizes": results, "torch_threads": torch.get_num_threads(),
           "load_average": {"start": load_start, "end": os.getloadavg()},
           "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    path = write_json(args.json, doc)
    print(table(results))
    log(f"wrote {path}")
    return 0
