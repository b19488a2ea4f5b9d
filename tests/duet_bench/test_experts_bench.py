"""``duet bench experts``: a ``--quick`` run through the CLI (rows' structure, criteria computed, the recorded demo
trace), and a rerun on the saved trace. Behaviour only -- never wall-clock speed."""

from __future__ import annotations

import json

import numpy as np

from duet_bench.experts_bench import drifting_loads, zipf_load
from cluster.cli.main import main
from cluster.experts.expert_cache import load_trace

PLACEMENT_KEYS = {"load", "placement", "extra_slots", "workers", "balancedness"}
PREWARM_KEYS = {"load", "resident", "policy", "hit_rate", "stalled_loads", "bytes_copied"}


def test_synthetic_loads():
    load = zipf_load(1.2, 3, 8, seed=0)
    assert load.shape == (3, 8) and all(sorted(row)[::-1][0] == 1000.0 for row in load)
    windows = drifting_loads(1.2, 2, 8, 4, seed=0)
    assert len(windows) == 4 and all(sorted(w[0].tolist()) == sorted(windows[0][0].tolist()) for w in windows)


def test_quick_run_and_rerun_on_the_saved_trace(tmp_path):
    out, trace_path = tmp_path / "experts.json", tmp_path / "demo_trace.json"
    assert main(["bench", "experts", "--quick", "--json", str(out), "--save-trace", str(trace_path)]) == 0
    rows = json.loads(out.read_text())
    assert isinstance(rows, list) and {r["section"] for r in rows} == {"meta", "placement", "migration", "prewarm",
                                                                       "tpot", "criterion"}
    place = [r for r in rows if r["section"] == "placement"]
    assert {r["load"] for r in place} == {"zipf0.8", "zipf1.2", "zipf1.6", "demo"}
    assert {r["placement"] for r in place} == {"static", "greedy", "duet"}
    assert {r["extra_slots"] for r in place} == {0.0, 0.125, 0.25}
    for r in place:
        assert PLACEMENT_KEYS <= r.keys() and 0 < r["balancedness"] <= 1 + 1e-12
    warm = [r for r in rows if r["section"] == "prewarm"]
    assert {(r["load"], r["resident"], r["policy"]) for r in warm} == {
        (load, res, pol) for load in ("zipf1.2", "demo") for res in (0.25, 0.5) for pol in ("lru", "duet", "belady")}
    for r in warm:
        assert PREWARM_KEYS <= r.keys() and 0 <= r["hit_rate"] <= 1 and r["bytes_copied"] > 0
        assert r["stalled_loads"] >= r["forced_stalls"]
        measured = (r["load"], r["scope"]) == ("demo", "global") and r["policy"] != "belady"
        assert (r["tpot_ms"] is not None) == measured  # the real decode worker's TPOT, on the emulated link
    tpot = [r for r in rows if r["section"] == "tpot"]
    assert {(r["link"], r["resident"], r["policy"]) for r in tpot} == {(None, 1.0, "all")} | {
        (link, res, pol) for link in ("memcpy", "emulated") for res in (0.25, 0.5) for pol in ("lru", "duet")}
    for r in tpot:  # the tiered worker decodes the all-resident worker's tokens; behaviour only, never speed
        assert r["tokens_match"] and r["tpot_ms"] > 0 and r["decode_steps"] > 0 and PREWARM_KEYS <= r.keys()
        assert (r["stalled_loads"] == 0) == (r["policy"] == "all") and (r["prefetches"] > 0) == (r["policy"] == "duet")
    mig = [r for r in rows if r["section"] == "migration"]
    assert mig and all(r["migrate_slots_moved"] <= r["scratch_slots_moved_raw"] for r in mig)
    crit = {r["name"]: r for r in rows if r["section"] == "criterion"}
    assert all(isinstance(r["met"], bool) and np.isfinite(r["value"]) for r in crit.values())
    names = " | ".join(crit)
    for part in ("duet balancedness", "duet - greedy", "min balancedness", "slots moved", "zipf1.2 25%: duet / lru",
                 "zipf1.2 50%: duet / belady", "demo 25%: duet / lru", "demo 50%: duet / belady"):
        assert part in names
    assert crit["placement zipf1.2 16x4 +25%: duet balancedness"]["met"]
    assert crit["placement: duet - greedy balancedness (min over inputs)"]["met"]

    trace = load_trace(trace_path)  # the demo model's decode routing, as recorded
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (4, 8, 2) and trace.steps
    for step in trace.steps:
        tokens = step.counts.sum(1)
        assert (tokens == tokens[0]).all() and tokens[0] % 2 == 0 and 0 < tokens[0] <= 2 * 4
    hints = [h for s in trace.steps for _, h in s.arrivals]
    assert hints and all(h.shape == (4, 8) and h.sum() > 0 for h in hints)

    again = tmp_path / "again.json"
    assert main(["bench", "experts", "--quick", "--trace", str(trace_path), "--json", str(again), "--skip-tpot"]) == 0
    demo = {(r["resident"], r["policy"], r["scope"]): r["stalled_loads"] for r in rows
            if r["section"] == "prewarm" and r["load"] == "demo"}
    rerun = {(r["resident"], r["policy"], r["scope"]): r["stalled_loads"] for r in json.loads(again.read_text())
             if r["section"] == "prewarm" and r["load"] == "demo"}
    assert rerun == demo
