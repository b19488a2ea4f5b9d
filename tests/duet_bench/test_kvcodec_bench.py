"""``duet bench kv-codec``: the agreement / KL / byte math, and a small run on the demo model end to end (in-process
pair and one Ray cluster per transport). Behaviour only -- never wall-clock speed."""

from __future__ import annotations

import json

import pytest
import torch

from duet_bench.kvcodec_bench import check
from duet_bench.kvcodec_measure import agreement, byte_summary, mean_kl
from cluster.cli.main import main


def test_agreement_counts_matching_positions():
    assert agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]]) == 1.0
    assert agreement([[1, 2, 3], [4, 5]], [[1, 9, 3], [4, 6]]) == pytest.approx(3 / 5)


def test_kl_is_zero_for_equal_logits_and_stops_at_divergence():
    a = [torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 1.0, 0.0])]
    b = [torch.tensor([0.0, 2.0, -1.0]), torch.tensor([5.0, 0.0, 0.0])]
    assert mean_kl([[0, 1, 2]], [a], [[0, 1, 2]], [a]) == pytest.approx(0.0, abs=1e-7)
    p, q = a[0].log_softmax(-1), b[0].log_softmax(-1)
    first = float((p.exp() * (p - q)).sum())
    # the second step's prefix differs (token 1 vs 7): only the first step counts
    assert mean_kl([[0, 1, 2]], [a], [[0, 7, 2]], [b]) == pytest.approx(first, rel=1e-6)


def test_byte_summary_ratios():
    # 2 layers, 1 KV head, head_dim 4, float32: 2 * 2 * 4 * 4 = 64 raw bytes per token over all layers
    stats = [{"text": {"tokens": 3, "dropped": 0, "bytes": 96}, "visual": {"tokens": 8, "dropped": 2, "bytes": 80}}
             for _ in range(2)]
    s = byte_summary(stats, num_layers=2, raw_bytes_per_token=64, itemsize=4)
    assert s["text"]["bytes_per_token"] == pytest.approx(64) and s["text"]["vs_float32"] == pytest.approx(1.0)
    assert s["visual"]["tokens"] == 10 and s["visual"]["bytes_per_token"] == pytest.approx(16)
    assert s["visual"]["vs_float32"] == pytest.approx(4.0) and s["visual"]["vs_bfloat16"] == pytest.approx(2.0)


def test_criteria_flags_misses():
    def result(agree, acc, f32, bf16):
        return {"agreement": agree, "accuracy": acc,
                "bytes": {"visual": {"vs_float32": f32, "vs_bfloat16": bf16}}}

    c = check({"none": result(1.0, 0.90, 1, 0.5), "default": result(0.995, 0.895, 3.6, 1.8),
               "aggressive": result(0.94, 0.86, 7.5, 3.7)})
    assert c["default"] == {"agreement": True, "accuracy": True, "visual_vs_float32": True, "visual_vs_bfloat16": True}
    assert c["aggressive"] == {"agreement": False, "accuracy": False, "visual_vs_float32": True}


def test_small_run_on_the_demo_model(ray_cluster, tmp_path):
    out = tmp_path / "kv.json"
    assert main(["bench", "kv-codec", "--prompts", "3", "--tokens", "4", "--n", "5", "--e2e-images", "2",
                 "--e2e-requests", "1", "--transports", "gloo", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["results"]
    assert list(r) == ["none", "default", "aggressive"]
    assert r["none"]["agreement"] == 1.0 and r["none"]["kl"] == pytest.approx(0.0, abs=1e-9)
    assert r["none"]["ratio_vs_raw"] == pytest.approx(1.0, rel=1e-3)  # uncompressed: every valid token at raw size
    for name in ("default", "aggressive"):
        assert r[name]["bytes"]["visual"]["vs_float32"] > 3.5
        assert r[name]["bytes"]["text"]["bytes_per_token"] <= 1.01 * r["none"]["bytes"]["text"]["bytes_per_token"]
        assert 0 <= r[name]["agreement"] <= 1 and r[name]["accuracy"] is not None
        assert r[name]["e2e"]["gloo"]["ttft_ms"] > 0
