"""The engine bench's workloads and its Duet side, shared by every mode of ``duet bench engine``.

:mod:`duet_bench.engine_bench` (Duet against transformers), :mod:`duet_bench.peer` (against a peer command),
:mod:`duet_bench.qwen_bench` (random text ids) and :mod:`duet_bench.transfer_bench` import from here; this module
imports no other bench, so the arrows point one way.

Scenarios: ``uniform1`` / ``uniform32`` (1 / 32 prompts of 128 random tokens, 64 new tokens each) and ``mixed`` (64
requests, prompt lengths uniform in [16, 512], output lengths uniform in [8, 128]); ``quick`` shrinks every size.
Prompts are random ids from the text vocabulary minus special and image ids, fresh per ``variant`` so that no
prompt ever hits the engine's prefix cache.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SCENARIOS = ("uniform1", "uniform32", "mixed")
MAX_NUM_SEQS = 64


@dataclass(frozen=True)
class ScenarioSpec:
    """One workload shape; length ranges are inclusive. ``hf_batch``: transformers' batch size."""

    name: str
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    hf_batch: int

    @property
    def label(self) -> str:
        return "mixed" if self.name == "mixed" else f"uniform-{self.num_requests}"


def scenario_specs(quick: bool) -> dict[str, ScenarioSpec]:
    if quick:
        return {"uniform1": ScenarioSpec("uniform1", 1, (16, 16), (4, 4), 1),
                "uniform32": ScenarioSpec("uniform32", 2, (16, 16), (4, 4), 2),
                "mixed": ScenarioSpec("mixed", 4, (8, 32), (2, 8), 2)}
    return {"uniform1": ScenarioSpec("uniform1", 1, (128, 128), (64, 64), 1),
            "uniform32": ScenarioSpec("uniform32", 32, (128, 128), (64, 64), 32),
            "mixed": ScenarioSpec("mixed", 64, (16, 512), (8, 128), 32)}


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.max_tokens)


def usable_token_ids(model_dir: Path) -> np.ndarray:
    """Text-vocabulary ids minus the image token and every special id (generation config, config, tokenizer)."""
    raw = json.loads((model_dir / "config.json").read_text())
    text = raw.get("text_config") or raw
    special = {raw.get("image_token_index", raw.get("image_token_id"))}
    gen_file = model_dir / "generation_config.json"
    for src in (raw, text, json.loads(gen_file.read_text()) if gen_file.is_file() else {}):
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
            v = src.get(key)
            special.update(v if isinstance(v, list) else [v])
    tok_file = model_dir / "tokenizer.json"
    if tok_file.is_file():
        special.update(t["id"] for t in json.loads(tok_file.read_text()).get("added_tokens", []) if t.get("special"))
    ids = np.setdiff1d(np.arange(int(text["vocab_size"])), [s for s in special if s is not None])
    assert len(ids) > 0, "no usable token ids"
    return ids


def make_workload(spec: ScenarioSpec, token_ids: np.ndarray, seed: int, variant: int = 0) -> Workload:
    """Deterministic: lengths depend on (seed, scenario) only; token ids also on ``variant`` (the repeat index)."""
    salt = SCENARIOS.index(spec.name)
    lengths = np.random.default_rng([seed, salt])
    plen = lengths.integers(spec.prompt_len[0], spec.prompt_len[1] + 1, spec.num_requests)
    olen = lengths.integers(spec.output_len[0], spec.output_len[1] + 1, spec.num_requests)
    ids = np.random.default_rng([seed, salt, variant + 1])
    prompts = [token_ids[ids.integers(0, len(token_ids), int(n))].tolist() for n in plen]
    return Workload(prompts, [int(n) for n in olen])


def warm_up_workloads(token_ids: np.ndarray) -> tuple[Workload, Workload]:
    """A single request and a padded pair, each prompt shorter than a KV block (so nothing is cached)."""
    return (Workload([token_ids[:8].tolist()], [2]),
            Workload([token_ids[8:16].tolist(), token_ids[16:22].tolist()], [2, 3]))


def run_duet(llm, w: Workload) -> tuple[dict, list[list[int]]]:
    """Submit every request at once; wall time covers prefill and decode of all of them."""
    from engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in w.max_tokens]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in w.prompts], params)
    wall = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outs]
    useful = sum(min(len(t), n) for t, n in zip(tokens, w.max_tokens, strict=True))
    ttft = [o.metrics.ttft_s for o in outs if o.metrics.ttft_s is not None]
    tpot = [x for x in (o.tpot_s() for o in outs) if x is not None]
    return {"wall_s": wall, "useful_tokens": useful, "tokens_per_s": useful / wall,
            "mean_ttft_s": float(np.mean(ttft)) if ttft else None,
            "mean_tpot_s": float(np.mean(tpot)) if tpot else None,
            "prefix_cache_hit_tokens": sum(o.num_cached_tokens for o in outs),
            "preemptions": sum(o.metrics.num_preemptions for o in outs)}, tokens
