"""``duet bench engine [MODEL_DIR]``: the Duet engine against transformers' ``generate``, same checkpoint, same run.

Scenarios (``--quick`` shrinks every size so a test finishes in seconds):

* ``uniform1`` / ``uniform32`` -- 1 / 32 prompts of 128 random tokens, 64 new tokens each, prefill included;
* ``mixed`` -- 64 requests at once, prompt lengths uniform in [16, 512], output lengths uniform in [8, 128].
  transformers runs them as its users do: batches of 32 in submission order, left-padded, each batch generating
  its longest requested output. Only requested tokens count as useful on both sides.

Fairness: prompts are random ids from the text vocabulary minus special and image ids (``--seed``); fresh ids for
every scenario and repeat, so no prompt ever hits the engine's prefix cache (the JSON records the hits, always 0);
both sides greedy and forced to the exact output length (Duet ``ignore_eos``; transformers with no EOS); one warm-up
each; one ``LLM`` (``max_num_seqs=64``) and one transformers model reused by every scenario; ``--repeat N`` keeps
each side's best. The machine's bandwidth/matmul rates are measured in the same run (:mod:`duet_bench.machine`).
The scenarios, workloads and Duet's side are in :mod:`duet_bench.engine_workload`. The decode step's memory bound
(uniform1 / uniform32) is quoted for the best round against the bandwidth read at the start, and per round against
a bandwidth read just before that round (``paired_fractions``, median in the table): a shared host's bandwidth
moves by a third between the two.

``--peer-cmd CMD`` runs Duet against any peer engine instead of transformers, on these scenarios' prompts, in
``--rounds`` alternating rounds (:mod:`duet_bench.peer`: the command's contract and the workload file).

``--model qwen3-vl-moe`` runs :mod:`duet_bench.qwen_bench` instead: one-image TTFT and prefill tokens/s of a
Qwen3-VL-MoE checkpoint at ``--image-sizes``, medians of ``--repeat`` alternating rounds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from duet_bench.engine_workload import (
    MAX_NUM_SEQS,
    SCENARIOS,
    ScenarioSpec,
    Workload,
    make_workload,
    run_duet,
    scenario_specs,
    usable_token_ids,
    warm_up_workloads,
)
from duet_bench.machine import decode_bound, measure_machine, measure_read_bandwidth
from duet_bench.peer import PEER_TIMEOUT_S
from duet_bench.qwen_bench import image_sizes
from cluster.report import log, machine_table, scenario_table, write_json

MODELS = ("llava-moe", "qwen3-vl-moe", "qwen3.5-moe")
BENCH_MODEL_NAME = "bench-llava-moe-v1"
BOUND_SCENARIOS = ("uniform1", "uniform32")  # the decode shapes a memory bound is quoted for
PAIRED_READ = {False: (256 << 20, 3), True: (16 << 20, 2)}  # --quick -> (bytes, reps) of each round's bandwidth read


# ------------------------------------------------------------------------------------------------------------ sides
# Duet's side is :func:`duet_bench.engine_workload.run_duet`; transformers' is here.
def load_hf(model_dir: Path, dtype: str, device: str):
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                          attn_implementation="sdpa").to(device).eval()
    gc = model.generation_config
    pad = next((x for x in (gc.pad_token_id, model.config.text_config.pad_token_id) if x is not None), None)
    gc.pad_token_id = pad if pad is not None else 0
    gc.eos_token_id = None  # like ignore_eos: never stop early and never mask EOS, so greedy picks match Duet's
    gc.do_sample = False
    return model


@torch.inference_mode()
def run_hf(model, w: Workload, batch: int) -> tuple[dict, list[list[int]]]:
    """Batches of ``batch`` in submission order, left-padded; each generates its longest requested output."""
    pad, dev = model.generation_config.pad_token_id, model.device
    tokens: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(w.prompts), batch):
        prompts, want = w.prompts[i:i + batch], w.max_tokens[i:i + batch]
        width, n_new = max(map(len, prompts)), max(want)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for j, p in enumerate(prompts):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=n_new,
                             min_new_tokens=n_new, do_sample=False)
        new = out[:, width:].tolist()
        tokens.extend(row[:n] for row, n in zip(new, want, strict=True))
    wall = time.perf_counter() - t0
    useful = sum(len(t) for t in tokens)
    return {"wall_s": wall, "useful_tokens": useful, "tokens_per_s": useful / wall}, tokens


# ------------------------------------------------------------------------------------------------------------ main
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", help=f"checkpoint directory (default: the bench model, built once "
                                                f"into $DUET_HOME/models/{BENCH_MODEL_NAME})")
    p.add_argument("--scenarios", type=_scenarios, default=list(SCENARIOS), help=f"comma list of {','.join(SCENARIOS)}")
    p.add_argument("--model", choices=MODELS, default=MODELS[0],
                   help="bench model family: llava-moe (the scenarios), qwen3-vl-moe (one-image TTFT, "
                        "duet_bench.qwen_bench) or qwen3.5-moe (TTFT / TPOT, KV vs state bytes, "
                        "duet_bench.qwen35_bench)")
    p.add_argument("--repeat", type=_positive, default=None,
                   help="run each measurement N times: llava-moe keeps the best (default 1), qwen3-vl-moe quotes "
                        "the median of N alternating rounds (default 5)")
    p.add_argument("--image-sizes", type=image_sizes, default=None,
                   help="qwen3-vl-moe: comma list of square image sides (default 256,512,1024)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and lengths")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default="bench_out/engine.json", help="where to write the results")
    p.add_argument("--quick", action="store_true", help="tiny smoke configuration (tests), not for figures")
    p.add_argument("--peer-cmd", default=None, metavar="CMD",
                   help="run Duet against this peer engine instead of transformers: called as 'CMD run MODEL_DIR "
                        "WORKLOAD.json' once per round, it prints one JSON object of tok/s per case "
                        "(duet_bench.peer)")
    p.add_argument("--peer-name", default="peer", help="the peer's column name in the table")
    p.add_argument("--rounds", type=_positive, default=3, help="--peer-cmd: alternating rounds (medians quoted)")
    p.add_argument("--peer-timeout", type=float, default=PEER_TIMEOUT_S,
                   help="--peer-cmd: seconds one peer round may take before it is killed")


def _scenarios(text: str) -> list[str]:
    names = [s for s in text.replace(" ", "").split(",") if s]
    bad = [s for s in names if s not in SCENARIOS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown scenario(s) {bad}; choose from {','.join(SCENARIOS)}")
    return [s for s in SCENARIOS if s in names]


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)



def bench_model_dir() -> Path:
    """The default bench checkpoint, built on first use (atomic rename: a concurrent builder just loses its copy)."""
    from cluster.demo import cached_model, duet_home
    from duet_testing.checkpoints import make_bench_checkpoint

    if not (duet_home() / "models" / BENCH_MODEL_NAME / "config.json").is_file():
        log(f"building the bench model into {duet_home() / 'models' / BENCH_MODEL_NAME} (once)")
    return cached_model(BENCH_MODEL_NAME, make_bench_checkpoint)


def _warm_up(llm, hf, token_ids: np.ndarray) -> None:
    """:func:`warm_up_workloads` on each side."""
    for w in warm_up_workloads(token_ids):
        run_duet(llm, w)
        run_hf(hf, w, 2)


def _run_scenario(spec: ScenarioSpec, llm, hf, token_ids: np.ndarray, args: argparse.Namespace) -> dict:
    best_d = best_h = None
    match, paired = [], []
    for r in range(args.repeat):
        w = make_workload(spec, token_ids, args.seed, variant=r)
        read = measure_read_bandwidth(*PAIRED_READ[args.quick], args.device) if spec.name in BOUND_SCENARIOS else None
        d, d_tok = run_duet(llm, w)
        if read is not None:
            paired.append({"read_gbps": read, "tpot_s": d["mean_tpot_s"]})
        log(f"{spec.label} {r + 1}/{args.repeat}: duet {d['wall_s']:.2f} s ({d['tokens_per_s']:.1f} tok/s)")
        h, h_tok = run_hf(hf, w, spec.hf_batch)
        log(f"{spec.label} {r + 1}/{args.repeat}: transformers {h['wall_s']:.2f} s ({h['tokens_per_s']:.1f} tok/s)")
        best_d = d if best_d is None or d["wall_s"] < best_d["wall_s"] else best_d
        best_h = h if best_h is None or h["wall_s"] < best_h["wall_s"] else best_h
        match.append(sum(a == b for a, b in zip(d_tok, h_tok, strict=True)))
    out = {"label": spec.label, "spec": asdict(spec), "useful_tokens": best_d["useful_tokens"], "duet": best_d,
           "hf": best_h, "ratio": best_d["tokens_per_s"] / best_h["tokens_per_s"],
           "requests_matching_hf": min(match)}
    if spec.name == "uniform1":
        out["tokens_match"] = min(match) == spec.num_requests
    if paired:
        out["paired_rounds"] = paired
    return out


def _bounds(model_dir: Path, specs: dict[str, ScenarioSpec], results: dict, rates, llm) -> dict:
    raw = json.loads((model_dir / "config.json").read_text())
    text = raw.get("text_config") or raw
    bounds = {}
    for name in BOUND_SCENARIOS:
        if name in results:
            s = specs[name]
            shape = {"batch": s.num_requests, "context_len": s.prompt_len[0] + s.output_len[0] // 2,
                     "kv_bytes_per_token": llm.engine.runner.kv_bytes_per_token,
                     "dtype_bytes": llm.engine.dtype.itemsize}
            bounds[name] = {"label": s.label} | decode_bound(
                text, rates, **shape, measured_step_s=results[name]["duet"]["mean_tpot_s"])
            rounds = [decode_bound(text, replace(rates, read_gbps=p["read_gbps"]), **shape,
                                   measured_step_s=p["tpot_s"])["fraction_of_bound"]
                      for p in results[name].get("paired_rounds", []) if p["tpot_s"]]
            bounds[name]["paired_fractions"] = rounds  # each round against the bandwidth read just before it
            bounds[name]["paired_fraction_median"] = statistics.median(rounds) if rounds else None
    return bounds


def run(args: argparse.Namespace) -> int:
    from engine import LLM

    if args.model == "qwen3-vl-moe":
        from duet_bench.qwen_bench import run as run_qwen

        return run_qwen(args)
    if args.model == "qwen3.5-moe":
        from duet_bench.qwen35_bench import run_engine

        return run_engine(args)
    model_dir = Path(args.model_dir) if args.model_dir else bench_model_dir()
    if args.peer_cmd:
        from duet_bench.peer import run_side_by_side

        return run_side_by_side(args, model_dir)
    args.repeat = args.repeat or 1
    load_start = os.getloadavg()  # the machine is shared: record how busy it was
    specs = {k: v for k, v in scenario_specs(args.quick).items() if k in args.scenarios}
    log(f"measuring the machine ({torch.get_num_threads()} torch threads)")
    rates = measure_machine(quick=args.quick, device=args.device)
    log(f"loading {model_dir} into Duet and transformers ({args.dtype}, {args.device})")
    llm = LLM(model_dir, dtype=args.dtype, device=args.device, max_num_seqs=MAX_NUM_SEQS)
    hf = load_hf(model_dir, args.dtype, args.device)
    token_ids = usable_token_ids(model_dir)
    _warm_up(llm, hf, token_ids)
    results = {name: _run_scenario(spec, llm, hf, token_ids, args) for name, spec in specs.items()}
    bound = _bounds(model_dir, specs, results, rates, llm)
    cfg = llm.engine.config
    doc = {"model_dir": str(model_dir),
           "config": {"dtype": args.dtype, "device": args.device, "seed": args.seed, "repeat": args.repeat,
                      "quick": args.quick, "scenarios": list(specs),
                      "duet": {"max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                               "block_size": cfg.block_size, "enable_prefix_caching": cfg.enable_prefix_caching,
                               "num_kv_blocks": llm.engine.block_manager.num_blocks},
                      "hf": {"attn_implementation": hf.config.text_config._attn_implementation,
                             "experts_implementation": hf.get_experts_implementation(),
                             "eos": "none (forced exact lengths)"}},
           "machine": rates.to_json(), "scenarios": results, "bound": bound, "torch_threads": torch.get_num_threads(),
           "load_average": {"start": load_start, "end": os.getloadavg()},
           "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    path = write_json(args.json, doc)
    print(scenario_table(results))
    if bound:
        print()
        print(machine_table(doc["machine"], bound))
    log(f"wrote {path}")
    return 0
