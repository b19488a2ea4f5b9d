"""``duet bench engine``: the quick configuration end to end, the decode cost model, the workload generator.

Behaviour only -- never wall-clock speed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from duet_bench.engine_workload import ScenarioSpec, make_workload, scenario_specs, usable_token_ids
from duet_bench.machine import MachineRates, decode_bound, decode_step_cost, expected_distinct_experts
from cluster.cli.main import main
from duet_testing.checkpoints import TinySpec, make_tiny_checkpoint

# hidden 4, 2 heads of dim 2, 1 KV head, vocab 10, one MoE layer of 4 experts (top 2, intermediate 3)
TOY_TEXT = {"model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 4, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 2, "num_hidden_layers": 1, "intermediate_size": 8,
            "moe_intermediate_size": 3, "num_experts": 4, "num_experts_per_tok": 2}
TOY_KV_BYTES = 2 * 1 * 1 * 2 * 4  # K and V, 1 layer, 1 KV head, dim 2, float32


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bench") / "m", TinySpec(vocab_size=256))


def test_quick_bench_writes_all_scenarios(tiny_dir, tmp_path, capsys):
    out = tmp_path / "x.json"
    assert main(["bench", "engine", str(tiny_dir), "--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc) >= {"model_dir", "config", "machine", "scenarios", "bound", "torch_threads", "timestamp",
                        "load_average"}
    assert list(doc["scenarios"]) == ["uniform1", "uniform32", "mixed"]
    for name, s in doc["scenarios"].items():
        spec = scenario_specs(quick=True)[name]
        assert s["duet"]["tokens_per_s"] > 0 and s["hf"]["tokens_per_s"] > 0
        assert s["ratio"] == pytest.approx(s["duet"]["tokens_per_s"] / s["hf"]["tokens_per_s"])
        assert s["duet"]["useful_tokens"] == s["hf"]["useful_tokens"] == s["useful_tokens"]
        assert spec.num_requests * spec.output_len[0] <= s["useful_tokens"] <= spec.num_requests * spec.output_len[1]
        assert s["duet"]["prefix_cache_hit_tokens"] == 0
        assert s["duet"]["mean_ttft_s"] > 0 and s["duet"]["mean_tpot_s"] > 0
    assert doc["scenarios"]["uniform1"]["tokens_match"] is True
    assert doc["config"]["hf"]["attn_implementation"] == "sdpa"
    assert doc["machine"]["read_gbps"] > 0 and doc["machine"]["best_matmul_gflops"] > 0
    assert set(doc["bound"]) == {"uniform1", "uniform32"}
    for name, b in doc["bound"].items():
        assert b["bound_step_s"] > 0 and 0 < b["fraction_of_bound"]
        rounds = doc["scenarios"][name]["paired_rounds"]  # a bandwidth read before each round, paired with its TPOT
        assert len(rounds) == len(b["paired_fractions"]) == 1 and rounds[0]["read_gbps"] > 0
        assert b["paired_fraction_median"] == b["paired_fractions"][0] > 0
    assert "paired_rounds" not in doc["scenarios"]["mixed"]
    table = capsys.readouterr().out
    assert "uniform-1" in table and "mixed" in table and "of bound" in table and "paired" in table


def test_scenario_selection_and_repeat(tiny_dir, tmp_path):
    out = tmp_path / "y.json"
    assert main(["bench", "engine", str(tiny_dir), "--quick", "--scenarios", "mixed", "--repeat", "2",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["scenarios"]) == ["mixed"] and doc["bound"] == {} and doc["config"]["repeat"] == 2
    assert doc["scenarios"]["mixed"]["duet"]["prefix_cache_hit_tokens"] == 0  # fresh ids on the second repeat


def test_bad_scenario_name_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "engine", "--scenarios", "uniform1,nope"])
    assert e.value.code == 2


def test_decode_step_cost_worked_example():
    # parameters read at batch 1: attention q, o 4*2*2 = 16 each, k, v 4*1*2 = 8 each -> 48;
    # norms 2*4 + q/k norm 2*2 -> 12; router 4*4 = 16; top-2 experts 2 * 3*4*3 = 72; final norm 4; LM head 40.
    # -> 192 params * 4 B = 768 B, + KV 5 tokens * 16 B = 80 -> 848 B.
    # FLOPs: 2 * (48 + 16 + 72 + 40) = 352, + attention 4 * 2 heads * 2 dim * 5 keys = 80 -> 432.
    assert decode_step_cost(TOY_TEXT, batch=1, context_len=5, kv_bytes_per_token=TOY_KV_BYTES, dtype_bytes=4) \
        == (848, 432)
    # batch 2: expected distinct experts 4 * (1 - 0.5^2) = 3 -> experts 108, weights 228 * 4 = 912, KV 2*5*16 = 160;
    # FLOPs scale with the batch: 2 * 176 * 2 + 160 = 864.
    assert decode_step_cost(TOY_TEXT, batch=2, context_len=5, kv_bytes_per_token=TOY_KV_BYTES, dtype_bytes=4) \
        == (1072, 864)


def test_expected_distinct_experts():
    assert expected_distinct_experts(16, 2, 1) == pytest.approx(2)
    assert expected_distinct_experts(16, 2, 32) == pytest.approx(16 * (1 - (14 / 16) ** 32))
    assert expected_distinct_experts(8, 8, 3) == pytest.approx(8)


def test_decode_bound_takes_the_slower_resource():
    rates = MachineRates(read_gbps=1e-6, matmul_square_gflops=1e-6, matmul_skinny_gflops=2e-6, read_bytes=1,
                         square_n=1, skinny_shape=(1, 1, 1), threads=1, device="cpu")
    b = decode_bound(TOY_TEXT, rates, batch=1, context_len=5, kv_bytes_per_token=TOY_KV_BYTES, dtype_bytes=4,
                     measured_step_s=848e-3 * 2)
    assert b["memory_time_s"] == pytest.approx(848e-3) and b["compute_time_s"] == pytest.approx(432e-3 / 2)
    assert b["limited_by"] == "memory" and b["bound_step_s"] == pytest.approx(848e-3)
    assert b["fraction_of_bound"] == pytest.approx(0.5)


def test_workload_is_deterministic_and_in_bounds(tiny_dir):
    ids = usable_token_ids(tiny_dir)
    spec = TinySpec(vocab_size=256)
    assert not set(ids.tolist()) & set(spec.special_token_ids.values())
    mixed = ScenarioSpec("mixed", 64, (16, 512), (8, 128), 32)
    a, b = make_workload(mixed, ids, seed=0), make_workload(mixed, ids, seed=0)
    assert a == b
    assert all(16 <= len(p) <= 512 for p in a.prompts) and all(8 <= n <= 128 for n in a.max_tokens)
    assert a.useful_tokens == sum(a.max_tokens) and len(a.prompts) == 64
    assert all(set(p) <= set(ids.tolist()) for p in a.prompts)
    other_seed = make_workload(mixed, ids, seed=1)
    assert other_seed.max_tokens != a.max_tokens
    repeat = make_workload(mixed, ids, seed=0, variant=1)  # same shape, fresh ids: no prefix-cache hits
    assert [len(p) for p in repeat.prompts] == [len(p) for p in a.prompts] and repeat.max_tokens == a.max_tokens
    assert repeat.prompts != a.prompts
    uni = scenario_specs(quick=False)["uniform32"]
    w = make_workload(uni, ids, seed=0)
    assert {len(p) for p in w.prompts} == {128} and set(w.max_tokens) == {64}
    assert np.unique([p[0] for p in w.prompts]).size > 1
