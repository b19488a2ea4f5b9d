"""``duet bench engine --model qwen3.5-moe`` and ``duet bench transfer --model qwen3.5-moe`` on a tiny Qwen3.5-MoE:
JSON and table carry TTFT / TPOT against transformers and the KV vs state bytes each request moves."""

from __future__ import annotations

import json

import pytest
import torch

from cluster.cli.main import main
from engine import LLM
from duet_testing.qwen35_checkpoints import make_tiny_qwen35_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen35_checkpoint(tmp_path_factory.mktemp("qwen35-bench") / "m")


def test_engine_bench_qwen35(model_dir, tmp_path, capsys):
    out = tmp_path / "e.json"
    assert main(["bench", "engine", str(model_dir), "--model", "qwen3.5-moe", "--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["model"] == "qwen3.5-moe" and list(doc["cases"]) == ["text-16", "image-32"]
    t = LLM(model_dir, dtype="float32").engine.model_config.text
    for c in doc["cases"].values():
        for side in ("duet", "hf"):
            assert c[side]["ttft_s"] > 0 and c[side]["tpot_s"] > 0
        assert c["ttft_ratio"] == pytest.approx(c["duet"]["ttft_s"] / c["hf"]["ttft_s"])
        assert c["state_bytes"] == t.state_bytes_per_seq(torch.float32)
        assert c["kv_bytes"] == -(-c["prompt_tokens"] // 16) * 16 * t.kv_bytes_per_token(torch.float32)
    assert "state KiB" in capsys.readouterr().out


def test_transfer_bench_qwen35(ray_cluster, model_dir, tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["bench", "transfer", str(model_dir), "--model", "qwen3.5-moe", "--quick", "--transports", "gloo",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    t = LLM(model_dir, dtype="float32").engine.model_config.text
    for length, r in doc["lengths"].items():
        assert r["duet_local_ttft_s"] > 0 and r["hf_ttft_s"] > 0 and r["gloo"]["ttft_s"] > 0
        assert r["gloo"]["state_bytes"] == t.state_bytes_per_seq(torch.float32) and r["gloo"]["state_frames"] == 3
        assert r["gloo"]["kv_bytes"] == -(-int(length) // 16) * 16 * t.kv_bytes_per_token(torch.float32)
    assert "state KiB" in capsys.readouterr().out


def test_both_sides_read_the_same_clock():
    """TTFT is a one-token request's wall time and TPOT the n-token request's extra time per extra token, for Duet
    as for transformers; Duet's wall time spans the whole generate call (its preprocessing included)."""
    import time
    from types import SimpleNamespace

    from duet_bench.qwen35_bench import duet_wall, ttft_tpot

    assert ttft_tpot({1: 0.5, 5: 0.9}.__getitem__, 5) == pytest.approx((0.5, 0.1))

    class SlowPreprocessing:  # generate() spends 50 ms before its engine runs, then returns n tokens
        def generate(self, prompts, params):
            time.sleep(0.05)
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * params.max_tokens)])]

    assert duet_wall(SlowPreprocessing(), {"prompt_token_ids": [1, 2]}, 3) >= 0.05
