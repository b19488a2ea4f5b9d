"""Expert parallelism in one process: ranks are threads over a real gloo group (no Ray).

The dispatch/combine maths equals the dense :class:`engine.moe.SparseMoe` forward (replicas, an empty rank, a
placement with a hot expert replicated three times); decode workers in lockstep give the local engine's greedy
tokens before, during and after a placement change; experts are read from the checkpoint per slot in every layout.
"""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest
import torch

from decode_node.expert_dispatch import LayerRoute, SlotWeights, run_layer
from decode_node.expert_group import ExpertGroup, GroupUnavailable, host_store
from decode_node.expert_parallel import ExpertParallelConfig
from decode_node.expert_shard import LoadWindow
from decode_node.expert_slots import (
    InvalidPlacement,
    SlotTable,
    balancedness,
    predicted_worker_load,
)
from decode_node.expert_weights import ExpertWeightSource
from decode_node.worker import DecodeWorker
from engine import LLM, EngineConfig
from engine.config import ModelConfig
from engine.errors import InvalidRequestError
from engine.moe import SparseMoe
from kv_transfer.inproc.manager import Manager as InprocManager
from tests.conftest import LLM_DEFAULTS, assert_no_leaked_blocks, greedy, make_request

CPU = torch.device("cpu")


def in_group(world: int, fn, timeout_s: float = 60.0) -> list:
    """Run ``fn(rank, group)`` on ``world`` threads joined in one gloo group; returns the results by rank."""
    store = host_store()
    key, results, errors = uuid.uuid4().hex, {}, {}

    def run(rank: int) -> None:
        try:
            group = ExpertGroup(host="127.0.0.1", port=store.port, rank=rank, world=world, group_key=key,
                                device=CPU, timeout_s=20)
            results[rank] = fn(rank, group)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors[rank] = e

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise next(iter(errors.values()))
    assert len(results) == world, "a rank did not finish"
    return [results[r] for r in range(world)]


# ----------------------------------------------------------------------------------------------------- slot table
def test_slot_table_worked_example():
    t = SlotTable.round_robin(num_layers=1, workers=2, slots_per_worker=3, num_experts=4)
    assert t.slots[0].tolist() == [[0, 1, 2], [3, 0, 1]]
    table, counts = t.replicas(0)
    assert table.tolist() == [[0, 4], [1, 5], [2, 2], [3, 3]] and counts.tolist() == [2, 2, 1, 1]
    assert SlotTable.from_wire(t.with_version(3).to_wire()).slots.tolist() == t.slots.tolist()
    moved = SlotTable(np.array([[[0, 1, 2], [3, 3, 1]]]), 4, 1)
    assert moved.changed_slots(t, 1) == [(0, 1)] and moved.changed_slots(t, 0) == []
    # expert 0 carries 6 tokens, the rest 2: two replicas of 0 balance the workers
    load = np.array([[6.0, 2.0, 2.0, 2.0]])
    assert predicted_worker_load(t, load).tolist() == [[3 + 1 + 2, 2 + 3 + 1]]
    assert balancedness(np.array([[6.0, 6.0], [2.0, 4.0], [0.0, 0.0]])) == pytest.approx((1 + 0.75) / 2)


@pytest.mark.parametrize("slots", [[[[0, 1], [2, 2]]], [[0, 1, 2, 3]], [[[0, 1], [2, 9]]]],
                         ids=["missing-expert", "wrong-rank", "unknown-id"])
def test_slot_table_rejects_bad_tables(slots):
    with pytest.raises(InvalidPlacement):
        SlotTable(np.array(slots), 4)


def test_round_robin_needs_enough_slots():
    with pytest.raises(InvalidPlacement):
        SlotTable.round_robin(num_layers=1, workers=2, slots_per_worker=3, num_experts=8)


def test_load_window_slides_over_whole_buckets():
    w = LoadWindow(1, 2, CPU, bucket_ticks=2, buckets=2)
    for i in range(7):  # buckets [0, 1], [2, 3], [4, 5] (the oldest slides out), then 6 in the open bucket
        w.add(0, torch.tensor([i, 1]))
        w.tick()
    assert w.total().tolist() == [[2 + 3 + 4 + 5 + 6, 5]]
    assert w.lifetime().tolist() == [[21, 7]]


# ------------------------------------------------------------------------------------------------- dispatch maths
def _dense_moe(model_dir) -> SparseMoe:
    cfg = ModelConfig.from_pretrained(model_dir).text
    torch.manual_seed(0)
    moe = SparseMoe(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    return moe.eval()


HOT = np.array([[[0, 1, 0, 2], [0, 3, 4, 5], [6, 7, 1, 2]]])  # expert 0 thrice, 1 and 2 twice; 3 workers x 4 slots


@pytest.mark.parametrize("world,table", [
    (2, SlotTable.round_robin(num_layers=1, workers=2, slots_per_worker=5, num_experts=8)),
    (3, SlotTable.round_robin(num_layers=1, workers=3, slots_per_worker=3, num_experts=8)),
    (3, SlotTable(HOT, 8)),
], ids=["2x5-replicas", "3x3", "3x4-hot-replicas"])
def test_dispatch_combine_equals_dense_moe(tiny_model_dir, world, table):
    moe = _dense_moe(tiny_model_dir)
    xs = [torch.randn(t, moe.gate.in_features, generator=torch.Generator().manual_seed(t)) for t in (7, 0, 4)[:world]]
    with torch.no_grad():
        expected = [moe(x) for x in xs]

    def rank_fn(rank: int, group: ExpertGroup):
        held = table.worker_experts(rank)[0].tolist()
        all_gu, all_down = moe.expert_weights()
        local = SlotWeights(all_gu[held].detach().clone(), all_down[held].detach().clone())
        with torch.no_grad():
            weights, experts = moe.route(xs[rank])
            return run_layer(group, xs[rank], weights, experts, LayerRoute.from_table(table, 0, CPU), local, moe.act)

    results = in_group(world, rank_fn)
    for got, want in zip(results, expected, strict=True):
        torch.testing.assert_close(got.out, want, rtol=1e-5, atol=1e-6)
    rows = torch.stack([r.slot_rows for r in results])
    assert int(rows.sum()) == sum(len(x) for x in xs) * moe.top_k


# ------------------------------------------------------------------------------------------------ expert weights
@pytest.mark.parametrize("layout", ["hf", "fused"])
@pytest.mark.parametrize("text", ["qwen3_moe", "mixtral"])
def test_expert_weights_read_per_slot_match_the_loaded_model(tiny_ckpt, layout, text):
    model_dir = tiny_ckpt(text=text, layout=layout)
    llm = LLM(model_dir, **LLM_DEFAULTS)
    moe = llm.engine.model.text.layers[1].mlp
    gu, down = ExpertWeightSource(model_dir, dtype=torch.float32).read(1, [5, 2, 5])
    all_gu, all_down = moe.expert_weights()  # rebuilt from packed CPU kernels where the engine packed them
    assert torch.equal(gu, all_gu[[5, 2, 5]]) and torch.equal(down, all_down[[5, 2, 5]])


# ------------------------------------------------------------------------------------------- lockstep decode group
CFG = dict(dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128)


def _reference(model_dir, prompts, params):
    llm = LLM(model_dir, **{**LLM_DEFAULTS, **CFG})
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _decode_group(model_dir, world: int, slots: int, prompts, params, new_table: SlotTable | None, change_at: int):
    """``world`` decode workers in lockstep; requests are dealt round-robin and prefilled on their worker. At tick
    ``change_at`` every rank is asked to stage ``new_table``. Returns (tokens by request, per-rank switch records,
    workers)."""
    workers = [DecodeWorker(model_dir, EngineConfig(**CFG), InprocManager(),
                            expert_parallel=ExpertParallelConfig(rank=r, world=world, slots_per_worker=slots))
               for r in range(world)]
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        workers[i % world].engine.add_request(f"r{i}", p, sp)

    def rank_fn(rank: int, group: ExpertGroup):
        w = workers[rank]
        w.ep.join(group)
        tokens = {}
        for _ in range(500):
            if group.tick == change_at and new_table is not None:
                w.ep.apply_placement(new_table)
                w.ep.shard.wait_staged(10)  # makes the switch tick deterministic for the assertion below
            report, plan = w.group_step()
            assert plan is not None, w.ep.broken
            tokens.update({o.request_id: o.outputs[0].token_ids for o in report.outputs})
            if not plan.any_work:
                return tokens, w.ep.switches
        raise AssertionError("group did not finish")

    results = in_group(world, rank_fn)
    tokens = {k: v for t, _ in results for k, v in t.items()}
    return [tokens[f"r{i}"] for i in range(len(prompts))], [s for _, s in results], workers


@pytest.mark.parametrize("world,slots", [(2, 4), (4, 3)], ids=["2-workers", "4-workers-spare-slots"])
def test_decode_group_matches_local_through_a_placement_change(tiny_model_dir, world, slots):
    prompts = [make_request(5 + i, seed=20 + i) for i in range(world + 1)]
    params = [greedy(10 + 2 * i) for i in range(world + 1)]
    rng = np.random.default_rng(0)
    shuffled = np.stack([rng.permutation(np.arange(world * slots) % 8).reshape(world, slots) for _ in range(2)])
    new = SlotTable(shuffled, 8, version=1)
    got, switches, workers = _decode_group(tiny_model_dir, world, slots, prompts, params, new, change_at=4)
    assert got == _reference(tiny_model_dir, prompts, params)
    # every rank switched at the same tick, mid-generation, to the new placement
    assert {tuple((s["version"], s["tick"]) for s in sw) for sw in switches} == {((1, 4),)}
    assert sum(s[0]["running"] for s in switches) > 0
    for w in workers:
        assert w.ep.shard.active.table.version == 1
        assert w.ep.shard.slots_loaded == len(new.changed_slots(SlotTable.round_robin(
            num_layers=2, workers=world, slots_per_worker=slots, num_experts=8), w.ep.rank))
        assert_no_leaked_blocks(w.engine)
    stats = [w.ep.stats() for w in workers]
    total = sum(np.asarray(s["slot_rows"]).sum() for s in stats)
    assert total == sum(np.asarray(s["expert_load"]).sum() for s in stats) > 0


def test_placement_of_another_shape_or_version_is_rejected(tiny_model_dir):
    w = DecodeWorker(tiny_model_dir, EngineConfig(**CFG), InprocManager(),
                     expert_parallel=ExpertParallelConfig(rank=0, world=2, slots_per_worker=4))
    with pytest.raises(InvalidPlacement):
        w.ep.apply_placement(SlotTable.round_robin(num_layers=2, workers=2, slots_per_worker=5, num_experts=8,
                                                   version=1))
    with pytest.raises(InvalidPlacement):
        w.ep.apply_placement(SlotTable.round_robin(num_layers=2, workers=2, slots_per_worker=4, num_experts=8))


def test_dense_model_cannot_be_expert_parallel(tiny_ckpt):
    with pytest.raises(InvalidRequestError):
        DecodeWorker(tiny_ckpt(text="qwen3"), EngineConfig(**CFG), InprocManager(),
                     expert_parallel=ExpertParallelConfig(rank=0, world=2, slots_per_worker=4))


def test_group_join_has_a_deadline():
    store = host_store()
    with pytest.raises(GroupUnavailable):
        ExpertGroup(host="127.0.0.1", port=store.port, rank=0, world=2, group_key="alone", device=CPU, timeout_s=1)
