"""``duet bench prefix [MODEL_DIR]``: what a prefix hit costs on a Qwen3.5 hybrid model against a cold prefill.

The prompt: about ``--prompt-tokens`` tokens (default 2,048) with one random ``--image-side``-pixel square image
(default 512) between two halves of random text ids (:class:`duet_bench.qwen35_bench.Prompts`), fresh pixels and
text every round, so nothing of it is cached before its first send. Per round, in one :class:`engine.LLM`
(float32, prefix caching on, GDN state snapshots on, a pool that evicts nothing):

* **cold** -- the prompt's first send, one greedy token (``max_tokens=1``, EOS ignored): the whole prefill, the
  vision tower included;
* **hit** -- the same prompt sent again right after: the engine restores the cached KV blocks and the GDN state
  snapshot after the last hittable block (``RequestOutput.num_cached_tokens``) and computes only the tokens after it.

Both are timed twice: the wall clock around ``LLM.generate`` (the image processor included) and the engine's own
TTFT (``RequestMetrics.ttft_s``: arrival to first token, preprocessing before arrival left out); the vision tower's
share is ``RequestMetrics.vision_s``. The ratio is hit / cold per round; the table and ``median`` quote the medians
over ``--rounds`` rounds (the ratio's median is the median of the per-round ratios, each from two adjacent sends).
The same rounds run on a second engine with ``state_snapshots=0`` (no prefix cache for a hybrid model): its repeat
should cost about a cold prefill and report 0 cached tokens, which shows the hit comes from the snapshots (its
repeat still finds the image in the vision cache). ``same_token``: both sends, in both engines, gave the same greedy
token. The engines take turns going first; the host CPU, load average, torch threads and date are recorded.
``--quick``: the tiny checkpoint and a short prompt with a small image, for tests, not for figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cluster.report import fmt, format_table, log, ms, write_json
from duet_bench.machine import cpu_description
from duet_bench.qwen35_bench import BENCH_SPEC, Prompts, bench_model_dir
from duet_testing.qwen35_checkpoints import Qwen35TinySpec

PROMPT_TOKENS, IMAGE_SIDE = 2048, 512
QUICK_PROMPT_TOKENS, QUICK_IMAGE_SIDE = 64, 64
BLOCK_SIZE = 16
STATE_SNAPSHOTS = 32  # more than one prompt's snapshot points (every 16 blocks, the image's end, the last block)
WARMUP_VARIANT = 1 << 30  # a prompt no round uses
ENGINES = ("snapshots", "no_snapshots")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", help="a Qwen3.5 checkpoint (default: the bench-scale Qwen3.5-MoE)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each a fresh prompt (default 3)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help=f"prompt length, image placeholders included (default {PROMPT_TOKENS}; quick "
                        f"{QUICK_PROMPT_TOKENS})")
    p.add_argument("--image-side", type=int, default=None,
                   help=f"the image's side in pixels (default {IMAGE_SIDE}; quick {QUICK_IMAGE_SIDE})")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts' ids and pixels")
    p.add_argument("--quick", action="store_true", help="tiny checkpoint and prompt: for tests, not for figures")
    p.add_argument("--json", default="bench_out/prefix.json", help="where to write the results")


@dataclass(frozen=True)
class Send:
    """One one-token request's figures."""

    wall_s: float  # around LLM.generate
    engine_s: float  # RequestMetrics.ttft_s
    vision_s: float
    cached_tokens: int
    token: int


def make_prompt(prompts: Prompts, total: int, side: int, variant: int) -> dict:
    """A ``total``-token prompt: one ``side``-pixel square image (its placeholders and the vision start / end
    markers) between two halves of random text."""
    text = total - prompts.processor.num_visual_tokens(side, side) - 2
    assert text >= 2, f"a {side}-pixel image leaves no room for text in {total} tokens"
    prompt = prompts.make(text, side, variant)
    assert len(prompt["prompt_token_ids"]) == total
    return prompt


def send(llm, prompt: dict) -> Send:
    """Send ``prompt`` for one greedy token and time it."""
    from engine import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    wall = time.perf_counter() - t0
    assert len(out.outputs[0].token_ids) == 1 and out.metrics.ttft_s is not None
    return Send(wall, out.metrics.ttft_s, out.metrics.vision_s, out.num_cached_tokens, out.outputs[0].token_ids[0])


def pair(llm, prompt: dict) -> dict:
    """The prompt sent twice in a row (cold, then the repeat: a hit where the engine keeps snapshots)."""
    cold, hit = send(llm, prompt), send(llm, prompt)
    return {"cold_s": cold.wall_s, "hit_s": hit.wall_s, "ratio": hit.wall_s / cold.wall_s,
            "cold_engine_s": cold.engine_s, "hit_engine_s": hit.engine_s, "engine_ratio": hit.engine_s / cold.engine_s,
            "cold_vision_s": cold.vision_s, "hit_vision_s": hit.vision_s, "cold_cached_tokens": cold.cached_tokens,
            "cached_tokens": hit.cached_tokens, "same_token": cold.token == hit.token, "token": hit.token}


def engine_config(prompt_tokens: int, rounds: int, snapshots: bool, device: str) -> dict:
    """Keyword arguments of :class:`engine.LLM`: float32, a pool that holds every round's prompt (nothing evicted)."""
    blocks = -(-(prompt_tokens + 1) // BLOCK_SIZE) + 1
    return dict(dtype="float32", device=device, block_size=BLOCK_SIZE, num_kv_blocks=blocks * (rounds + 2),
                max_num_seqs=4, max_model_len=prompt_tokens + 16, max_num_batched_tokens=max(4096, prompt_tokens),
                enable_prefix_caching=True, state_snapshots=STATE_SNAPSHOTS if snapshots else 0)


MEDIAN_KEYS = ("cold_s", "hit_s", "ratio", "cold_engine_s", "hit_engine_s", "engine_ratio", "cold_vision_s",
               "hit_vision_s", "cached_tokens")


def medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in MEDIAN_KEYS}


def run(args: argparse.Namespace) -> int:
    from engine import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir) if args.model_dir else bench_model_dir(args.quick)
    total = args.prompt_tokens or (QUICK_PROMPT_TOKENS if args.quick else PROMPT_TOKENS)
    side = args.image_side or (QUICK_IMAGE_SIDE if args.quick else IMAGE_SIDE)
    load_start = os.getloadavg()
    prompts = Prompts(model_dir, args.seed)
    configs = {name: engine_config(total, args.rounds, name == "snapshots", "cpu") for name in ENGINES}
    llms = {name: LLM(model_dir, **cfg) for name, cfg in configs.items()}
    warm = make_prompt(prompts, total, side, WARMUP_VARIANT)
    for llm in llms.values():  # first-call costs (kernels, allocations) out of round 0, the hit path's too
        pair(llm, warm)
    rounds = []
    for r in range(args.rounds):
        prompt = make_prompt(prompts, total, side, r)
        got = {name: pair(llms[name], prompt) for name in (ENGINES if r % 2 == 0 else ENGINES[::-1])}
        s, n = got["snapshots"], got["no_snapshots"]
        same = s["same_token"] and n["same_token"] and s["token"] == n["token"]
        rounds.append({"round": r, "prompt_tokens": total, **s, "same_token": same, "no_snapshots": n})
        log(f"round {r}: cold {ms(s['cold_s']):.0f} ms, hit {ms(s['hit_s']):.0f} ms ({s['ratio']:.3f}x, "
            f"{s['cached_tokens']} cached); no snapshots: repeat {ms(n['hit_s']):.0f} ms ({n['ratio']:.3f}x, "
            f"{n['cached_tokens']} cached)")
    spec = None if args.model_dir else asdict(Qwen35TinySpec() if args.quick else BENCH_SPEC)
    doc = {"model": "qwen3.5-moe", "model_dir": str(model_dir), "spec": spec, "prompt_tokens": total,
           "image_side": side, "image_tokens": prompts.processor.num_visual_tokens(side, side),
           "config": {"engine": configs["snapshots"], "no_snapshots_engine": configs["no_snapshots"],
                      "state_snapshot_every_blocks": llms["snapshots"].engine.config.state_snapshot_every_blocks,
                      "rounds": args.rounds, "quick": args.quick, "seed": args.seed, "statistic": "median"},
           "rounds": rounds, "median": medians(rounds),
           "no_snapshots": medians([r["no_snapshots"] for r in rounds]),
           "same_token": all(r["same_token"] for r in rounds),
           "machine": {"cpu": cpu_description(), "torch_threads": torch.get_num_threads(),
                       "load_average": {"start": load_start, "end": os.getloadavg()}},
           "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    path = write_json(args.json, doc)
    print(table(doc))
    log(f"wrote {path}")
    return 0


def table(doc: dict) -> str:
    """One row per round and engine, then the medians."""
    header = ["round", "engine", "cold ms", "hit ms", "hit/cold", "engine cold ms", "engine hit ms", "engine hit/cold",
              "vision cold ms", "cached tok", "same token"]

    def row(label: str, engine: str, r: dict) -> list[str]:
        same = r.get("same_token")
        return [label, engine, fmt(ms(r["cold_s"])), fmt(ms(r["hit_s"])), fmt(r["ratio"], 3),
                fmt(ms(r["cold_engine_s"])), fmt(ms(r["hit_engine_s"])), fmt(r["engine_ratio"], 3),
                fmt(ms(r["cold_vision_s"])), fmt(r["cached_tokens"]), "-" if same is None else str(same)]

    rows = []
    for r in doc["rounds"]:
        rows += [row(str(r["round"]), "snapshots", r), row(str(r["round"]), "state_snapshots=0", r["no_snapshots"])]
    rows += [row("median", "snapshots", doc["median"]), row("median", "state_snapshots=0", doc["no_snapshots"])]
    cpu = doc["machine"]["cpu"]
    return (f"prefix hit vs cold prefill: {doc['prompt_tokens']} prompt tokens, one {doc['image_side']}^2 image "
            f"({doc['image_tokens']} tokens), 1 output token, {len(doc['rounds'])} rounds; {cpu['model']}, "
            f"{doc['machine']['torch_threads']} threads\n{format_table(header, rows)}\n"
            f"median hit/cold: {doc['median']['ratio']:.3f} (wall), {doc['median']['engine_ratio']:.3f} (engine TTFT)")
