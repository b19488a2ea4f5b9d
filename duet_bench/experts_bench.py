"""``duet bench experts``: expert placement and expert pre-warm, on synthetic Zipf loads and on the demo model.

Sections (every row carries ``section``; the JSON file is one list of rows):

* ``placement`` -- per load (``zipf0.8``, ``zipf1.2``, ``zipf1.6``: expected per-layer loads ``1/rank^s`` in a random
  expert order per layer; ``demo``: the demo model's decode routing) and (experts, workers, extra slots):
  balancedness of ``static`` round-robin, ``greedy`` (EPLB-style) and ``duet`` placement, and compute time. Extra
  slot fractions that do not divide over the workers are left out (16 experts + 12.5% = 18 slots on 4 workers).
* ``migration`` -- a drifting Zipf 1.2 load (every window, a few experts per layer move up to 3 ranks): slots
  changed per rebalance placing from scratch (after :func:`cluster.experts.placement.align`, and raw) against
  :func:`cluster.experts.placement.migrate_placement`, and the balancedness each keeps.
* ``prewarm`` -- :func:`cluster.experts.expert_cache.simulate` on Zipf 1.2 traces and on the demo trace, at 25% and 50%
  resident experts, for ``lru``, ``duet`` and ``belady``, with one device pool for all layers (``global``, the
  criteria) and with per-layer pools (``layer``); ``forced_stalls`` is the floor no policy can go under (a layer
  needing more experts in a step than its pool holds). ``tpot_ms``: the demo trace's ``global`` lru/duet rows carry
  the ``tpot`` section's TPOT on the emulated link (the one that models the simulation's link; None elsewhere).
* ``tpot`` -- :func:`measure_tpot`: the real decode worker's TPOT on the demo model with tiered expert memory
  (:mod:`decode_node.expert_tiers`, one device pool for all layers) at 25% and 50% resident, ``lru`` (on demand) and
  ``duet`` (pre-warm), against all experts resident, with plain CPU copies and with an emulated link
  (:mod:`duet_bench.tiers_tpot`); with its hit rate, stalled loads and bytes copied.
* ``criterion`` -- each criterion of the issue: value, threshold, met.

The demo trace is recorded by serving ``--demo-n`` held-out questions on the shipped demo model (batch of at most
``--demo-batch`` sequences): each decode step's per-layer expert choices and, per request, the histogram its prompt's
tokens routed to (the routing hint prefill hands over).
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from pathlib import Path

import numpy as np

from cluster.experts import placement as pl
from cluster.experts.expert_cache import (
    POLICIES,
    Trace,
    TraceStep,
    forced_stalls,
    load_trace,
    make_policy,
    save_trace,
    simulate,
    zipf_trace,
)
from cluster.report import fmt, format_table, write_json

ZIPF = (0.8, 1.2, 1.6)
EXTRA = (0.0, 0.125, 0.25)
RESIDENT = (0.25, 0.5)
SCOPES = ("global", "layer")
DEMO_SEED = 2_000_017  # held-out questions (neither training nor the quality bench's set)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small configuration (tests, smoke runs), not for figures")
    p.add_argument("--json", default="bench_out/experts.json", help="where to write the rows")
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="a recorded routing trace (cluster.experts.expert_cache JSON) to use as the demo load instead of "
                        "recording one")
    p.add_argument("--save-trace", default="bench_out/experts_demo_trace.json", metavar="PATH",
                   help="where to write the recorded demo trace")
    p.add_argument("--skip-demo", action="store_true", help="synthetic loads only")
    p.add_argument("--demo-n", type=int, default=None, help="held-out questions to serve (default 200, quick 24)")
    p.add_argument("--demo-batch", type=int, default=4, help="most sequences in a decode batch while recording")
    p.add_argument("--layers", type=int, default=4, help="MoE layers of the synthetic loads and traces")
    p.add_argument("--link-rate", type=float, default=2.0, help="expert copies per layer-time (pre-warm model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-tpot", action="store_true", help="no decode TPOT measurement (tpot section)")
    p.add_argument("--tpot-n", type=int, default=None, help="demo requests per TPOT run (default 48, quick 6)")
    p.add_argument("--tpot-repeats", type=int, default=None, help="TPOT runs per configuration (default 3, quick 1)")


# -------------------------------------------------------------------------------------------------------- loads
def zipf_load(s: float, layers: int, experts: int, seed: int = 0, tokens: float = 1000.0) -> np.ndarray:
    """``[L, E]`` expected loads ``tokens / rank^s``, ranks in a random order per layer."""
    rng = np.random.default_rng(seed)
    base = tokens / np.arange(1, experts + 1) ** s
    return np.stack([base[rng.permutation(experts)] for _ in range(layers)])


def drifting_loads(s: float, layers: int, experts: int, windows: int, *, seed: int = 0, movers: int = 2,
                   shift: int = 3) -> list[np.ndarray]:
    """Zipf loads whose expert ranking drifts: each window, ``movers`` experts per layer move up to ``shift``
    ranks."""
    rng = np.random.default_rng(seed)
    base = 1000.0 / np.arange(1, experts + 1) ** s
    ranks = [list(rng.permutation(experts)) for _ in range(layers)]
    out = []
    for _ in range(windows):
        load = np.zeros((layers, experts))
        for li, r in enumerate(ranks):
            load[li, r] = base
        out.append(load)
        for r in ranks:
            for _ in range(movers):
                i = int(rng.integers(experts))
                e = r.pop(i)
                r.insert(int(np.clip(i + rng.integers(-shift, shift + 1), 0, experts - 1)), e)
    return out


# --------------------------------------------------------------------------------------------------- placement
def placement_rows(load_name: str, load: np.ndarray, configs: list[tuple[int, int]]) -> list[dict]:
    """static / greedy / duet rows for ``load`` on each (workers, extra-slot fraction) that divides evenly."""
    rows = []
    num_e = load.shape[1]
    for workers in sorted({w for w, _ in configs}):
        for extra in EXTRA:
            slots = num_e * (1 + extra)
            if (workers, extra) not in configs or slots % workers or slots != int(slots):
                continue
            s = int(slots) // workers
            for name in ("static", "greedy", "duet"):
                t0 = time.perf_counter()
                p = (pl.static_placement(num_e, workers, s, load.shape[0]) if name == "static" else
                     pl.greedy_placement(load, workers, s) if name == "greedy" else pl.duet_placement(load, workers, s))
                ms = (time.perf_counter() - t0) * 1e3
                rows.append({"section": "placement", "load": load_name, "placement": name, "experts": num_e,
                             "layers": load.shape[0], "workers": workers, "slots_per_worker": s,
                             "extra_slots": extra, "balancedness": pl.balancedness(load, p), "compute_ms": ms})
    return rows


def migration_row(loads: list[np.ndarray], workers: int, s: int, *, max_moves: int = 4, target: float = 0.9,
                  name: str = "zipf1.2-drift") -> dict:
    """Place each window from scratch (aligned and raw) and by migration from the previous placement."""
    scratch = migrate = pl.duet_placement(loads[0], workers, s)
    raw = aligned = moved = 0
    bal_s, bal_m, ms = [], [], []
    for load in loads[1:]:
        fresh = pl.duet_placement(load, workers, s)
        raw += pl.slots_changed(scratch, fresh)
        fresh = pl.align(fresh, scratch)
        aligned += pl.slots_changed(scratch, fresh)
        scratch = fresh
        bal_s.append(pl.balancedness(load, scratch))
        t0 = time.perf_counter()
        migrate, n = pl.migrate_placement(load, migrate, max_moves=max_moves, target=target)
        ms.append((time.perf_counter() - t0) * 1e3)
        moved += n
        bal_m.append(pl.balancedness(load, migrate))
    rebalances = len(loads) - 1
    return {"section": "migration", "load": name, "experts": loads[0].shape[1], "layers": loads[0].shape[0],
            "workers": workers, "slots_per_worker": s, "windows": rebalances, "max_moves": max_moves,
            "target": target, "scratch_slots_moved": aligned / rebalances, "scratch_slots_moved_raw": raw / rebalances,
            "migrate_slots_moved": moved / rebalances, "moved_ratio": moved / aligned if aligned else 0.0,
            "scratch_balancedness": float(np.mean(bal_s)), "migrate_balancedness": float(np.mean(bal_m)),
            "migrate_balancedness_min": float(np.min(bal_m)), "migrate_ms": float(np.mean(ms))}


# ----------------------------------------------------------------------------------------------------- pre-warm
def measure_tpot(model_dir: Path, n: int, *, repeats: int = 1, link_rate: float = 2.0, max_num_seqs: int = 4,
                 max_tokens: int = 32, seed: int = DEMO_SEED) -> list[dict]:
    """``tpot`` rows: decode TPOT of the real decode worker serving ``n`` held-out demo questions, all experts
    resident and, per link, at each of :data:`RESIDENT` for ``lru`` and ``duet`` (see
    :mod:`duet_bench.tiers_tpot`; ``link_rate``: the emulated link's expert copies per layer-time)."""
    from duet_bench import tiers_tpot
    from duet_bench.quality_bench import prompts_for
    from duet_testing.demo_tasks import make_dataset
    from engine.tokenizer import Tokenizer

    prompts = prompts_for(Tokenizer.from_pretrained(model_dir), make_dataset(seed, n))
    return tiers_tpot.measure(model_dir, prompts, resident=RESIDENT, policies=("lru", "duet"), link_rate=link_rate,
                              max_num_seqs=max_num_seqs, max_tokens=max_tokens, repeats=repeats)


def prewarm_rows(load_name: str, trace: Trace, *, link_rate: float) -> list[dict]:
    rows = []
    for scope in SCOPES:
        for resident in RESIDENT:
            for policy in POLICIES:
                st = simulate(trace, make_policy(policy, trace), resident=resident, scope=scope, link_rate=link_rate)
                rows.append({"section": "prewarm", "load": load_name, "resident": resident, "policy": policy,
                             "scope": scope, "capacity": st.capacity, "link_rate": link_rate, "hit_rate": st.hit_rate,
                             "stalled_loads": st.stalled_loads, "prefetches": st.prefetches,
                             "copies": st.stalled_loads + st.prefetches,
                             "bytes_copied": st.bytes_copied, "steps": len(trace.steps),
                             "forced_stalls": forced_stalls(trace, resident=resident, scope=scope),
                             "tpot_ms": None})
    return rows


def record_demo_trace(model_dir: Path, n: int, *, max_num_seqs: int = 4, max_tokens: int = 16,
                      seed: int = DEMO_SEED) -> Trace:
    """Serve ``n`` held-out demo questions (greedy) and record, per step with decodes, each layer's expert counts
    over the decode tokens; a request's hint is its prompt's expert histogram. Instruments the engine from outside:
    the runner's ``execute`` is wrapped on this one instance and the MoE layers record their routing."""
    import torch

    from duet_bench.quality_bench import prompts_for
    from duet_testing.demo_tasks import make_dataset
    from engine import LLM, EngineHooks, SamplingParams
    from engine.moe import SparseMoe

    torch.manual_seed(0)
    llm = LLM(model_dir, dtype="float32", max_num_seqs=max_num_seqs, hooks=EngineHooks(track_routing=True))
    runner = llm.engine.runner
    moes = [layer.mlp for layer in llm.engine.model.text.layers if isinstance(layer.mlp, SparseMoe)]
    num_e = moes[0].num_experts
    steps: list[TraceStep] = []
    hints: dict[int, np.ndarray] = {}
    prev: set[int] = set()
    execute = runner.execute

    def recording_execute(sched, export=None):
        nonlocal prev
        out = execute(sched, export)
        for s in sched.prefills:
            if s.samples and s.seq.expert_hist is not None:
                hints[s.seq.seq_id] = s.seq.expert_hist.copy()
        if sched.decodes:
            p = sum(s.num_tokens for s in sched.prefills)
            counts = np.stack([np.bincount(m.last_experts[p:].reshape(-1).cpu().numpy(), minlength=num_e)
                               for m in moes])
            cur = {s.seq.seq_id for s in sched.decodes}
            arrive = [(f"r{i}", hints.pop(i, np.zeros((len(moes), num_e), dtype=np.int64))) for i in sorted(cur - prev)]
            steps.append(TraceStep(counts, arrive, [f"r{i}" for i in sorted(prev - cur)]))
            prev = cur
        return out

    runner.execute = recording_execute
    try:
        llm.generate(prompts_for(llm.get_tokenizer(), make_dataset(seed, n)),
                     SamplingParams(temperature=0, max_tokens=max_tokens))
    finally:
        del runner.execute
    m = moes[0]
    gu, down = m.expert_weights()
    nbytes = (gu[0].numel() + down[0].numel()) * gu.element_size()
    return Trace(len(moes), num_e, m.top_k, steps, float(nbytes))


# ------------------------------------------------------------------------------------------------------ criteria
def criteria(rows: list[dict]) -> list[dict]:
    """The issue's criteria as rows (value, threshold, met)."""
    out = []

    def add(name: str, value: float, threshold: float, op: str) -> None:
        met = value >= threshold if op == ">=" else value <= threshold
        out.append({"section": "criterion", "name": name, "value": value, "op": op, "threshold": threshold,
                    "met": bool(met)})

    place = [r for r in rows if r["section"] == "placement"]
    for r in place:
        if (r["load"], r["experts"], r["workers"], r["extra_slots"], r["placement"]) == ("zipf1.2", 16, 4, 0.25, "duet"):
            add("placement zipf1.2 16x4 +25%: duet balancedness", r["balancedness"], 0.98, ">=")
    gaps = [d["balancedness"] - g["balancedness"] for d in place if d["placement"] == "duet" for g in place
            if g["placement"] == "greedy" and all(g[k] == d[k] for k in ("load", "experts", "workers", "extra_slots"))]
    if gaps:
        add("placement: duet - greedy balancedness (min over inputs)", min(gaps), -1e-12, ">=")
    for r in (r for r in rows if r["section"] == "migration"):
        add(f"migration {r['load']} {r['experts']}x{r['workers']}: min balancedness", r["migrate_balancedness_min"],
            0.9, ">=")
        add(f"migration {r['load']} {r['experts']}x{r['workers']}: slots moved / from scratch", r["moved_ratio"],
            0.25, "<=")
    warm = {(r["load"], r["scope"], r["resident"], r["policy"]): r for r in rows if r["section"] == "prewarm"}
    for (load, scope, res, policy), r in warm.items():
        if policy != "duet" or scope != "global":
            continue
        lru, bel = warm[(load, scope, res, "lru")], warm[(load, scope, res, "belady")]
        add(f"prewarm {load} {res:.0%}: duet / lru stalled loads", r["stalled_loads"] / max(1, lru["stalled_loads"]),
            0.5, "<=")
        add(f"prewarm {load} {res:.0%}: duet / belady bytes", r["bytes_copied"] / max(1e-12, bel["bytes_copied"]),
            2.0, "<=")
    return out


# ----------------------------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    quick = args.quick
    rows: list[dict] = [{"section": "meta", "quick": quick, "link_rate": args.link_rate, "layers": args.layers,
                         "seed": args.seed, "timestamp": dt.datetime.now(dt.timezone.utc).isoformat()}]
    sizes = [(16, [(4, 0.0), (4, 0.25), (2, 0.0), (2, 0.125), (2, 0.25)])]
    if not quick:
        sizes.append((64, [(8, x) for x in EXTRA]))
    for s in ZIPF:
        for experts, configs in sizes:
            rows += placement_rows(f"zipf{s}", zipf_load(s, args.layers, experts, args.seed), configs)
    windows = 8 if quick else 25
    for experts, workers, slots in [(16, 4, 5)] + ([] if quick else [(64, 8, 10)]):
        rows.append(migration_row(drifting_loads(1.2, args.layers, experts, windows, seed=args.seed), workers, slots))
    rows += prewarm_rows("zipf1.2", zipf_trace(s=1.2, num_layers=args.layers, steps=120 if quick else 400,
                                               seed=args.seed), link_rate=args.link_rate)
    trace = _demo_trace(args)
    if trace is not None:
        demo = trace.load().astype(np.float64)
        rows += placement_rows("demo", demo, [(2, 0.0), (2, 0.25), (3, 0.125), (4, 0.0)])
        rows += prewarm_rows("demo", trace, link_rate=args.link_rate)
    if not (args.skip_demo or args.skip_tpot):
        from cluster.demo import default_model_dir

        tpot = measure_tpot(default_model_dir(), args.tpot_n or (6 if quick else 48),
                            repeats=args.tpot_repeats or (1 if quick else 3), link_rate=args.link_rate,
                            max_tokens=16 if quick else 32)
        rows += tpot
        measured = {(r["resident"], r["policy"]): r["tpot_ms"] for r in tpot if r["link"] == "emulated"}
        for r in rows:
            if r["section"] == "prewarm" and r["load"] == "demo" and r["scope"] == "global":
                r["tpot_ms"] = measured.get((r["resident"], r["policy"]))
    rows += criteria(rows)
    print(report(rows))
    write_json(Path(args.json), rows)
    return 0


def _demo_trace(args: argparse.Namespace) -> Trace | None:
    if args.trace:
        return load_trace(args.trace)
    if args.skip_demo:
        return None
    from cluster.demo import default_model_dir

    n = args.demo_n or (24 if args.quick else 200)
    trace = record_demo_trace(default_model_dir(), n, max_num_seqs=args.demo_batch)
    if args.save_trace:
        save_trace(trace, args.save_trace)
    return trace


def report(rows: list[dict]) -> str:
    """The printed tables: placement, migration, pre-warm, criteria."""
    parts = []
    place = [r for r in rows if r["section"] == "placement"]
    keys = sorted({(r["load"], r["experts"], r["workers"], r["extra_slots"]) for r in place},
                  key=lambda k: (k[0], k[1], k[2], k[3]))
    table = []
    for k in keys:
        by = {r["placement"]: r for r in place if (r["load"], r["experts"], r["workers"], r["extra_slots"]) == k}
        table.append([k[0], str(k[1]), str(k[2]), f"{k[3]:.1%}", *(fmt(by[n]["balancedness"], 4) for n in by),
                      fmt(by["duet"]["compute_ms"], 1)])
    parts.append(format_table(["load", "experts", "workers", "extra", "static", "greedy", "duet", "duet ms"], table))
    mig = [[r["load"], f"{r['experts']}x{r['workers']}", fmt(r["scratch_slots_moved"], 1),
            fmt(r["scratch_slots_moved_raw"], 1), fmt(r["migrate_slots_moved"], 1), fmt(r["moved_ratio"], 3),
            fmt(r["scratch_balancedness"], 4), fmt(r["migrate_balancedness"], 4), fmt(r["migrate_balancedness_min"], 4)]
           for r in rows if r["section"] == "migration"]
    parts.append(format_table(["drift", "E x W", "scratch/rebal", "raw/rebal", "migrate/rebal", "ratio",
                               "scratch bal", "migrate bal", "migrate min"], mig))
    warm = [[r["load"], r["scope"], f"{r['resident']:.0%}", r["policy"], fmt(r["hit_rate"], 3),
             str(r["stalled_loads"]), str(r["forced_stalls"]), str(r["copies"]), fmt(r["bytes_copied"] / 1e6, 1), fmt(r["tpot_ms"], 2)]
            for r in rows if r["section"] == "prewarm"]
    parts.append(format_table(["trace", "pool", "resident", "policy", "hit rate", "stalled", "forced", "copies", "MB copied",
                               "tpot ms"],
                              warm))
    tpot = [r for r in rows if r["section"] == "tpot"]
    if tpot:
        parts.append(_tpot_table(tpot))
    crit = [[r["name"], fmt(float(r["value"]), 4), f"{r['op']} {r['threshold']}", "yes" if r["met"] else "NO"]
            for r in rows if r["section"] == "criterion"]
    parts.append(format_table(["criterion", "value", "needs", "met"], crit))
    return "\n\n".join(parts)


def _tpot_table(rows: list[dict]) -> str:
    table = [[r["link"] or "-", f"{r['resident']:.0%}", r["policy"], fmt(r["tpot_ms"], 2), fmt(r["tpot_p50_ms"], 2),
              fmt(r["tpot_ratio"], 3), str(r["decode_steps"]), fmt(r["hit_rate"], 3), str(r["stalled_loads"]),
              str(r["prefetches"]), fmt(r["bytes_copied"] / 1e6, 1), fmt(r["stall_ms"], 1),
              "yes" if r["tokens_match"] else "NO"] for r in rows]
    return format_table(["link", "resident", "policy", "tpot ms", "p50 ms", "vs all", "steps", "hit rate", "stalled",
                         "prefetched", "MB copied", "stall ms", "same tokens"], table)
