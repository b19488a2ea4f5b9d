"""``duet bench startup`` against a stand-in server (a script that prints the ready line and answers one chat
request): starts alternate, each gets the cache its mode says, the first request is timed, and a server that dies or
never gets ready is an error, not a hang."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pytest

from duet_bench import startup_bench

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "llava_demo"

STUB = r'''
import http.server, json, os, signal, sys, threading, time
mode = os.environ.get("STUB_MODE", "ok")
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "cache": os.environ["DUET_TUNING_CACHE"],
                        "cache_files": sorted(os.listdir(os.environ["DUET_TUNING_CACHE"]))
                        if os.environ["DUET_TUNING_CACHE"] != "off" else None, "cwd": os.getcwd()}) + "\n")
if mode == "exit":
    sys.exit(3)
if mode == "silent":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    time.sleep(600)
if os.environ["DUET_TUNING_CACHE"] != "off":
    open(os.path.join(os.environ["DUET_TUNING_CACHE"], "answers.json"), "w").write("{}")

class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(os.environ["STUB_LOG"], "a") as f:
            f.write(json.dumps({"request": body}) + "\n")
        out = json.dumps({"choices": [{"message": {"content": "hi"}}]}).encode()
        self.send_response(500 if mode == "http500" else 200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    def log_message(self, *a):
        pass

srv = http.server.HTTPServer(("127.0.0.1", 0), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
time.sleep(0.05)
if mode != "old":  # a server from before the started line
    print("duet serve: started in 0.30 s (Ray 0.10 s, workers 0.15 s, front-end 0.05 s)", file=sys.stderr, flush=True)
line = f"duet serve: ready  grpc=127.0.0.1:1  http=http://127.0.0.1:{srv.server_port}  model=stub"
if mode == "split":  # the line in two writes: the reader must not take the first half for it
    sys.stdout.write(line[:30])
    sys.stdout.flush()
    time.sleep(0.3)
    line = line[30:]
print(line, flush=True)
stop = threading.Event()
signal.signal(signal.SIGINT, lambda *a: stop.set())
stop.wait(60)
'''


@pytest.fixture
def stub(tmp_path, monkeypatch):
    script = tmp_path / "stub.py"
    script.write_text(STUB)
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("STUB_LOG", str(log))
    monkeypatch.setattr(startup_bench, "serve_command",
                        lambda s: [sys.executable, str(script), s.label, str(s.model_dir)])

    def records() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return records


def _args(tmp_path, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    startup_bench.add_arguments(p)
    a = p.parse_args(["--json", str(tmp_path / "out.json"), "--pause-s", "0", "--timeout-s", "20"])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_starts_alternate_each_with_an_empty_cache_and_the_first_request_is_timed(tmp_path, stub, capsys):
    a = _args(tmp_path, rounds=2, model_dir=[str(FIXTURE)], first_request=True)
    assert startup_bench.run(a) == 0
    starts = [r for r in stub() if "argv" in r]
    assert [s["argv"][0] for s in starts] == ["default", "model:llava_demo", "model:llava_demo", "default"]
    assert all(s["cache_files"] == [] for s in starts)  # each a new host's first start
    assert len({s["cache"] for s in starts}) == 4
    assert starts[1]["argv"][1] == str(FIXTURE.resolve()) and starts[0]["argv"][1] == "None"
    requests = [r["request"] for r in stub() if "request" in r]
    assert len(requests) == 4 and all(r["model"] == "stub" and r["max_tokens"] == 8 for r in requests)
    out = json.loads((tmp_path / "out.json").read_text())
    assert [s["label"] for s in out["systems"]] == ["default", "model:llava_demo"]
    for s, row in zip(out["systems"], out["summary"], strict=True):
        assert len(s["ready_s"]) == 2 and all(0 < x < 20 for x in s["ready_s"])
        assert all(x is not None and x > 0 for x in s["first_request_s"])
        assert row["ready_p50_s"] == pytest.approx(sum(s["ready_s"]) / 2)
    assert out["summary"][0]["ratio_to_baseline"] == 1.0
    assert out["summary"][1]["ratio_to_baseline"] == pytest.approx(
        out["summary"][1]["ready_p50_s"] / out["summary"][0]["ready_p50_s"])
    assert all(p == {"Ray": 0.10, "workers": 0.15, "front-end": 0.05} for s in out["systems"] for p in s["phases"])
    assert out["summary"][1]["workers_p50_s"] == 0.15
    assert "ready p50 s" in capsys.readouterr().out


def test_a_server_without_the_started_line_has_no_phases(tmp_path, stub, monkeypatch, capsys):
    monkeypatch.setenv("STUB_MODE", "old")
    assert startup_bench.run(_args(tmp_path, rounds=1)) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["systems"][0]["phases"] == [{}] and "workers_p50_s" not in out["summary"][0]
    table = capsys.readouterr().out.splitlines()
    assert "workers p50 s" in table[0] and table[-2].split()[6:9] == ["-", "-", "-"]


def test_warm_starts_read_what_an_untimed_start_wrote_and_off_gives_no_cache(tmp_path, stub):
    assert startup_bench.run(_args(tmp_path, rounds=2, cache="warm")) == 0
    starts = [r for r in stub() if "argv" in r]
    assert len(starts) == 3 and starts[0]["cache_files"] == []  # the untimed start fills it
    assert starts[1]["cache"] == starts[2]["cache"] == starts[0]["cache"]
    assert starts[1]["cache_files"] == ["answers.json"]
    assert len(json.loads((tmp_path / "out.json").read_text())["systems"][0]["ready_s"]) == 2
    assert startup_bench.run(_args(tmp_path, rounds=1, cache="off")) == 0
    assert stub()[-1]["cache"] == "off" and stub()[-1]["cache_files"] is None


def test_a_ready_line_in_two_writes_is_read_whole(tmp_path, stub, monkeypatch):
    monkeypatch.setenv("STUB_MODE", "split")
    assert startup_bench.run(_args(tmp_path, rounds=1, first_request=True)) == 0
    assert [r["request"]["model"] for r in stub() if "request" in r] == ["stub"]


def test_a_failed_first_request_is_an_error_not_a_traceback(tmp_path, stub, monkeypatch, capsys):
    monkeypatch.setenv("STUB_MODE", "http500")
    assert startup_bench.run(_args(tmp_path, rounds=1, first_request=True)) == 1
    assert "duet: error: the first request failed: HTTP Error 500" in capsys.readouterr().err


def test_a_server_that_exits_before_ready_is_an_error(tmp_path, stub, monkeypatch, capsys):
    monkeypatch.setenv("STUB_MODE", "exit")
    assert startup_bench.run(_args(tmp_path, rounds=3)) == 1
    assert "exited with code 3 before its ready line" in capsys.readouterr().err
    assert len(stub()) == 1  # the first failure ends the run
    assert not (tmp_path / "out.json").exists()


def test_a_server_that_never_gets_ready_is_killed_at_the_deadline(tmp_path, stub, monkeypatch, capsys):
    monkeypatch.setenv("STUB_MODE", "silent")  # ignores SIGINT too
    t0 = time.monotonic()
    assert startup_bench.run(_args(tmp_path, rounds=1, timeout_s=1.5)) == 1
    assert time.monotonic() - t0 < 15
    assert "no ready line within the deadline" in capsys.readouterr().err


@pytest.mark.parametrize("kw,message", [
    ({"rounds": 0}, "--rounds must be >= 1"),
    ({"image": Path("/nonexistent.png")}, "no such file"),
    ({"model_dir": ["/nonexistent"]}, "is not a checkpoint"),
])
def test_bad_arguments_are_refused_before_anything_starts(tmp_path, stub, capsys, kw, message):
    assert startup_bench.run(_args(tmp_path, **kw)) == 2
    assert message in capsys.readouterr().err and stub() == []


def test_rotation_puts_each_system_first_once_per_cycle():
    seen = [startup_bench.order(["a", "b", "c"], r) for r in range(3)]
    assert [s[0] for s in seen] == ["a", "b", "c"] and all(sorted(s) == ["a", "b", "c"] for s in seen)
    assert startup_bench.ready_fields("duet serve: ready  grpc=h:1  http=http://h:2  model=m")["http"] == "http://h:2"
