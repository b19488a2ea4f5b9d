"""Decode TPOT of the real decode worker with tiered expert memory (:mod:`decode_node.expert_tiers`), in process.

One prefill worker (all experts resident) feeds, over the in-process transport, one decode worker per configuration:
all experts resident (the baseline), then each (link, resident fraction, policy). Requests are admitted as earlier
ones finish, so at most ``max_num_seqs`` are in flight and a request's routing hint reaches the decode worker's
policy when it joins the batch. Greedy, ``max_tokens`` each with EOS ignored (the demo's answers are a few tokens
long, too short to time a steady batch).

``tpot_ms`` is the mean wall time of the decode worker's steps that ran a decode batch (the time between two tokens
of every request in it); prefill steps run on the same thread between decode steps and are not counted.

Links: ``memcpy`` -- the CPU device's "host to device" copy is a ~20 us memcpy of a demo expert, cheaper than the
bookkeeping around it, and uses the same cores as compute; ``emulated`` -- every copy lasts at least
``1 / link_rate`` of the baseline's layer time (the simulation's link model, :func:`cluster.experts.expert_cache.simulate`),
sleeping so that background copies overlap the decode loop as a GPU's copy engine would: the regime where a stall
costs what it costs on a GPU behind PCIe.

Configurations run in turn, ``repeats`` times interleaved; each row keeps the run with the median TPOT.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple

LINKS = ("memcpy", "emulated")


class _Config(NamedTuple):
    link: str | None  # None: all experts resident, no tiers
    resident: float
    policy: str
    copy_s: float


ALL_RESIDENT = _Config(None, 1.0, "all", 0.0)


def measure(model_dir: str | Path, prompts: list[Any], *, resident: tuple[float, ...], policies: tuple[str, ...],
            link_rate: float = 2.0, max_num_seqs: int = 4, max_tokens: int = 32, repeats: int = 1) -> list[dict]:
    """Rows ``{"section": "tpot", "load": "demo", "link", "copy_ms" (emulated per-copy time), "resident", "policy"
    ("all" for the baseline), "tpot_ms", "tpot_p50_ms", "tpot_ratio" (to all-resident), "decode_steps", "hit_rate",
    "stalled_loads", "prefetches", "bytes_copied", "stall_ms", "tokens_match" (greedy tokens equal the
    all-resident run's)}``."""
    from engine import EngineConfig, SamplingParams
    from prefill_node.worker import PrefillWorker

    config = EngineConfig(dtype="float32", max_num_seqs=max_num_seqs)
    prefill = PrefillWorker(model_dir, config)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run(c: _Config) -> dict:
        return _run(model_dir, config, prefill, prompts, params, c, max_num_seqs)

    run(ALL_RESIDENT)  # warm-up: allocations, page faults
    layer_s = run(ALL_RESIDENT)["tpot_ms"] / 1e3 / sum(prefill.engine.model_config.text.moe_layers)
    copy_s = {"memcpy": 0.0, "emulated": layer_s / link_rate}
    configs = [ALL_RESIDENT] + [_Config(link, r, p, copy_s[link]) for link in LINKS for r in resident
                                for p in policies]
    runs: dict[_Config, list[dict]] = {c: [] for c in configs}
    for _ in range(repeats):
        for c in configs:
            runs[c].append(run(c))
    base = runs[ALL_RESIDENT]
    base_ms = _median_run(base)["tpot_ms"]
    rows = []
    for c, rs in runs.items():
        mid = dict(_median_run(rs))
        match = all(r["tokens"] == base[0]["tokens"] for r in rs)
        del mid["tokens"]
        rows.append({"section": "tpot", "load": "demo", "link": c.link, "copy_ms": c.copy_s * 1e3 if c.link else None,
                     "resident": c.resident, "policy": c.policy, "max_num_seqs": max_num_seqs, "requests": len(prompts),
                     "max_tokens": max_tokens, "repeats": repeats, **mid, "tpot_ratio": mid["tpot_ms"] / base_ms,
                     "tokens_match": match})
    return rows


def _median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["tpot_ms"])[(len(runs) - 1) // 2]


def _run(model_dir, config, prefill, prompts: list[Any], params, c: _Config, max_num_seqs: int) -> dict:
    from decode_node.expert_tiers import TierConfig
    from decode_node.worker import DecodeWorker
    from kv_transfer.inproc.manager import Manager

    pm, dm = Manager(), Manager()
    tiers = None if c.link is None else TierConfig(c.resident, c.policy, copy_s=c.copy_s)
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
            decoding = bool(dw.engine.scheduler.running or dw.engine.scheduler.prefilled)
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
            "decode_steps": len(steps), "hit_rate": st.get("hit_rate", 1.0),
            "stalled_loads": st.get("stalled_loads", 0), "prefetches": st.get("prefetches", 0),
            "bytes_copied": st.get("bytes_copied", 0),
            "stall_ms": 1e3 * st.get("stall_s", 0.0), "tokens": [tokens[i] for i in range(len(prompts))]}
