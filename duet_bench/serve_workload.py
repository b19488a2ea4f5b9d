"""The open-loop workload of ``duet bench serve``, its drivers and its per-system summary.

:func:`make_workload` (pure, seeded): Poisson arrivals at a rate; a request is image-heavy with a given probability
(a demo-task question with its images) or else text-only (demo-corpus sentences); output lengths geometric, capped;
the same seed gives the same prompts, lengths and gaps at every rate. :func:`drive_colocated` /
:func:`drive_disagg`: replay arrivals open-loop on an engine or a cluster and record each request.
:func:`summarise`: TTFT / TPOT percentiles, throughput, goodput and SLO attainment of one system's records at one
rate.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import numpy as np

from cluster.control.timeline import BREAKDOWN, RequestClock
from cluster.report import fmt, format_table, ms


@dataclass(frozen=True)
class Arrival:
    at_s: float  # seconds after the run's start
    prompt: dict
    max_tokens: int
    kind: str  # "text" | "image"

    @property
    def images(self) -> int:
        return len(self.prompt.get("multi_modal_data", {}).get("image", []))


def make_workload(tok, n: int, rate: float, *, seed: int, image_fraction: float, output_mean: float,
                  output_max: int, images: int = 0) -> list[Arrival]:
    """``n`` requests with Poisson arrivals at ``rate`` req/s; the same ``seed`` gives the same prompts, lengths and
    gaps at every rate (only the time scale changes), so rates compare like for like. ``images`` > 0 gives every
    image request that many images (the question's own, repeated), 0 the question's own one or two."""
    from duet_testing.demo_tasks import corpus, make_dataset

    assert n >= 1 and rate > 0 and 0 <= image_fraction <= 1 and output_mean >= 1 and output_max >= 1
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, n)
    is_image = rng.random(n) < image_fraction
    outs = np.minimum(rng.geometric(1.0 / output_mean, n), output_max)
    examples = make_dataset(seed, n)
    sentences, pick = corpus(), random.Random(seed)
    arrivals, t = [], 0.0
    for i in range(n):
        t += float(gaps[i])
        if is_image[i]:
            e = examples[i]
            pics = e.images()
            if images:
                pics = [pics[k % len(pics)] for k in range(images)]
            question = "<image>" * len(pics) + e.question.replace("<image>", "")
            prompt = {"prompt": _chat(tok, question), "multi_modal_data": {"image": pics}}
        else:
            prompt = {"prompt": _chat(tok, " ".join(pick.choice(sentences) for _ in range(pick.randint(2, 8))))}
        arrivals.append(Arrival(t, prompt, int(outs[i]), "image" if is_image[i] else "text"))
    return arrivals


def _chat(tok, content: str) -> str:
    """``content`` as one user turn through the checkpoint's chat template (as is when it has none)."""
    return tok.apply_chat_template([{"role": "user", "content": content}]) or content


def percentiles(xs: list[float]) -> dict:
    """p50/p90/p99 of ``xs`` (``None`` each when empty)."""
    if not xs:
        return {"p50": None, "p90": None, "p99": None}
    return {f"p{q}": float(np.percentile(xs, q)) for q in (50, 90, 99)}


def summarise(records: list[dict], *, ttft_slo: float, tpot_slo: float) -> dict:
    """Latency percentiles, throughput and goodput of one system at one rate. A record: ``ttft_s``, ``tpot_s``
    (``None`` for one-token outputs: they meet any TPOT target), ``tokens``, ``done_s`` (since the run's start) and
    ``error`` (``None`` when it completed)."""
    done = [r for r in records if r["error"] is None]
    wall = max((r["done_s"] for r in done), default=0.0)
    good = [r for r in done if r["ttft_s"] <= ttft_slo and (r["tpot_s"] is None or r["tpot_s"] <= tpot_slo)]
    per_s = lambda x: x / wall if wall > 0 else None
    return {"requests": len(records), "completed": len(done), "wall_s": wall,
            "ttft_s": percentiles([r["ttft_s"] for r in done]),
            "tpot_s": percentiles([r["tpot_s"] for r in done if r["tpot_s"] is not None]),
            "throughput_req_s": per_s(len(done)), "throughput_tok_s": per_s(sum(r["tokens"] for r in done)),
            "goodput_req_s": per_s(len(good)), "slo_attainment": len(good) / len(records) if records else None,
            "ttft_breakdown_p50": breakdown_p50(done)}


def breakdown_p50(records: list[dict]) -> dict[str, float] | None:
    """The median of each TTFT stage over the records that have a ``ttft_breakdown`` (the cluster's; see
    :mod:`cluster.control.timeline`), None when none has. Medians of stages do not add up to the median TTFT."""
    rows = [r["ttft_breakdown"] for r in records if r.get("ttft_breakdown")]
    if not rows:
        return None
    return {k: float(np.median([b.get(k, 0.0) for b in rows])) for k in BREAKDOWN}


def breakdown_table(rows: list[dict]) -> str:
    """Per rate: the disaggregated requests' median TTFT, stage by stage (ms; medians, so they need not add up)."""
    out = []
    for r in rows:
        b = r["disaggregated"].get("ttft_breakdown_p50")
        if b is not None:
            out.append([f"{r['rate']:g}/s", *(fmt(ms(b[k])) for k in BREAKDOWN)])
    heads = [k.removesuffix("_s").replace("_", " ") for k in BREAKDOWN]
    return format_table(["rate", *heads], out)


def sampling_params(a: Arrival):
    from engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)


def drive_colocated(llm, arrivals: list[Arrival], bar) -> list[dict]:
    """Open loop over one engine: add what has arrived, run one step, repeat (sleep when idle)."""
    engine, recs = llm.engine, [None] * len(arrivals)
    t0, i = time.perf_counter(), 0
    while i < len(arrivals) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while i < len(arrivals) and arrivals[i].at_s <= now:
            a = arrivals[i]
            engine.add_request(f"c{i}", a.prompt, sampling_params(a), arrival_time=t0 + a.at_s)
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[i].at_s - now))
            continue
        for out in engine.step():
            if out.finished:
                k, m = int(out.request_id[1:]), out.metrics
                recs[k] = {"kind": arrivals[k].kind, "ttft_s": m.ttft_s, "tpot_s": out.tpot_s(),
                           "tokens": len(out.outputs[0].token_ids), "done_s": m.finished_time - t0, "error": None}
                bar.update(1)
    return recs


async def _one_disagg(cluster, k: int, a: Arrival, t0: float, bar) -> dict:
    await asyncio.sleep(max(0.0, t0 + a.at_s - time.perf_counter()))
    start, first, last, n = t0 + a.at_s, None, None, 0
    clock = RequestClock(arrival=time.monotonic() - (time.perf_counter() - start))  # the scheduled arrival
    kv = None
    try:
        prepared = await asyncio.to_thread(cluster.prepare, a.prompt)
        async for d in cluster.stream(prepared, sampling_params(a), request_id=f"d{k}"):
            clock.observe(d)
            kv = d.kv_transfer or kv
            if d.token_ids:
                last = time.perf_counter()
                first, n = first or last, n + len(d.token_ids)
    except Exception as e:  # noqa: BLE001 -- a failed request is recorded, not fatal to the benchmark
        return {"kind": a.kind, "ttft_s": None, "tpot_s": None, "tokens": n, "done_s": None, "error": repr(e)}
    finally:
        bar.update(1)
    return {"kind": a.kind, "ttft_s": first - start, "tpot_s": (last - first) / (n - 1) if n > 1 else None,
            "tokens": n, "done_s": last - t0, "error": None,
            "ttft_breakdown": clock.timeline(kv)["ttft_breakdown"]}


def drive_disagg(cluster, arrivals: list[Arrival], bar) -> list[dict]:
    """Open loop over the cluster: one asyncio task per request, started at its arrival time."""
    async def go() -> list[dict]:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(_one_disagg(cluster, k, a, t0, bar) for k, a in enumerate(arrivals))))
    return asyncio.run(go())


def prompt_tokens(llm, a: Arrival) -> int:
    return len(llm.engine.inputs.process(a.prompt).token_ids)


class NoBar:
    def update(self, _n: int) -> None:
        pass
