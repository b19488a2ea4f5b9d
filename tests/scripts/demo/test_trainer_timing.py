"""scripts.demo.trainer_timing: step times from the logs, alternation, the whole runs' ratio (trainers stood in)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import scripts.demo.trainer_timing as timing


def _write_log(out: Path, per_step: float, steps: int) -> None:
    out.mkdir(parents=True)
    logged = [*range(0, steps, 20), steps - 1]
    rows = [{"seed": 0, "steps": steps}] + [{"step": s, "elapsed_s": 3.0 + s * per_step} for s in logged]
    (out / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_step_time_leaves_out_the_start(tmp_path):
    _write_log(tmp_path / "a", 0.25, 100)
    assert timing.step_time(tmp_path / "a") == pytest.approx(0.25)
    _write_log(tmp_path / "b", 0.25, 21)  # step 20 is the last one logged
    with pytest.raises(ValueError, match="too few steps"):
        timing.step_time(tmp_path / "b")


def test_rounds_alternate_and_the_ratio_uses_each_run_length(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_run(cmd, check, stdout, stderr):
        module, out, steps = cmd[2], Path(cmd[3]), int(cmd[5])
        calls.append((module, cmd[6:]))
        _write_log(out, 0.2 if module.endswith("train_llava") else 0.5, steps)

    monkeypatch.setattr(timing.subprocess, "run", fake_run)
    report = tmp_path / "t.json"
    assert timing.main(["--steps", "60", "--rounds", "3", "--json", str(report), "--", "--steps", "2000",
                        "--optimizer", "muon"]) == 0
    assert [m.rsplit(".", 1)[1] for m, _ in calls] == ["train_llava", "train", "train", "train_llava", "train_llava",
                                                       "train"]
    assert all(args == (["--optimizer", "muon"] if m.endswith(".train") else []) for m, args in calls)
    got = json.loads(report.read_text())
    assert got["run_steps"] == {"llava": 5000, "demo": 2000}
    assert got["whole_run_s"]["llava"] == pytest.approx(1000) and got["whole_run_s"]["demo"] == pytest.approx(1000)
    assert got["ratio"] == pytest.approx(1.0) and "1.00x" in capsys.readouterr().out


def test_too_few_steps_is_refused():
    with pytest.raises(SystemExit):
        timing.main(["--steps", "30"])
