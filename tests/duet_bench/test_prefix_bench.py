"""``duet bench prefix --quick``: a repeat hits every block it can through the GDN state snapshots, an engine with
``state_snapshots=0`` caches nothing, both sends give the same greedy token; JSON and table carry the figures."""

from __future__ import annotations

import json

from cluster.cli.main import main
from duet_bench.prefix_bench import BLOCK_SIZE, MEDIAN_KEYS


def test_prefix_bench_quick(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["bench", "prefix", "--quick", "--rounds", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["model"] == "qwen3.5-moe" and doc["image_side"] == 64 and doc["image_tokens"] > 0
    total = doc["prompt_tokens"]
    assert len(doc["rounds"]) == 1 and set(MEDIAN_KEYS) <= set(doc["median"]) and set(MEDIAN_KEYS) <= set(
        doc["no_snapshots"])
    r = doc["rounds"][0]
    assert r["prompt_tokens"] == total
    assert r["cold_cached_tokens"] == 0 and total > r["cached_tokens"] >= total - 2 * BLOCK_SIZE > 0
    assert r["cached_tokens"] % BLOCK_SIZE == 0 and doc["median"]["cached_tokens"] == r["cached_tokens"]
    assert r["hit_vision_s"] == 0.0 < r["cold_vision_s"]  # the hit resumes after the image: no tower call
    assert r["no_snapshots"]["cached_tokens"] == 0 == doc["no_snapshots"]["cached_tokens"]
    assert r["same_token"] is True and doc["same_token"] is True
    for side in (r, r["no_snapshots"]):
        assert side["cold_s"] > 0 and side["hit_s"] > 0 and side["ratio"] == side["hit_s"] / side["cold_s"]
    assert doc["machine"]["cpu"]["model"] and doc["machine"]["torch_threads"] >= 1
    assert len(doc["machine"]["load_average"]["start"]) == 3 and doc["timestamp"]
    assert "median hit/cold" in capsys.readouterr().out
