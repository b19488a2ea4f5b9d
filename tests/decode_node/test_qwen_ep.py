"""Qwen3-VL-MoE on the decode side's expert machinery, in one process: per-slot expert reads in both fused layouts
(transformers 5's and the released checkpoints' transposed one), an expert-parallel group of 2 in lockstep through a
placement change, and tiered experts fed by prefill's routing hints -- each equal to the local engine's greedy
tokens, with no KV block left."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster.control.local_pair import LocalPair
from decode_node.expert_slots import SlotTable
from decode_node.expert_tiers import TierConfig
from decode_node.expert_weights import ExpertWeightSource
from engine import LLM, EngineConfig
from tests.cluster.control.test_qwen_disagg import CFG, SIZES, SPEC, qwen_image, qwen_request
from tests.conftest import greedy
from tests.decode_node.test_expert_parallel import _decode_group


def _prompts(model_dir):
    ims = [qwen_image(i, s) for i, s in enumerate(SIZES)]
    return [qwen_request(model_dir, ims[:2], seed=1), qwen_request(model_dir, [ims[2]], seed=2),
            qwen_request(model_dir, [], seed=3, text=6)]


def _local(model_dir, prompts, params):
    return [o.outputs[0].token_ids for o in LLM(model_dir, **CFG).generate(prompts, params)]


@pytest.mark.parametrize("layout", ["hf", "published"])
def test_expert_weights_read_per_slot_match_the_loaded_model(tiny_qwen_ckpt, layout):
    model_dir = tiny_qwen_ckpt(layout=layout)
    moe = LLM(model_dir, **CFG).engine.model.text.layers[1].mlp
    gu, down = ExpertWeightSource(model_dir, dtype=torch.float32).read(1, [5, 2, 5])
    all_gu, all_down = moe.expert_weights()  # rebuilt from packed CPU kernels where the engine packed them
    assert torch.equal(gu, all_gu[[5, 2, 5]]) and torch.equal(down, all_down[[5, 2, 5]])


def test_expert_parallel_group_of_2_matches_local_through_a_placement_change(tiny_qwen_ckpt):
    model_dir = tiny_qwen_ckpt(layout="published")
    prompts, params = _prompts(model_dir), [greedy(12), greedy(10), greedy(8)]
    rng = np.random.default_rng(0)
    new = SlotTable(np.stack([rng.permutation(np.arange(10) % 8).reshape(2, 5) for _ in range(SPEC.num_layers)]), 8,
                    version=1)
    got, switches, workers = _decode_group(model_dir, 2, 5, prompts, params, new, change_at=4)
    assert got == _local(model_dir, prompts, params)
    assert {tuple((s["version"], s["tick"]) for s in sw) for sw in switches} == {((1, 4),)}
    for w in workers:
        w.engine.block_manager.check_no_leaks()


def test_tiered_experts_take_prefill_routing_hints_and_equal_local(tiny_qwen_ckpt):
    model_dir = tiny_qwen_ckpt()
    prompts, params = _prompts(model_dir), greedy(8)
    pair = LocalPair(model_dir, EngineConfig(**CFG), expert_tiers=TierConfig(0.5, "duet"))
    seen: list = []
    on_requests = pair.decode.tiers.policy.on_requests
    pair.decode.tiers.policy.on_requests = lambda arrivals, departures: (seen.append((arrivals, departures)),
                                                                         on_requests(arrivals, departures))
    try:
        outs, failed = pair.generate(prompts, params)
        assert not failed and pair.decode.tiers.wait_idle()
        pair.check_no_leaks()
        stats = pair.decode.tiers.stats
    finally:
        pair.close()
    assert [o.outputs[0].token_ids for o in outs] == _local(model_dir, prompts, params)
    arrived = {rid: hint for a, _ in seen for rid, hint in a}
    assert sorted(arrived) == [f"pair-{i}" for i in range(3)]
    assert all(h.shape == (SPEC.num_layers, SPEC.num_experts) and h.sum() > 0 for h in arrived.values())
    assert sorted(r for _, d in seen for r in d) == sorted(arrived) and stats.prefetches > 0
