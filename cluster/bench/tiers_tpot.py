"""Decode TPOT of the real decode worker with tiered expert memory (:mod:`decode_node.expert_tiers`), in process.

One prefill worker (all experts resident) feeds, over the in-process transport, one decode worker per configuration:
all experts resident (the baseline), then each (resident fraction, policy). Requests are admitted as earlier ones
finish, so at most ``max_num_seqs`` are in flight and a request's routing hint reaches the decode worker's policy
when it joins the batch. ``tpot_ms`` is the mean wall time of the decode worker's steps that ran a decode batch (the
time between two tokens of every request in it); prefill steps run on the same thread between decode steps and are
not counted. Configurations run in turn, ``repeats`` times interleaved; each row keeps the median over repeats.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

ALL_RESIDENT = (1.0, "all")


def tpot_configs(resident: tuple[float, ...], policies: tuple[str, ...]) -> list[tuple[float, str]]:
    return [ALL_RESIDENT] + [(r, p) for r in resident for p in policies]


def measure(model_dir: str | Path, prompts: list[Any], *, configs: list[tuple[float, str]], max_num_seqs: int = 4,
            max_tokens: int = 16, repeats: int = 1) -> list[dict]:
    """Rows ``{"section": "tpot", "load": "demo", "resident", "policy", "tpot_ms", "tpot_p50_ms", "tpot_ratio"
    (to all-resident), "decode_steps", "hit_rate", "stalled_loads", "prefetches", "bytes_copied", "stall_ms",
    "tokens_match" (greedy tokens equal the all-resident run's)}``, one per configuration."""
    from engine import EngineConfig, SamplingParams
    from prefill_node.worker import PrefillWorker

    config = EngineConfig(dtype="float32", max_num_seqs=max_num_seqs)
    prefill = PrefillWorker(model_dir, config)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    _run(model_dir, config, prefill, prompts[:2], params, None, max_num_seqs)  # warm-up: allocations, page faults
    runs: dict[tuple[float, str], list[dict]] = {c: [] for c in configs}
    for _ in range(repeats):
        for c in configs:
            runs[c].append(_run(model_dir, config, prefill, prompts, params, None if c == ALL_RESIDENT else c,
                                max_num_seqs))
    base = runs[ALL_RESIDENT]
    base_ms = statistics.median(r["tpot_ms"] for r in base)
    rows = []
    for (resident, policy), rs in runs.items():
        mid = sorted(rs, key=lambda r: r["tpot_ms"])[len(rs) // 2]
        rows.append({"section": "tpot", "load": "demo", "resident": resident, "policy": policy,
                     "max_num_seqs": max_num_seqs, "requests": len(prompts), "repeats": repeats, **mid,
                     "tpot_ratio": mid["tpot_ms"] / base_ms,
                     "tokens_match": all(r["tokens"] == base[0]["tokens"] for r in rs)})
        del rows[-1]["tokens"]
    return rows


def _run(model_dir, config, prefill, prompts: list[Any], params, tier: tuple[float, str] | None,
         max_num_seqs: int) -> dict:
    from decode_node.expert_tiers import TierConfig
    from decode_node.worker import DecodeWorker
    from kv_transfer.inproc.manager import Manager

    pm, dm = Manager(), Manager()
    tiers = None if tier is None else TierConfig(tier[0], tier[1])
    dw = DecodeWorker(model_dir, config, dm, expert_tiers=tiers)
    waiting = list(enumerate(prompts))
    active: set[str] = set()
    tokens: dict[int, list[int]] = {}
    steps: list[float] = []
    try:
        while waiting or active:
            while waiting and len(active) < max_num_seqs:
                i, p = waiting.pop(0)
                lease = dw.allocate(f"t{i}", p, params)
                prefill.submit(f"t{i}", p, params, pm.sender(lease, codec=prefill.codec))
                active.add(f"t{i}")
            if prefill.has_work():
                prefill.step()
            decoding = bool(dw.engine.scheduler.running)
            t0 = time.perf_counter()
            report = dw.step()
            if decoding:
                steps.append(time.perf_counter() - t0)
            if report.failed:
                raise RuntimeError(f"tpot run failed: {report.failed}")
            for out in report.outputs:
                if out.finished:
                    active.discard(out.request_id)
                    tokens[int(out.request_id[1:])] = out.outputs[0].token_ids
            if not decoding and not prefill.has_work() and dw.receivers:
                next(iter(dw.receivers.values())).wait(0.05)
        st = dw.tiers.summary() if dw.tiers is not None else {}
    finally:
        if dw.tiers is not None:
            dw.tiers.close()
        pm.close()
        dm.close()
    return {"tpot_ms": 1e3 * statistics.fmean(steps), "tpot_p50_ms": 1e3 * statistics.median(steps),
            "decode_steps": len(steps), "hit_rate": st.get("hit_rate", 1.0), "stalled_loads": st.get("stalled_loads", 0),
            "prefetches": st.get("prefetches", 0), "bytes_copied": st.get("bytes_copied", 0),
            "stall_ms": 1e3 * st.get("stall_s", 0.0), "tokens": [tokens[i] for i in range(len(prompts))]}
