"""Qwen3.5-MoE figures, Duet against transformers' ``Qwen3_5MoeForConditionalGeneration`` in the same run.

``duet bench engine --model qwen3.5-moe [MODEL_DIR]`` (:func:`run_engine`): per case (a text prompt, a one-image
prompt), TTFT and TPOT of the local engine and of transformers' ``generate`` (its own torch GDN kernels: chunked
prefill, recurrent decode), both read off the same clock: TTFT is the wall time of a one-token request, preprocessing
(the image processor) included, and TPOT is ``(wall(n) - wall(1)) / (n - 1)`` over ``n`` greedy tokens. Also what a hand-off of each prompt moves: KV bytes (the
attention layers' blocks) vs state bytes (every GDN layer's conv window and recurrent state, raw).

``duet bench transfer --model qwen3.5-moe [MODEL_DIR]`` (:func:`run_transfer`): per prompt length, TTFT (the wall
time of a one-token request, each side warmed up first) of the local engine, of transformers and of a 1 prefill + 1
decode cluster per transport, with the KV and state bytes the decode side received and the transfer time left
exposed after prefill's last layer.

Rounds alternate which side goes first; the table quotes medians over ``--repeat`` rounds (the machine may be
shared: the load average is recorded). Fresh random ids and pixels every round (nothing comes from the prefix
cache: ``duet bench prefix`` measures hits). ``--quick``: tiny sizes for tests, not for figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import PIL.Image
import torch

from cluster.report import fmt, format_table, log, ms, write_json
from duet_testing.qwen35_checkpoints import Qwen35TinySpec

BENCH_MODEL_NAME = "bench-qwen3.5-moe-v1"
# Qwen3.5-35B-A3B's pattern (3 GDN layers to 1 gated attention layer, shared expert, partial rotary) scaled to a CPU
BENCH_SPEC = Qwen35TinySpec(
    vocab_size=1024, hidden_size=512, num_layers=8, layer_types=("linear_attention",) * 3 + ("full_attention",)
    + ("linear_attention",) * 3 + ("full_attention",), num_heads=8, num_kv_heads=2, head_dim=64,
    partial_rotary_factor=0.25, mrope_section=(2, 3, 3), linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=64, linear_value_head_dim=64, moe_intermediate_size=128, shared_expert_intermediate_size=256,
    num_experts=32, top_k=4, vision_depth=4, vision_hidden=256, vision_heads=4, vision_intermediate=1024,
    num_position_embeddings=2304, min_pixels=64 * 64, max_pixels=1024 * 1024)
CASES = {"text-512": (512, 0), "image-256": (64, 256)}  # (text tokens, image side; 0: none)
QUICK_CASES = {"text-16": (16, 0), "image-32": (8, 32)}
NEW_TOKENS, QUICK_NEW_TOKENS = 32, 4
TRANSFER_LENS, QUICK_TRANSFER_LENS = (256, 1024), (16, 48)


def bench_model_dir(quick: bool) -> Path:
    from cluster.demo import cached_model
    from duet_testing.qwen35_checkpoints import make_tiny_qwen35_checkpoint

    if quick:
        return cached_model("bench-qwen3.5-moe-quick-v1", make_tiny_qwen35_checkpoint)
    return cached_model(BENCH_MODEL_NAME, lambda p: make_tiny_qwen35_checkpoint(p, BENCH_SPEC))


class Prompts:
    """Fresh prompts: random text ids below the special ids, optionally one random image between two halves."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        import json

        from engine.models.qwen3_vl.image_processor import QwenVLImageProcessor

        raw = json.loads((model_dir / "config.json").read_text())
        self.image_token_id = int(raw["image_token_id"])
        self.start, self.end = int(raw["vision_start_token_id"]), int(raw["vision_end_token_id"])
        self.num_text = min(self.image_token_id, self.start, self.end, int(raw["video_token_id"])) - 1
        self.processor = QwenVLImageProcessor.from_pretrained(model_dir)
        self.seed = seed

    def make(self, text: int, side: int, variant: int) -> dict:
        rng = np.random.default_rng([self.seed, text, side, variant])
        ids = rng.integers(0, self.num_text, text).tolist()
        if not side:
            return {"prompt_token_ids": ids}
        image = PIL.Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))
        n = self.processor.num_visual_tokens(side, side)
        ids = ids[: text // 2] + [self.start] + [self.image_token_id] * n + [self.end] + ids[text // 2:]
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}}


def load_hf(model_dir: Path, dtype: str):
    from duet_testing.qwen35_checkpoints import load_qwen35_reference

    model = load_qwen35_reference(model_dir).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = None  # like ignore_eos
    return model


@torch.inference_mode()
def hf_wall(model, processor, image_token_id: int, prompt: dict, n: int) -> float:
    t0 = time.perf_counter()
    inp = torch.tensor([prompt["prompt_token_ids"]])
    kw = {}
    if "multi_modal_data" in prompt:
        pv, grid = processor(prompt["multi_modal_data"]["image"])
        kw = dict(pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=(inp == image_token_id).int())
    model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), max_new_tokens=n, min_new_tokens=n,
                   do_sample=False, **kw)
    return time.perf_counter() - t0


def duet_wall(llm, prompt: dict, n: int) -> float:
    """Wall seconds of one request of ``n`` greedy tokens, preprocessing (the image processor) included: the clock
    :func:`hf_wall` reads for transformers, so both sides' TTFT and TPOT mean the same thing."""
    from engine import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
    elapsed = time.perf_counter() - t0
    assert len(out.outputs[0].token_ids) == n, (len(out.outputs[0].token_ids), n)
    return elapsed


def ttft_tpot(wall: Callable[[int], float], n: int) -> tuple[float, float]:
    """(TTFT s, TPOT s) from a side's wall clock: a one-token request's wall time, and the ``n``-token request's
    extra time per extra token. The same for Duet and transformers."""
    one = wall(1)
    return one, (wall(n) - one) / max(n - 1, 1)


def handoff_bytes(engine, prompt_len: int) -> dict:
    """What a hand-off of a ``prompt_len``-token prompt moves: KV (whole blocks) and GDN state (per request)."""
    t, bs = engine.model_config.text, engine.config.block_size
    kv = -(-prompt_len // bs) * bs * t.kv_bytes_per_token(engine.dtype)
    return {"kv_bytes": kv, "state_bytes": t.state_bytes_per_seq(engine.dtype)}


def _alternate(r: int, sides: list) -> list:
    return sides if r % 2 == 0 else sides[::-1]


def run_engine(args: argparse.Namespace) -> int:
    from engine import LLM

    model_dir = Path(args.model_dir) if args.model_dir else bench_model_dir(args.quick)
    cases, n = (QUICK_CASES, QUICK_NEW_TOKENS) if args.quick else (CASES, NEW_TOKENS)
    rounds, load_start = args.repeat or (1 if args.quick else 3), os.getloadavg()
    prompts = Prompts(model_dir, args.seed)
    llm = LLM(model_dir, dtype=args.dtype, device=args.device, max_model_len=2048)
    hf = load_hf(model_dir, args.dtype)
    warm = prompts.make(8, 0, 1 << 30)
    duet_wall(llm, warm, 2), hf_wall(hf, prompts.processor, prompts.image_token_id, warm, 2)
    results = {}
    for name, (text, side) in cases.items():
        raw: dict[str, list] = {"duet": [], "hf": []}
        for r in range(rounds):
            p = prompts.make(text, side, r)
            walls = {"duet": lambda k, p=p: duet_wall(llm, p, k),
                     "hf": lambda k, p=p: hf_wall(hf, prompts.processor, prompts.image_token_id, p, k)}
            for who in _alternate(r, ["duet", "hf"]):
                raw[who].append(ttft_tpot(walls[who], n))
        med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in raw.items()}
        plen = len(prompts.make(text, side, 0)["prompt_token_ids"])
        results[name] = {"prompt_tokens": plen, "new_tokens": n, **handoff_bytes(llm.engine, plen),
                         "duet": {"ttft_s": med["duet"][0], "tpot_s": med["duet"][1]},
                         "hf": {"ttft_s": med["hf"][0], "tpot_s": med["hf"][1]},
                         "ttft_ratio": med["duet"][0] / med["hf"][0], "tpot_ratio": med["duet"][1] / med["hf"][1],
                         "rounds": raw}
        log(f"{name}: duet ttft {ms(med['duet'][0]):.0f} ms tpot {ms(med['duet'][1]):.1f} ms; transformers ttft "
            f"{ms(med['hf'][0]):.0f} ms tpot {ms(med['hf'][1]):.1f} ms")
    header = ["case", "prompt tok", "duet ttft ms", "hf ttft ms", "duet/hf ttft", "duet tpot ms", "hf tpot ms",
              "duet/hf tpot", "KV KiB", "state KiB"]
    rows = [[k, str(r["prompt_tokens"]), fmt(ms(r["duet"]["ttft_s"])), fmt(ms(r["hf"]["ttft_s"])),
             fmt(r["ttft_ratio"], 2), fmt(ms(r["duet"]["tpot_s"]), 2), fmt(ms(r["hf"]["tpot_s"]), 2),
             fmt(r["tpot_ratio"], 2), fmt(r["kv_bytes"] / 1024), fmt(r["state_bytes"] / 1024)]
            for k, r in results.items()]
    return _report(args, model_dir, load_start, {"config": {"dtype": args.dtype, "rounds": rounds, "quick": args.quick,
                                                            "statistic": "median"}, "cases": results}, header, rows)


def _report(args: argparse.Namespace, model_dir: Path, load_start: tuple, body: dict, header: list[str],
            rows: list[list[str]]) -> int:
    """Write the JSON (``body`` plus the model, machine load and time) and print the table."""
    spec = None if args.model_dir else asdict(Qwen35TinySpec() if args.quick else BENCH_SPEC)
    doc = {"model": "qwen3.5-moe", "model_dir": str(model_dir), "spec": spec,
           **body, "torch_threads": torch.get_num_threads(),
           "load_average": {"start": load_start, "end": os.getloadavg()},
           "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    path = write_json(args.json, doc)
    print(format_table(header, rows))
    log(f"wrote {path}")
    return 0


def run_transfer(args: argparse.Namespace) -> int:
    from cluster.control.disagg import DisaggCluster
    from cluster.control.spec import ClusterSpec
    from engine import LLM, SamplingParams

    model_dir = Path(args.model_dir) if args.model_dir else bench_model_dir(args.quick)
    lens = args.prompt_lens or list(QUICK_TRANSFER_LENS if args.quick else TRANSFER_LENS)
    transports = args.transports or ["gloo", "grpc"]
    rounds, load_start = args.repeat, os.getloadavg()
    prompts = Prompts(model_dir, args.seed)
    cfg = dict(num_kv_blocks=(max(lens) // 16 + 2) * 4, block_size=16, max_num_seqs=4, max_model_len=max(lens) + 8)
    llm = LLM(model_dir, dtype="float32", **cfg)
    hf = load_hf(model_dir, "float32")
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    local = {L: {"duet": [], "hf": []} for L in lens}
    warm = prompts.make(8, 0, 1 << 30)
    duet_wall(llm, warm, 1), hf_wall(hf, prompts.processor, prompts.image_token_id, warm, 1)
    for r in range(rounds):
        for L in lens:
            p = prompts.make(L, 0, r)
            for who in _alternate(r, ["duet", "hf"]):  # each side warm, neither always first
                local[L][who].append(duet_wall(llm, p, 1) if who == "duet"
                                     else hf_wall(hf, prompts.processor, prompts.image_token_id, p, 1))
    clusters: dict[str, dict[int, list[dict]]] = {}
    for transport in transports:
        c = DisaggCluster(ClusterSpec(model_dir=str(model_dir), num_prefill=1, num_decode=1, transport=transport,
                                      cpus_per_worker=1, request_timeout_s=120, local_prefill_tokens=0, **cfg))
        try:
            c.generate_batch([prompts.make(8, 0, 1 << 30)], greedy)  # warm-up
            clusters[transport] = {L: [] for L in lens}
            for r in range(rounds):
                for L in lens:
                    p = prompts.make(L, 0, r)
                    t0 = time.perf_counter()
                    got = c.generate_batch([p], greedy)[0]
                    clusters[transport][L].append({"ttft_s": time.perf_counter() - t0, **got.kv_transfer})
            held = c.check_no_leaks()
        finally:
            c.shutdown()
        log(f"{transport}: done, blocks/slots left {held}")
    med = statistics.median
    results = {}
    for L in lens:
        row = {"duet_local_ttft_s": med(local[L]["duet"]), "hf_ttft_s": med(local[L]["hf"])}
        for t in transports:
            runs = clusters[t][L]
            row[t] = {"ttft_s": med(x["ttft_s"] for x in runs), "kv_bytes": runs[0]["bytes"],
                      "state_bytes": runs[0]["state_bytes"], "state_frames": runs[0]["state_frames"],
                      "exposed_s": med(x["exposed_seconds"] for x in runs)}
        results[L] = row
    header = ["prompt tok", "local ttft ms", "hf ttft ms"] + [f"{t} {k}" for t in transports
                                                            for k in ("ttft ms", "exposed ms")] + ["KV KiB",
                                                                                                   "state KiB"]
    t0 = transports[0]
    rows = [[str(L), fmt(ms(r["duet_local_ttft_s"])), fmt(ms(r["hf_ttft_s"]))]
            + [fmt(ms(r[t][k])) for t in transports for k in ("ttft_s", "exposed_s")]
            + [fmt(r[t0]["kv_bytes"] / 1024), fmt(r[t0]["state_bytes"] / 1024)] for L, r in results.items()]
    return _report(args, model_dir, load_start, {"config": {**cfg, "rounds": rounds, "transports": transports,
                                                            "statistic": "median", "quick": args.quick},
                                                 "lengths": results}, header, rows)
