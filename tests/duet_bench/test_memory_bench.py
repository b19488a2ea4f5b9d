"""``duet bench memory``: a small run end to end on a tiny Qwen3-VL-MoE checkpoint (the command line, the JSON it
writes, and what it must find: more requests held at once with coded image KV, all completed, the eight-image
request run at a budget that fits it and refused typed, nothing reserved, at one that does not). Behaviour only --
the TPOT ratio is written, never asserted."""

from __future__ import annotations

import json

from cluster.cli.main import main


def test_memory_bench_end_to_end(tiny_qwen_ckpt, tmp_path, capsys):
    model = tiny_qwen_ckpt(max_pixels=512 * 512)
    out = tmp_path / "memory.json"
    # head_dim 16 at float32: 42 coded tokens a page against 16 a block; 512^2 images are 256 visual tokens
    assert main(["bench", "memory", "--model-dir", str(model), "--side", "512", "--budget-mb", "2.5",
                 "--tokens", "4", "--rounds", "1", "--agreement-prompts", "3", "--agreement-tokens", "6",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    s, u, e = res["static"], res["unified"], res["eight_1024_images"]
    assert res["budget_bytes"] == int(2.5 * 2**20) and res["visual_tokens_per_image"] == 256
    assert s["pool_bytes"] == u["pool_bytes"]  # one budget, one pool: the difference is how image KV is kept
    assert 1 <= s["concurrent"] < u["concurrent"] and u["concurrent_ratio"] == u["concurrent"] / s["concurrent"]
    for side in (s, u):  # held at once for real, every one completed, none preempted or failed
        assert side["held_peak"] == side["concurrent"] == side["completed"]
        assert side["failed"] == 0 and side["preemptions"] == 0
    assert s["visual_kv_bytes_peak"] == 0 < u["visual_kv_bytes_peak"]
    assert 0 <= u["agreement"] <= 1 and u["agreement_tokens"] == 3 * 6
    assert u["tpot_ratio"] > 0 and len(s["tpot_rounds_ms"]) == 1
    assert e["completed"] and e["refused_typed_when_over"] and e["over_budget_bytes"] < e["fit_budget_bytes"]
    assert f"{e['kv_bytes']:,} bytes of KV" in e["error"]
    assert "held at once" in capsys.readouterr().out
