"""``duet bench engine --peer-cmd``: a fake peer (a tiny script written here) gets the bench's own workload in the
peer's file format, rounds alternate, the table and JSON hold both systems; a failing, garbage-printing or hanging
peer is a clear error. Behaviour only -- never wall-clock speed."""

from __future__ import annotations

import json
import shlex
import sys
import textwrap
import time

import pytest

from duet_bench.engine_workload import make_workload, scenario_specs, usable_token_ids
from duet_bench.peer import PeerError, alternate, check_against_wall, parse_peer_output, run_peer, summarize
from cluster.cli.main import main
from duet_testing.checkpoints import TinySpec, make_tiny_checkpoint

CASES = ["uniform1", "uniform32", "mixed"]

# Checks the workload file as vllm-peer reads it, logs each call (and the dtype / device it was given), spends 2 ms
# per useful token and prints 500 tok/s per case; "liar" spends the same time and prints 20x that.
FAKE_PEER = textwrap.dedent("""
    import json, os, sys, time
    mode = os.environ.get("FAKE_PEER_MODE", "ok")
    cmd, model_dir, workload = sys.argv[1:4]
    assert cmd == "run" and os.path.isfile(os.path.join(model_dir, "config.json"))
    cases = json.load(open(workload))
    for reqs in cases.values():
        for prompt, n in reqs:
            assert all(isinstance(t, int) for t in prompt) and isinstance(n, int) and n > 0
    with open(os.environ["FAKE_PEER_LOG"], "a") as f:
        f.write(json.dumps({"t": time.time(), "workload": workload, "dtype": os.environ.get("DUET_PEER_DTYPE"),
                            "device": os.environ.get("DUET_PEER_DEVICE")}) + "\\n")
    if mode == "fail":
        print("peer exploded: CUDA is not a CPU", file=sys.stderr); sys.exit(3)
    if mode == "garbage":
        print("hello, not json"); sys.exit(0)
    if mode == "hang":
        time.sleep(60)
    print("loading model ...")
    figures = {}
    for name, reqs in cases.items():
        useful = sum(n for _, n in reqs)
        time.sleep(0.002 * useful)  # 500 tok/s
        figures[name] = useful / 0.002 / useful * (20 if mode == "liar" else 1)
    print(json.dumps(figures))
""")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bench") / "m", TinySpec(vocab_size=256))


@pytest.fixture
def peer_cmd(tmp_path, monkeypatch):
    script = tmp_path / "fake_peer.py"
    script.write_text(FAKE_PEER)
    monkeypatch.setenv("FAKE_PEER_LOG", str(tmp_path / "calls.jsonl"))
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}"


def _calls(tmp_path) -> list[dict]:
    return [json.loads(ln) for ln in (tmp_path / "calls.jsonl").read_text().splitlines()]


def test_side_by_side_end_to_end(tiny_dir, peer_cmd, tmp_path, capsys):
    out = tmp_path / "engine.json"
    assert main(["bench", "engine", str(tiny_dir), "--quick", "--peer-cmd", peer_cmd, "--peer-name", "fake",
                 "--rounds", "3", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["rounds"] == 3 and doc["peer"]["command"] == peer_cmd
    assert [r["order"] for r in doc["rounds"]] == [["duet", "peer"], ["peer", "duet"], ["duet", "peer"]]
    specs, token_ids = scenario_specs(quick=True), usable_token_ids(tiny_dir)
    calls = _calls(tmp_path)
    assert len(calls) == 4  # the baseline (one short one-token request per case), then a run per round
    baseline, calls = json.loads(open(calls[0]["workload"]).read()), calls[1:]
    assert list(baseline) == CASES and all(len(v) == 1 and v[0][1] == 1 and len(v[0][0]) <= 8
                                           for v in baseline.values())
    for r, call in enumerate(calls):  # the workload file: the bench's own prompts of round r, in vllm-peer's format
        sent = json.loads(open(call["workload"]).read())
        assert list(sent) == CASES
        for c in CASES:
            w = make_workload(specs[c], token_ids, 0, variant=r)
            assert sent[c] == [[p, n] for p, n in zip(w.prompts, w.max_tokens, strict=True)]
    assert calls[0]["workload"] != calls[1]["workload"]  # fresh prompts every round
    assert all(call["dtype"] == "float32" and call["device"] == "cpu" for call in calls)
    assert doc["peer"]["env"] == {"DUET_PEER_DTYPE": "float32", "DUET_PEER_DEVICE": "cpu"}
    assert doc["peer"]["baseline_wall_s"] > 0
    for t in doc["peer"]["times"]:  # the figures' implied time fits in the process's wall time
        assert 0 < t["implied_s"] <= t["wall_s"]
    assert list(doc["side_by_side"]) == CASES
    for c, s in doc["side_by_side"].items():
        assert len(s["duet_tokens_per_s"]) == len(s["peer_tokens_per_s"]) == 3
        assert s["peer_median"] == pytest.approx(500)
        assert s["ratio"] == pytest.approx(s["duet_median"] / s["peer_median"]) and s["duet_median"] > 0
        assert [r["peer"][c] for r in doc["rounds"]] == s["peer_tokens_per_s"]
    table = capsys.readouterr().out
    assert "Duet tok/s" in table and "fake tok/s" in table and "Duet / peer" in table
    assert all(label in table for label in ("uniform-1", "uniform-2", "mixed"))  # quick: uniform32 is 2 requests


def test_alternation_order_and_medians():
    seen = []

    def duet(w):
        seen.append(("duet", w["r"]))
        return {"a": 10.0 * (w["r"] + 1)}

    def peer(r, w):
        seen.append(("peer", r))
        return {"a": 5.0}

    rounds = alternate(4, lambda r: {"r": r}, duet, peer)
    assert seen == [("duet", 0), ("peer", 0), ("peer", 1), ("duet", 1), ("duet", 2), ("peer", 2), ("peer", 3),
                    ("duet", 3)]
    s = summarize(rounds, ["a"])["a"]
    assert s["duet_median"] == 25.0 and s["peer_median"] == 5.0 and s["ratio"] == 5.0


@pytest.mark.parametrize("stdout, why", [
    ("", "printed nothing"),
    ("hello\n", "not JSON"),
    ("[1, 2]\n", "expected a JSON object"),
    ('{"uniform1": 3.0}\n', "no figure for"),
    ('{"uniform1": 3, "uniform32": "fast", "mixed": 1}\n', "'uniform32' is 'fast'"),
    ('{"uniform1": 3, "uniform32": 0, "mixed": 1}\n', "'uniform32' is 0"),
    ('{"uniform1": 3, "uniform32": NaN, "mixed": 1}\n', "'uniform32' is nan"),
], ids=["empty", "text", "list", "missing", "string", "zero", "nan"])
def test_bad_peer_output_is_a_clear_error(stdout, why):
    with pytest.raises(PeerError, match=why):
        parse_peer_output(stdout, CASES)


def test_log_lines_before_the_figures_are_ignored():
    assert parse_peer_output('loading\n{"uniform1": 2, "uniform32": 3.5, "mixed": 1, "extra": 9}\n\n', CASES) == \
        {"uniform1": 2.0, "uniform32": 3.5, "mixed": 1.0}


@pytest.mark.parametrize("mode, why", [("fail", "(?s)exited 3.*CUDA is not a CPU"), ("garbage", "not JSON")])
def test_failing_peer_is_a_clear_error(tiny_dir, peer_cmd, tmp_path, monkeypatch, mode, why):
    monkeypatch.setenv("FAKE_PEER_MODE", mode)
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({c: [[[1, 2, 3], 2]] for c in CASES}))
    with pytest.raises(PeerError, match=why):
        run_peer(peer_cmd, tiny_dir, workload, CASES, timeout_s=60)


def test_a_peer_that_overstates_its_speed_is_refused(tiny_dir, peer_cmd, tmp_path, monkeypatch):
    """Figures 20x what the peer's own wall time allows (the work added 3 s to its run; they imply 0.15 s): refused,
    where an honest peer's pass."""
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({c: [[[1, 2, 3], 500]] for c in CASES}))
    useful = {c: 500 for c in CASES}
    got = run_peer(peer_cmd, tiny_dir, workload, CASES, timeout_s=60, useful_tokens=useful, baseline_s=0.0)
    assert got["_implied_s"] == pytest.approx(3.0) and got["_wall_s"] >= 3.0
    monkeypatch.setenv("FAKE_PEER_MODE", "liar")
    with pytest.raises(PeerError, match="overstate its speed"):
        run_peer(peer_cmd, tiny_dir, workload, CASES, timeout_s=60, useful_tokens=useful, baseline_s=0.0)
    with pytest.raises(PeerError, match="cannot be tokens / wall seconds"):
        check_against_wall({"uniform1": 1.0}, {"uniform1": 100}, wall_s=10.0)


def test_hanging_peer_times_out_and_is_killed(tiny_dir, peer_cmd, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PEER_MODE", "hang")
    workload = tmp_path / "w.json"
    workload.write_text(json.dumps({c: [[[1, 2, 3], 2]] for c in CASES}))
    t0 = time.monotonic()
    with pytest.raises(PeerError, match="timed out after 1 s"):
        run_peer(f"sh -c 'exec {peer_cmd} \"$@\"' sh", tiny_dir, workload, CASES, timeout_s=1)  # through a shell
    assert time.monotonic() - t0 < 30


def test_missing_peer_command_is_a_clear_error(tiny_dir, tmp_path):
    with pytest.raises(PeerError, match="cannot start peer command"):
        run_peer(str(tmp_path / "no-such-peer"), tiny_dir, tmp_path / "w.json", CASES)


def test_bench_exits_nonzero_when_the_peer_fails(tiny_dir, peer_cmd, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_PEER_MODE", "fail")
    assert main(["bench", "engine", str(tiny_dir), "--quick", "--scenarios", "uniform1", "--peer-cmd", peer_cmd,
                 "--rounds", "1", "--json", str(tmp_path / "x.json")]) == 1
    assert "peer failed" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
