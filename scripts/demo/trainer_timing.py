"""Time the demo trainer against the LLaVA fixture's, alternating, on this host and hour:
``python -m scripts.demo.trainer_timing [--steps 140] [--rounds 4] [--json F] [-- TRAIN_ARGS...]``.

Each round runs both trainers for ``--steps`` steps (the order alternates between rounds) and reads the time a step
took from each run's ``train_log.jsonl`` (steps 20 to the last, so start-up and the first steps are left out). The
whole runs' times follow from the medians and each trainer's default length (the shipped runs'): the ratio says
whether the demo trains in the time the LLaVA demo took, free of how fast the shared host runs that hour. Arguments
after ``--`` go to ``scripts.demo.train`` (default: its shipped run's)."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.demo.train import SHIPPED_RUN

LLAVA_STEPS = 5000  # scripts.demo.train_llava's default run (the fixture's)
FIRST_TIMED_STEP = 20


def step_time(out: Path) -> float:
    """Seconds a step took from step 20 to the last logged one."""
    lines = (out / "train_log.jsonl").read_text().splitlines()
    log = [json.loads(line) for line in lines[1:]]
    a = next(r for r in log if r["step"] == FIRST_TIMED_STEP)
    b = log[-1]
    if b["step"] <= a["step"]:
        raise ValueError(f"too few steps logged in {out} to time (need more than {FIRST_TIMED_STEP})")
    return (b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(prog="python -m scripts.demo.trainer_timing", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=140)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.steps <= FIRST_TIMED_STEP + 20 or a.rounds < 1:
        p.error(f"--steps must exceed {FIRST_TIMED_STEP + 20} and --rounds be at least 1")
    length = argparse.ArgumentParser(add_help=False)  # the demo run's own length, if the trainer's args give one
    length.add_argument("--steps", type=int, default=SHIPPED_RUN["steps"])
    known, extra = length.parse_known_args(extra)
    demo_steps = known.steps
    runs = {"llava": ("scripts.demo.train_llava", []), "demo": ("scripts.demo.train", extra)}
    per_step: dict[str, list[float]] = {k: [] for k in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                module, args = runs[name]
                out = Path(tmp) / name
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", module, str(out), "--steps", str(a.steps), *args], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                per_step[name].append(step_time(out))
                print(f"round {r} {name}: {per_step[name][-1]:.4f} s/step ({time.perf_counter() - t0:.1f} s wall)",
                      flush=True)
    med = {k: statistics.median(v) for k, v in per_step.items()}
    whole = {"llava": med["llava"] * LLAVA_STEPS, "demo": med["demo"] * demo_steps}
    pairs = [d * demo_steps / (ll * LLAVA_STEPS) for d, ll in zip(per_step["demo"], per_step["llava"], strict=True)]
    result = {"steps_timed": a.steps, "rounds": a.rounds, "demo_args": extra, "per_step_s": per_step,
              "median_s": med, "run_steps": {"llava": LLAVA_STEPS, "demo": demo_steps}, "whole_run_s": whole,
              "ratio": whole["demo"] / whole["llava"], "ratio_per_round": pairs}
    print(f"{'trainer':<8} {'s/step p50':>10} {'run steps':>9} {'whole run s':>11}")
    for k in runs:
        print(f"{k:<8} {med[k]:>10.4f} {result['run_steps'][k]:>9} {whole[k]:>11.0f}")
    print(f"demo / llava: {result['ratio']:.2f}x (per round {min(pairs):.2f}-{max(pairs):.2f}x)")
    if a.json is not None:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
