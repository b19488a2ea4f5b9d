"""``duet bench engine --model qwen3-vl-moe`` and ``duet bench kv-codec --model qwen3-vl-moe`` on a tiny Qwen3-VL-MoE
checkpoint: JSON schema, table, prompt construction. Behaviour only -- never wall-clock speed."""

from __future__ import annotations

import argparse
import json

import pytest

from duet_bench.qwen_bench import QWEN_BENCH_SPEC, QwenPrompts, image_sizes
from cluster.cli.main import main
from duet_testing.qwen_checkpoints import QwenTinySpec, make_tiny_qwen_checkpoint
from engine.models.qwen3_vl.image_processor import QwenVLImageProcessor

SIDES = "32,64"  # patch 16, merge 2: 1 and 4 visual tokens


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return make_tiny_qwen_checkpoint(tmp_path_factory.mktemp("qwen-bench") / "m", QwenTinySpec())


def test_bench_spec_gives_the_issue_token_counts():
    s = QWEN_BENCH_SPEC
    proc = QwenVLImageProcessor(patch_size=s.patch_size, merge_size=s.merge_size, min_pixels=s.min_pixels,
                                max_pixels=s.max_pixels)
    assert [proc.num_visual_tokens(n, n) for n in (256, 512, 1024)] == [64, 256, 1024]
    assert s.text == "qwen3_vl_moe" and s.dtype == "float32" and len(s.deepstack_visual_indexes) == 3


def test_image_sizes_parser():
    assert image_sizes("256, 512,1024") == [256, 512, 1024]
    for bad in ("", "0", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            image_sizes(bad)


def test_prompts_are_fresh_and_hold_one_image(qwen_dir):
    gen = QwenPrompts(qwen_dir, seed=0)
    ids, im = gen.make(64, 0)
    again, im2 = gen.make(64, 0)
    other, im3 = gen.make(64, 1)
    assert ids == again and im.tobytes() == im2.tobytes()
    assert ids != other and im.tobytes() != im3.tobytes()
    assert im.size == (64, 64) and ids.count(gen.image_token_id) == gen.num_visual_tokens(64) == 4
    start = ids.index(gen.vision_start)
    assert ids[start + 1:start + 5] == [gen.image_token_id] * 4 and ids[start + 5] == gen.vision_end


def test_engine_bench_qwen_mode(qwen_dir, tmp_path, capsys):
    out = tmp_path / "q.json"
    assert main(["bench", "engine", str(qwen_dir), "--model", "qwen3-vl-moe", "--quick", "--image-sizes", SIDES,
                 "--repeat", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc) >= {"model_dir", "model", "config", "sizes", "torch_threads", "load_average", "timestamp"}
    assert doc["config"]["rounds"] == 1 and doc["config"]["image_sizes"] == [32, 64]
    assert doc["config"]["hf"]["attn_implementation"] == "sdpa"
    assert list(doc["sizes"]) == ["32x32", "64x64"]
    for s, n in zip(doc["sizes"].values(), (1, 4), strict=True):
        assert s["visual_tokens"] == n and s["prompt_tokens"] == n + 18
        for side in ("duet", "hf"):
            assert s[side]["ttft_s"] > 0
            assert s[side]["prefill_tokens_per_s"] == pytest.approx(s["prompt_tokens"] / s[side]["ttft_s"])
        assert s["duet"]["metrics_ttft_s"] > 0 and s["hf"]["preprocess_s"] >= 0
        assert s["prefill_speedup"] == pytest.approx(s["duet"]["prefill_tokens_per_s"] / s["hf"]["prefill_tokens_per_s"])
        assert s["ttft_ratio"] == pytest.approx(s["duet"]["ttft_s"] / s["hf"]["ttft_s"])
        assert s["first_tokens_match"] == 1 and s["prefix_cache_hit_tokens"] == 0
        assert len(s["rounds"]["duet"]) == len(s["rounds"]["hf"]) == 1
    table = capsys.readouterr().out
    assert "duet/hf tok/s" in table and "64x64" in table


def test_kvcodec_bench_qwen_mode(qwen_dir, tmp_path, capsys):
    out = tmp_path / "kv.json"
    assert main(["bench", "kv-codec", str(qwen_dir), "--model", "qwen3-vl-moe", "--image-sizes", SIDES,
                 "--prompts", "2", "--tokens", "3", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["model"] == "qwen3-vl-moe" and doc["policies"] == ["none", "default", "aggressive"]
    assert list(doc["sizes"]) == ["32x32", "64x64"]
    for s, n in zip(doc["sizes"].values(), (1, 4), strict=True):
        assert s["visual_tokens"] == n and list(s["policies"]) == doc["policies"]
        none = s["policies"]["none"]
        assert none["agreement"] == 1.0 and none["kl"] == pytest.approx(0.0, abs=1e-9)
        assert none["ratio_vs_raw"] == pytest.approx(1.0, rel=1e-3)
        assert none["bytes"]["visual"]["tokens"] == 2 * n  # two prompts, every visual token counted
        assert none["bytes"]["visual"]["vs_float32"] == pytest.approx(1.0)
        for name in ("default", "aggressive"):
            r = s["policies"][name]
            assert r["bytes"]["visual"]["vs_float32"] > 1.0 and 0 <= r["agreement"] <= 1 and r["kl"] >= 0
            assert len(r["generated_tokens"]) == 2
    table = capsys.readouterr().out
    assert "visual B/tok" in table and "aggressive" in table
