"""``duet bench transfer``: the prompt workload, the rate and ratio math, and the quick configuration end to end on
the session's Ray cluster. Behaviour only -- never wall-clock speed.
"""

from __future__ import annotations

import json

import pytest

from duet_bench.transfer_bench import (
    best_of,
    criteria,
    engine_setup,
    make_prompt,
    num_images,
    ratio,
    transfer_gbps,
)
from cluster.cli.main import main

BENCH_TPI = 255  # SigLIP 224/14, strategy "default"
IMAGE_ID = 8191
TEXT_IDS = list(range(100, 200))


def _prompt(n: int, tpi: int = BENCH_TPI, **kw) -> dict:
    return make_prompt(n, tokens_per_image=tpi, image_token_id=IMAGE_ID, text_ids=TEXT_IDS, image_size=32,
                       **{"seed": 0, **kw})


@pytest.mark.parametrize(("n", "k"), [(512, 1), (2048, 4), (4096, 8), (100, 0), (16, 0)])
def test_num_images_makes_about_half(n, k):
    assert num_images(n, BENCH_TPI) == k


def test_num_images_never_overflows_the_prompt():
    assert num_images(16, 3) == 3 and num_images(32, 3) == 5
    assert num_images(3, 2) == 1  # round(0.75) = 1 image of 2 tokens fits in 3
    assert num_images(5, 4) == 1 and num_images(4, 5) == 0


@pytest.mark.parametrize("n", [512, 2048, 4096])
def test_prompt_is_exact_length_half_image_tokens(n):
    p = _prompt(n)
    ids, images = p["prompt_token_ids"], p["multi_modal_data"]["image"]
    k = num_images(n, BENCH_TPI)
    assert len(ids) == n and len(images) == k
    assert ids.count(IMAGE_ID) == k * BENCH_TPI
    assert abs(ids.count(IMAGE_ID) - n / 2) <= BENCH_TPI / 2
    assert set(ids) - {IMAGE_ID} <= set(TEXT_IDS)
    assert all(im.size == (32, 32) and im.mode == "RGB" for im in images)


def test_image_placeholders_come_in_whole_runs_between_text():
    ids = _prompt(2048)["prompt_token_ids"]
    runs, cur = [], 0
    for t in ids:
        if t == IMAGE_ID:
            cur += 1
        elif cur:
            runs.append(cur)
            cur = 0
    assert runs == [BENCH_TPI] * 4  # four separate images, each with text after it
    assert ids[0] != IMAGE_ID and ids[-1] != IMAGE_ID


def test_prompts_are_deterministic_and_variants_differ():
    a, b = _prompt(512), _prompt(512)
    assert a["prompt_token_ids"] == b["prompt_token_ids"]
    assert [im.tobytes() for im in a["multi_modal_data"]["image"]] == \
        [im.tobytes() for im in b["multi_modal_data"]["image"]]
    c = _prompt(512, variant=1)
    assert len(c["prompt_token_ids"]) == 512 and c["prompt_token_ids"] != a["prompt_token_ids"]
    assert c["multi_modal_data"]["image"][0].tobytes() != a["multi_modal_data"]["image"][0].tobytes()
    assert _prompt(512, seed=1)["prompt_token_ids"] != a["prompt_token_ids"]


def test_short_prompt_without_images_has_no_multimodal_data():
    p = _prompt(16)
    assert "multi_modal_data" not in p and len(p["prompt_token_ids"]) == 16


def test_transfer_gbps_counts_the_layers_inside_the_span():
    # 6 layers of 1 MB each; arrivals of layer 0 and layer 5 are 5 ms apart -> 5 MB in 5 ms = 1 GB/s
    assert transfer_gbps(6_000_000, 6, 0.005) == pytest.approx(1.0)
    assert transfer_gbps(6_000_000, 1, 0.005) is None
    assert transfer_gbps(6_000_000, 6, 0.0) is None


def test_ratio_and_best_of():
    assert ratio(1.0, 6.0) == pytest.approx(1 / 6)
    assert ratio(None, 1.0) is None and ratio(1.0, 0.0) is None and ratio(1.0, None) is None
    runs = [{"ttft_s": 0.3, "gbps": 1.0, "bytes": 10, "exposed_s": None},
            {"ttft_s": 0.2, "gbps": 2.0, "bytes": 10, "exposed_s": 0.01},
            {"ttft_s": 0.4, "gbps": None, "bytes": 10, "exposed_s": 0.02}]
    assert best_of(runs) == {"ttft_s": 0.2, "gbps": 2.0, "bytes": 10, "exposed_s": 0.01}
    assert best_of([{"exposed_s": None}]) == {"exposed_s": None}


def _row(lw: float, whole: float, gloo_gbps: float, grpc_gbps: float) -> dict:
    fig = {"exposed_ratio": ratio(lw, whole)}
    return {"transports": {"gloo": fig, "grpc": fig}, "grpc_over_gloo": ratio(grpc_gbps, gloo_gbps)}


def test_criteria_at_2048_tokens():
    results = {512: _row(5, 5, 2.0, 0.1), 2048: _row(2, 12, 2.0, 1.2), 4096: _row(9, 10, 2.0, 0.1)}
    c = criteria(results, ["gloo", "grpc"])
    assert c["prompt_len"] == 2048 and c["exposed_ratio"]["gloo"] == pytest.approx(1 / 6)
    assert c["exposed_ok"] and c["grpc_ok"] and c["grpc_over_gloo"] == pytest.approx(0.6)
    bad = criteria({2048: _row(4, 12, 2.0, 0.9)}, ["gloo", "grpc"])
    assert not bad["exposed_ok"] and not bad["grpc_ok"]  # 1/3 > 0.25, 0.45 < 0.5
    only_gloo = criteria({16: _row(1, 2, 1, 1), 32: _row(1, 8, 1, 1)}, ["gloo"])
    assert only_gloo["prompt_len"] == 32 and only_gloo["exposed_ok"] and "grpc_ok" not in only_gloo


def test_engine_setup_fits_the_longest_prompt_in_one_chunk():
    s = engine_setup([512, 2048, 4096], quick=False)
    assert s["max_model_len"] == 8192 and s["block_size"] == 16 and s["max_num_batched_tokens"] >= 4096
    assert s["num_kv_blocks"] * s["block_size"] >= 2 * (4096 + 2)
    big = engine_setup([10_000], quick=False)
    assert big["max_model_len"] >= 10_002 and big["max_num_batched_tokens"] >= 10_000


def test_bad_transport_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        main(["bench", "transfer", "--transports", "gloo,pigeon"])
    assert e.value.code == 2


def test_quick_run_writes_figures_and_leaks_nothing(ray_cluster, tiny_model_dir, tmp_path, capsys):
    import ray

    out = tmp_path / "transfer.json"
    assert main(["bench", "transfer", str(tiny_model_dir), "--quick", "--json", str(out)]) == 0
    assert ray.is_initialized()  # the session's cluster is not the bench's to shut down
    doc = json.loads(out.read_text())
    assert set(doc) >= {"model_dir", "config", "results", "clusters", "criteria", "leaked_blocks", "load_average",
                        "timestamp"}
    assert doc["config"]["transports"] == ["gloo"] and doc["config"]["prompt_lens"] == [16, 32]
    assert set(doc["clusters"]) == {"gloo/layerwise", "gloo/whole", "gloo/whole/auth-off"}  # --auth both
    assert doc["config"]["auth"] == "both"
    assert doc["leaked_blocks"] == 0
    for info in doc["clusters"].values():
        assert info["held_blocks"] and all(v == 0 for v in info["held_blocks"].values())
    layers = doc["config"]["num_layers"]
    for n, r in doc["results"].items():
        assert r["kv_bytes"] > 0 and r["memcpy_gbps"] > 0 and r["local"]["ttft_s"] > 0
        assert r["num_images"] == num_images(int(n), doc["config"]["tokens_per_image"])
        g = r["transports"]["gloo"]
        assert g["tokens_match"] is True
        for mode in ("layerwise", "whole"):
            assert g[mode]["bytes"] == r["kv_bytes"] and g[mode]["layers"] == layers
            assert g[mode]["ttft_s"] > 0 and g[mode]["exposed_s"] >= 0
        assert g["transfer_gbps"] == g["whole"]["gbps"]
        assert g["auth_off_gbps"] > 0 and g["auth_over_off"] == g["transfer_gbps"] / g["auth_off_gbps"]
    assert doc["criteria"]["prompt_len"] == 32 and "gloo" in doc["criteria"]["exposed_ratio"]
    table = capsys.readouterr().out
    assert "exposed lw ms" in table and "auth/none" in table and "16 (" in table and "load average" in table
