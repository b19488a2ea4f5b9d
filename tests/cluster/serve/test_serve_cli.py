"""``duet serve`` as a process: config validation before anything starts, the one ready line, and a SIGTERM that
drains the request in flight (it finishes normally) before the process exits 0. The process joins the session's
Ray cluster (``--address``) instead of starting its own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli.main import EXIT_USAGE, main
from duet_client import Client

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("argv, message", [
    (["--host", "0.0.0.0"], "refusing to serve on 0.0.0.0 (not a loopback address) without a token"),
    (["--grpc-port", "70000"], "grpc_port must be a port number"),
    (["--tls-cert", "/nonexistent.pem"], "TLS needs both tls_cert and tls_key"),
], ids=["non-loopback without token", "bad port", "half TLS"])
def test_bad_flags_fail_before_anything_starts(argv, message, capsys):
    assert main(["serve", *argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("text, message", [
    ("num_prefil: 1\n", "unknown setting num_prefil (known: model_dir, num_prefill"),
    ("num_prefill: two\n", "num_prefill: expected int, got 'two'"),
    ("serve:\n  limits:\n    max_concurent: 3\n", "unknown setting serve.limits.max_concurent"),
    ("serve: [1, 2]\n", "serve: must be a mapping"),
    ("model_dir: /nowhere\n", "no checkpoint at /nowhere"),
    ("transport: [oops\n", "cannot parse"),
], ids=["typo", "type", "limits typo", "serve not a mapping", "no checkpoint", "bad yaml"])
def test_bad_config_file_is_one_line_naming_the_setting(tmp_path, text, message, capsys):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(text)
    assert main(["serve", "--config", str(cfg)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_serve_prints_one_ready_line_and_drains_on_sigterm(ray_cluster, tmp_path):
    import ray

    cfg = tmp_path / "serve.json"
    cfg.write_text('{"num_kv_blocks": 256, "serve": {"model_name": "shapes", "limits": {"max_concurrent": 8}}}')
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DUET_TOKEN": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--config", str(cfg), "--grpc-port", "0", "--http-port", "0",
         "--address", ray.get_runtime_context().gcs_address, "--drain-timeout", "20"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # blocks until ready (or the process dies)
        m = re.match(r"duet serve: ready  grpc=(\S+)  http=(\S+)  model=shapes  workers=1 prefill \+ 1 decode "
                     r"\(gloo\)  prefill_threads=\d+( \(nice 10: decode first(, fewer while decode steps)?\))?"
                     r"(  text prompts <= \d+ tokens prefilled on the decode worker \(shared cores\))?$",
                     line.rstrip("\n"))
        assert m, (line, proc.poll())
        with Client(m.group(1)) as c:
            assert c.list_models()[0]["id"] == "shapes"
            stream = c.generate("red", raw_prompt=True, max_tokens=300, ignore_eos=True)
            next(stream)
            proc.send_signal(signal.SIGTERM)
            for _ in stream:
                pass
            assert stream.completion.finish_reason == "length"  # drained: ran to the end, not aborted
            assert stream.completion.usage.completion_tokens == 300
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert out == "" and "draining" in err  # exactly one line on stdout in all
        assert re.search(r"duet serve: started in [\d.]+ s \(Ray [\d.]+ s, workers [\d.]+ s, front-end [\d.]+ s\)", err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
