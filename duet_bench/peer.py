"""``duet bench engine --peer-cmd CMD``: Duet and a peer engine side by side on the bench's own workload.

The peer is any command the user names (it is never a dependency of Duet, and Duet names no path outside itself).
Contract, once per round::

    DUET_PEER_DTYPE=float32 DUET_PEER_DEVICE=cpu CMD run MODEL_DIR WORKLOAD.json
                                         # stdout, last non-empty line: {"CASE": tokens_per_s, ...}

``WORKLOAD.json`` is ``{"CASE": [[prompt_token_ids, output_tokens], ...], ...}`` with the cases ``uniform1``,
``uniform32``, ``mixed`` (those selected); the peer generates exactly ``output_tokens`` per request (greedy, EOS
ignored) and reports useful output tokens / wall seconds per case -- the definition Duet's side uses
(:func:`duet_bench.engine_workload.run_duet`). The peer runs the dtype and device Duet runs (``--dtype``,
``--device``), named in its environment. Its figures are not taken on trust: Duet times the peer's whole process,
once on a baseline workload (one short request of one token per case: start-up, model load, warm-up) and once per
round; the generation time the figures imply (each case's useful tokens / its tok/s, summed) must fit in the round's
wall time and be at least the round's time beyond the baseline's divided by :data:`PEER_CLOCK_SLACK`, else
:class:`PeerError` (figures that overstate the peer's speed, e.g. measured over part of the work). Both times are
recorded per round. Round ``r`` runs fresh prompts (variant ``r``, so Duet's prefix cache
never hits) on both systems, in alternating order (even rounds Duet first, odd rounds the peer first); the table
quotes medians over rounds and the ratio of the medians. A peer that exits non-zero, prints no valid figures or runs
past ``--peer-timeout`` raises :class:`PeerError` (its whole process group is killed: no hang).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cluster.report import fmt, format_table, log, write_json
from duet_bench.engine_workload import (
    MAX_NUM_SEQS,
    Workload,
    make_workload,
    run_duet,
    scenario_specs,
    usable_token_ids,
    warm_up_workloads,
)
from duet_bench.machine import cpu_description

PEER_TIMEOUT_S = 1800.0
PEER_CLOCK_SLACK = 1.5  # how much faster than Duet's own clock allows a peer's figures may read (start-up noise)


class PeerError(RuntimeError):
    """The peer command failed: could not start, exited non-zero, timed out or printed no valid figures."""


def workload_doc(workloads: Mapping[str, Any]) -> dict[str, list[list]]:
    """The peer's workload file from :class:`~duet_bench.engine_workload.Workload` per case (``prompts``,
    ``max_tokens``)."""
    return {name: [[list(p), int(n)] for p, n in zip(w.prompts, w.max_tokens, strict=True)]
            for name, w in workloads.items()}


def parse_peer_output(stdout: str, cases: list[str]) -> dict[str, float]:
    """Figures from the peer's stdout (its last non-empty line, a JSON object with a positive finite number for
    every case; extra keys are ignored). Raises :class:`PeerError`."""
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise PeerError("peer printed nothing on stdout (expected one JSON object of tok/s per case)")
    try:
        doc = json.loads(lines[-1])
    except json.JSONDecodeError as e:
        raise PeerError(f"peer's last stdout line is not JSON ({e}): {lines[-1][:200]!r}") from None
    if not isinstance(doc, dict):
        raise PeerError(f"peer printed {type(doc).__name__}, expected a JSON object {{case: tok/s}}")
    missing = [c for c in cases if c not in doc]
    if missing:
        raise PeerError(f"peer reported no figure for {missing} (got {sorted(doc)})")
    out = {}
    for c in cases:
        v = doc[c]
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise PeerError(f"peer's figure for {c!r} is {v!r}, expected tokens/s > 0")
        out[c] = float(v)
    return out


def baseline_doc(workloads: Mapping[str, Any]) -> dict[str, list[list]]:
    """The peer's baseline workload: per case one request of the case's first prompt's first 8 tokens and one output
    token (what the peer's process costs beyond the work: start-up, model load, warm-up)."""
    return {name: [[list(w.prompts[0][:8]), 1]] for name, w in workloads.items()}


def check_against_wall(figures: Mapping[str, float], useful_tokens: Mapping[str, int], wall_s: float,
                       baseline_s: float = 0.0) -> float:
    """The seconds the peer's ``figures`` (tok/s per case) imply for its ``useful_tokens``, summed. :class:`PeerError`
    when that exceeds ``wall_s`` (the wall time of its whole process, which also loaded the model), or is less than
    the time the work added to the process (``wall_s - baseline_s``) over :data:`PEER_CLOCK_SLACK`."""
    implied = sum(useful_tokens[c] / v for c, v in figures.items() if c in useful_tokens)
    if implied > wall_s * 1.001:
        raise PeerError(f"peer's figures {dict(figures)} imply {implied:.2f} s of generation, but its whole run took "
                        f"{wall_s:.2f} s: they cannot be tokens / wall seconds of the workload")
    added = wall_s - baseline_s
    if implied * PEER_CLOCK_SLACK < added:
        raise PeerError(f"peer's figures {dict(figures)} imply {implied:.2f} s of generation, but the workload added "
                        f"{added:.2f} s to its run ({wall_s:.2f} s against {baseline_s:.2f} s for the baseline): they "
                        f"overstate its speed by more than {PEER_CLOCK_SLACK:g}x")
    return implied


def run_peer(cmd: str, model_dir: Path, workload: Path, cases: list[str],
             timeout_s: float = PEER_TIMEOUT_S, *, dtype: str = "float32", device: str = "cpu",
             useful_tokens: Mapping[str, int] | None = None, baseline_s: float = 0.0) -> dict[str, float]:
    """``CMD run MODEL_DIR WORKLOAD`` in its own process group, ``DUET_PEER_DTYPE`` / ``DUET_PEER_DEVICE`` in its
    environment; its figures, or :class:`PeerError`. With ``useful_tokens`` (per case) the figures are checked
    against the process's wall time (:func:`check_against_wall`, ``baseline_s``: the baseline run's) and returned
    with ``"_wall_s"`` and ``"_implied_s"`` beside them."""
    argv = [*shlex.split(cmd), "run", str(model_dir), str(workload)]
    env = dict(os.environ, DUET_PEER_DTYPE=dtype, DUET_PEER_DEVICE=device)
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)  # a timeout kills its children too (they hold the pipes)
    except OSError as e:
        raise PeerError(f"cannot start peer command {argv[0]!r}: {e}") from None
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise PeerError(f"peer command timed out after {timeout_s:g} s: {shlex.join(argv)}") from None
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join(err.strip().splitlines()[-20:])
        raise PeerError(f"peer command exited {proc.returncode}: {shlex.join(argv)}\n{tail}")
    figures = parse_peer_output(out, cases)
    if useful_tokens is None:
        return figures
    return {**figures, "_wall_s": wall, "_implied_s": check_against_wall(figures, useful_tokens, wall, baseline_s)}


def alternate(rounds: int, make_workloads: Callable[[int], Mapping[str, Any]],
              duet: Callable[[Mapping[str, Any]], dict[str, float]],
              peer: Callable[[int, Mapping[str, Any]], dict[str, float]]) -> list[dict]:
    """``rounds`` rounds of both systems on round ``r``'s workloads, Duet first in even rounds; one
    ``{"round", "order", "duet", "peer"}`` per round (tok/s per case)."""
    out = []
    for r in range(rounds):
        w = make_workloads(r)
        order = ["duet", "peer"] if r % 2 == 0 else ["peer", "duet"]
        got = {side: (duet(w) if side == "duet" else peer(r, w)) for side in order}
        out.append({"round": r, "order": order, "duet": got["duet"], "peer": got["peer"]})
    return out


def summarize(rounds: list[dict], cases: list[str]) -> dict[str, dict]:
    """Per case: each side's tok/s per round, their medians and ``ratio`` = Duet median / peer median.

    >>> summarize([{"duet": {"a": 10.0}, "peer": {"a": 5.0}}, {"duet": {"a": 30.0}, "peer": {"a": 10.0}},
    ...            {"duet": {"a": 20.0}, "peer": {"a": 8.0}}], ["a"])["a"]["ratio"]
    2.5
    """
    out = {}
    for c in cases:
        d, p = [r["duet"][c] for r in rounds], [r["peer"][c] for r in rounds]
        md, mp = statistics.median(d), statistics.median(p)
        out[c] = {"duet_tokens_per_s": d, "peer_tokens_per_s": p, "duet_median": md, "peer_median": mp,
                  "ratio": md / mp}
    return out


def peer_table(summary: dict[str, dict], labels: Mapping[str, str], peer_name: str) -> str:
    """One row per case: both systems' median tok/s (and range over rounds) and Duet / peer."""
    header = ["workload", "Duet tok/s", f"{peer_name} tok/s", "Duet / peer", "rounds"]
    rows = []
    for c, s in summary.items():
        d, p = s["duet_tokens_per_s"], s["peer_tokens_per_s"]
        rows.append([labels.get(c, c), f"{fmt(s['duet_median'])} ({fmt(min(d))}-{fmt(max(d))})",
                     f"{fmt(s['peer_median'])} ({fmt(min(p))}-{fmt(max(p))})", f"{s['ratio']:.2f}x", str(len(d))])
    return format_table(header, rows)


# ------------------------------------------------------------------------------------------------------------ main
def run_side_by_side(args, model_dir: Path) -> int:
    """The peer mode of ``duet bench engine``: Duet (one ``LLM``, warmed up) against ``args.peer_cmd`` over
    ``args.rounds`` alternating rounds; prints the table, writes ``args.json`` and each round's workload file beside
    it (``<json stem>_workloads/round<r>.json``, to rerun the peer by hand). transformers does not run here."""
    import torch

    from engine import LLM

    specs = {k: v for k, v in scenario_specs(args.quick).items() if k in args.scenarios}
    cases = list(specs)
    log(f"loading {model_dir} into Duet ({args.dtype}, {args.device})")
    llm = LLM(model_dir, dtype=args.dtype, device=args.device, max_num_seqs=MAX_NUM_SEQS)
    token_ids = usable_token_ids(model_dir)
    for w in warm_up_workloads(token_ids):
        run_duet(llm, w)
    out_dir = Path(args.json).with_suffix("")
    wdir = out_dir.parent / f"{out_dir.name}_workloads"
    wdir.mkdir(parents=True, exist_ok=True)

    def duet(ws: Mapping[str, Workload]) -> dict[str, float]:
        got = {c: run_duet(llm, w)[0]["tokens_per_s"] for c, w in ws.items()}
        log("duet: " + ", ".join(f"{c} {v:.1f} tok/s" for c, v in got.items()))
        return got

    peer_times: list[dict[str, float]] = []
    def make(r: int) -> dict[str, Workload]:
        return {c: make_workload(s, token_ids, args.seed, variant=r) for c, s in specs.items()}

    base = {}

    def peer(r: int, ws: Mapping[str, Workload]) -> dict[str, float]:
        if not base:  # once, before the first round's peer run
            path = wdir / "baseline.json"
            path.write_text(json.dumps(baseline_doc(ws)))
            t0 = time.perf_counter()
            run_peer(args.peer_cmd, model_dir, path, cases, args.peer_timeout, dtype=args.dtype, device=args.device)
            base["wall_s"] = time.perf_counter() - t0
            log(f"{args.peer_name}: baseline run (start-up, load, warm-up) {base['wall_s']:.1f} s")
        path = wdir / f"round{r}.json"
        path.write_text(json.dumps(workload_doc(ws)))
        got = run_peer(args.peer_cmd, model_dir, path, cases, args.peer_timeout, dtype=args.dtype,
                       device=args.device, useful_tokens={c: w.useful_tokens for c, w in ws.items()},
                       baseline_s=base["wall_s"])
        peer_times.append({"round": r, "wall_s": got.pop("_wall_s"), "implied_s": got.pop("_implied_s")})
        log(f"{args.peer_name}: " + ", ".join(f"{c} {v:.1f} tok/s" for c, v in got.items())
            + f" (its figures imply {peer_times[-1]['implied_s']:.1f} s of its {peer_times[-1]['wall_s']:.1f} s run)")
        return got

    try:
        rounds = alternate(args.rounds, make, duet, peer)
    except PeerError as e:
        log(f"peer failed: {e}")
        return 1
    summary = summarize(rounds, cases)
    for c, s in summary.items():
        s["label"] = specs[c].label
        s["useful_tokens"] = make_workload(specs[c], token_ids, args.seed).useful_tokens
    doc = {"model_dir": str(model_dir),
           "config": {"dtype": args.dtype, "device": args.device, "seed": args.seed, "quick": args.quick,
                      "scenarios": cases, "rounds": args.rounds, "duet": {"max_num_seqs": MAX_NUM_SEQS}},
           "peer": {"name": args.peer_name, "command": args.peer_cmd, "workloads": str(wdir),
                    "env": {"DUET_PEER_DTYPE": args.dtype, "DUET_PEER_DEVICE": args.device},
                    "baseline_wall_s": base.get("wall_s"), "times": peer_times},
           "rounds": rounds, "side_by_side": summary, "torch_threads": torch.get_num_threads(),
           "cpu": cpu_description(), "duet_kernels": llm.engine.model.linear_kernels,
           "load_average": os.getloadavg(),
           "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    path = write_json(args.json, doc)
    print(peer_table(summary, {c: s.label for c, s in specs.items()}, args.peer_name))
    log(f"wrote {path}")
    return 0
