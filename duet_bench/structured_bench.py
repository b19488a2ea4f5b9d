"""``duet bench structured [MODEL_DIR]``: the per-token cost of structured outputs against free generation, same run.

Two measurements, each in alternating rounds (free, constrained, mixed, then the next round in another order),
medians reported:

* **end to end** -- the in-process :class:`engine.LLM` generating ``--batch`` requests of exactly ``--tokens``
  tokens each (EOS ignored, sampled at temperature 1.0, seeded), free against every row under a JSON Schema
  (``json_schema``) and half the rows under it (``mixed``: rows with and without a grammar in one batch). Reported:
  microseconds per generated token, the ratio to free, the overhead in microseconds per constrained token, and the
  fraction of tokens sampled while the grammar was still open (the schema asks for at least 60 objects, so it stays
  open for the whole run: after a grammar completes the mask allows only EOS, a cheaper mask). Run on ``MODEL_DIR`` (default: the demo model) and on a random tiny checkpoint with a
  ``--vocab``-token byte-level BPE vocabulary, where the model is cheap and the mask's share is the largest;
* **mask only** -- :meth:`engine.grammar.GrammarProcessor.apply_batch` on ``[batch, V]`` logits while the rows walk
  through the first ``--mask-tokens`` tokens of a valid document, against the sampler's own per-row work on the same logits (softmax +
  draw), for the same two vocabularies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cluster.report import fmt, format_table, log, write_json

SCHEMA = {"type": "array", "minItems": 60, "items": {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 9999}, "name": {"type": "string", "pattern": "^[a-z ]{1,12}$"},
    "ok": {"type": "boolean"}, "kind": {"enum": ["circle", "square", "triangle"]}},
    "required": ["id", "name", "ok", "kind"], "additionalProperties": False}}
DOC = [{"id": i * 37 % 9999, "name": "red shape" if i % 2 else "blue", "ok": i % 3 == 0,
        "kind": ["circle", "square", "triangle"][i % 3]} for i in range(60)]
MODES = ("free", "json_schema", "mixed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", nargs="?", help="checkpoint directory (default: the shipped demo model)")
    p.add_argument("--batch", type=int, default=8, help="requests per batch (default 8)")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--vocab", type=int, default=32000, help="the tiny checkpoint's vocabulary (0: skip it)")
    p.add_argument("--mask-tokens", type=int, default=256, help="mask only: document tokens walked (default 256)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", default="bench_out/structured.json", help="where to write the results")


def _params(mode: str, batch: int, tokens: int, seed: int):
    from engine import SamplingParams
    from engine.grammar_spec import StructuredOutputsParams

    spec = StructuredOutputsParams(json=SCHEMA)
    return [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=tokens, ignore_eos=True,
                           structured_outputs=spec if mode == "json_schema" or (mode == "mixed" and i % 2) else None)
            for i in range(batch)]


def _end_to_end(model_dir: Path, args: argparse.Namespace) -> dict:
    from engine import LLM

    llm = LLM(model_dir, dtype="float32", max_num_seqs=max(8, args.batch), max_model_len=args.tokens + 64,
              num_kv_blocks=(args.batch + 1) * ((args.tokens + 64) // 16 + 2), block_size=16)
    prompt = {"prompt_token_ids": llm.engine.tokenizer.encode("Describe the shapes as JSON:")}
    eos = set(llm.engine.eos_token_ids)
    llm.generate([prompt] * args.batch, _params("json_schema", args.batch, 4, 0))  # warm-up (tokenizer index)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    live: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % 3:] + MODES[: r % 3]:
            params = _params(mode, args.batch, args.tokens, 1000 * r)
            t0 = time.perf_counter()
            outs = llm.generate([prompt] * args.batch, params)
            times[mode].append(time.perf_counter() - t0)
            constrained = [o.outputs[0].token_ids for o, p in zip(outs, params) if p.structured_outputs]
            open_ = [next((k for k, t in enumerate(ids) if t in eos), len(ids)) for ids in constrained]
            live[mode].append(sum(open_) / max(1, sum(len(ids) for ids in constrained)))
    n = args.batch * args.tokens
    free = statistics.median(times["free"]) / n
    out = {}
    for mode in MODES:
        per = statistics.median(times[mode]) / n
        share = (1.0 if mode == "json_schema" else 0.5) if mode != "free" else 0.0
        out[mode] = {"us_per_token": per * 1e6, "ratio": per / free,
                     "overhead_us_per_constrained_token": (per - free) * 1e6 / share if share else 0.0,
                     "grammar_open_fraction": statistics.median(live[mode]) if share else None,
                     "rounds_s": times[mode]}
    return out


def _mask_only(tokenizer, vocab: int, eos: list[int], args: argparse.Namespace) -> dict:
    from engine.grammar import GrammarFactory, GrammarProcessor
    from engine.grammar_spec import StructuredOutputsParams
    from engine.sampling_params import SamplingParams

    doc = tokenizer.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False)[:args.mask_tokens]
    factory = GrammarFactory(tokenizer, vocab, eos)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    logits = torch.randn(args.batch, vocab)
    gen = torch.Generator().manual_seed(0)
    mask_s, sample_s = [], []
    for _ in range(args.rounds):
        procs = [factory(params) for _ in range(args.batch)]
        t_mask = t_sample = 0.0
        for tok in doc:
            x = logits.clone()
            t0 = time.perf_counter()
            GrammarProcessor.apply_batch(x, list(range(args.batch)), procs)
            t1 = time.perf_counter()
            for row in logits:
                torch.multinomial(torch.softmax(row, dim=-1), 1, generator=gen)
            t2 = time.perf_counter()
            for p in procs:
                p.accept(tok)
            t_mask, t_sample = t_mask + t1 - t0, t_sample + t2 - t1
        steps = len(doc) * args.batch
        mask_s.append(t_mask / steps)
        sample_s.append(t_sample / steps)
    m, s = statistics.median(mask_s), statistics.median(sample_s)
    return {"vocab": vocab, "doc_tokens": len(doc), "mask_us_per_row": m * 1e6, "sample_us_per_row": s * 1e6,
            "mask_over_sample": m / s}


def run(args: argparse.Namespace) -> int:
    from cluster.demo import default_model_dir
    from duet_testing.checkpoints import TinySpec, make_tiny_checkpoint
    from engine.llm_engine import LLMEngine  # noqa: F401 - fail early if the engine is broken
    from engine.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    models = {"model": Path(args.model_dir or default_model_dir())}
    tmp = tempfile.TemporaryDirectory(prefix="duet-structured-")
    if args.vocab:
        log(f"building a tiny checkpoint with a {args.vocab}-token vocabulary")
        models[f"tiny-v{args.vocab}"] = make_tiny_checkpoint(Path(tmp.name) / "ckpt", TinySpec(vocab_size=args.vocab))
    result: dict = {"batch": args.batch, "tokens": args.tokens, "rounds": args.rounds, "threads": args.threads,
                    "schema": SCHEMA, "models": {}}
    for name, path in models.items():
        log(f"{name}: end to end")
        e2e = _end_to_end(path, args)
        tok = Tokenizer.from_pretrained(path)
        from engine.config import ModelConfig

        cfg = ModelConfig.from_pretrained(path)
        log(f"{name}: mask only")
        mask = _mask_only(tok, cfg.text.vocab_size, list(cfg.eos_token_ids) or tok.eos_token_ids, args)
        result["models"][name] = {"path": str(path), "vocab": cfg.text.vocab_size, "end_to_end": e2e, "mask": mask}
    tmp.cleanup()
    print(table(result))
    print(f"\nwrote {write_json(args.json, result)}")
    return 0


def table(result: dict) -> str:
    rows = []
    for name, m in result["models"].items():
        for mode, e in m["end_to_end"].items():
            rows.append([f"{name} (V={m['vocab']})", mode, fmt(e["us_per_token"]), fmt(e["ratio"], 3),
                         fmt(e["overhead_us_per_constrained_token"]), fmt(e["grammar_open_fraction"], 2)])
    e2e = format_table(["model", "mode", "us/token", "vs free", "overhead us/constrained token", "grammar open"],
                       rows)
    mask = format_table(["model", "vocab", "mask us/row", "sample us/row", "mask/sample"],
                        [[name, str(m["vocab"]), fmt(m["mask"]["mask_us_per_row"]),
                          fmt(m["mask"]["sample_us_per_row"]), fmt(m["mask"]["mask_over_sample"], 2)]
                         for name, m in result["models"].items()])
    return (f"structured outputs vs free generation: batch {result['batch']}, {result['tokens']} tokens, "
            f"{result['rounds']} alternating rounds, medians\n{e2e}\n\nmask only (apply_batch per row per step, "
            f"vs the sampler's softmax + draw)\n{mask}")
