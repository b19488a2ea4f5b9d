"""Expert-parallel decode groups on a local Ray cluster: greedy tokens equal the local engine's (float32) across 2
and 4 decode workers before, during and after a placement change forced mid-generation; the CLI reports the
group's expert figures; bad configurations are typed errors; no worker holds a KV block after."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import numpy as np
import pytest

from cluster.cli.main import main
from cluster.control.disagg import DisaggCluster
from cluster.control.spec import ClusterSpec
from cluster.experts.placement import align, balancedness, duet_placement
from engine import LLM
from engine.errors import InvalidRequestError
from node_common.messages import unpack
from tests.conftest import greedy, make_image, make_request

LOCAL = dict(dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128)


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def ep_cluster(request, ray_cluster, tiny_model_dir):
    world = request.param
    spec = ClusterSpec(model_dir=str(tiny_model_dir), num_prefill=1, num_decode=world, expert_parallel=world,
                       expert_slots_per_worker=8 // world + 1, expert_rebalance_s=0, transport="gloo",
                       num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128, cpus_per_worker=1,
                       request_timeout_s=60)
    c = DisaggCluster(spec)
    yield c
    c.shutdown()


def _local(model_dir, prompts, params):
    llm = LLM(model_dir, **LOCAL)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _group_stats(cluster) -> list[dict]:
    import ray

    return [unpack(ray.get(w.actor.stats.remote(), timeout=30)) for w in cluster.decodes]


def _wait_running(cluster, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while sum(s["running"] for s in _group_stats(cluster)) == 0:
        assert time.monotonic() < end, "no request started decoding"
        time.sleep(0.01)


def test_tokens_match_local_before_during_and_after_a_placement_change(ep_cluster, tiny_model_dir):
    world = ep_cluster.spec.expert_parallel
    prompts = [make_request(5 + i, seed=40 + i, images=[make_image(i)] * (i % 2)) for i in range(world + 1)]
    params = [greedy(60 - 4 * i) for i in range(world + 1)]
    router = ep_cluster.expert_routers[0]
    out: dict = {}
    gen = threading.Thread(target=lambda: out.update(got=ep_cluster.generate_batch(prompts, params)))
    gen.start()
    _wait_running(ep_cluster)
    skew = np.array([[40.0, 1, 1, 1, 9, 1, 1, 1], [1.0, 1, 30, 1, 1, 1, 12, 1]])  # one load row per MoE layer
    new = align(duet_placement(skew, router.current.workers, router.current.slots_per_worker), router.current)
    assert router.apply(new, wait_s=30)
    gen.join(60)
    assert [c.token_ids for c in out["got"]] == _local(tiny_model_dir, prompts, params)
    stats = [s["experts"] for s in _group_stats(ep_cluster)]
    # one switch, at the same tick on every rank, while requests were decoding
    assert len({(sw["version"], sw["tick"]) for s in stats for sw in s["switches"]}) == 1
    assert sum(sw["running"] for s in stats for sw in s["switches"]) > 0
    assert all(s["version"] == router.version for s in stats)
    # after the change: a fresh batch decodes on the new placement alone
    after = ep_cluster.generate_batch(prompts[:2], params[:2])
    assert [c.token_ids for c in after] == _local(tiny_model_dir, prompts[:2], params[:2])
    summary = ep_cluster.expert_summary()
    assert summary["placement_changes"] == 1 and 0 < summary["balancedness"] <= 1
    held = ep_cluster.check_no_leaks()
    assert held and all(v == 0 for v in held.values()), held


def test_rebalance_round_places_for_the_window_load(ep_cluster, tiny_model_dir):
    router = ep_cluster.expert_routers[0]
    g = router.collect()
    assert g.expert_load.shape == (2, 8) and g.expert_load.sum() > 0
    assert g.worker_rows.shape == (2, ep_cluster.spec.expert_parallel)
    # rows computed by the workers' slots == (token, expert) pairs routed by the workers
    assert g.worker_rows.sum() == g.expert_load.sum()
    assert g.hint_load.sum() > 0  # prefill's routing histograms of the arriving requests
    # a round on this load (told that moving pays) places for it and keeps decoding exact
    load = g.expert_load + g.hint_load
    before = balancedness(load, router.current)
    router.policy = dataclasses.replace(router.policy, min_tokens=1, step_s=1.0)
    assert router.rebalance(wait_s=30)
    assert balancedness(load, router.current) > before
    prompt = [make_request(7, seed=50)]
    assert [c.token_ids for c in ep_cluster.generate_batch(prompt, greedy(8))] == \
        _local(tiny_model_dir, prompt, greedy(8))


def test_cli_json_reports_experts(ray_cluster, tiny_model_dir, capsys):
    code = main(["generate", str(tiny_model_dir), "--token-ids", "253,5,6,7,8", "--max-tokens", "4", "--mode",
                 "disagg", "--decode", "2", "--expert-parallel", "2", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["token_ids"] == _local(tiny_model_dir, [{"prompt_token_ids": [253, 5, 6, 7, 8]}],
                                         greedy(4, ignore_eos=False))[0]
    experts = result["experts"]
    assert set(experts) == {"placement_changes", "balancedness", "prewarm_hits", "prewarm_misses"}
    assert experts["placement_changes"] == 0 and 0 < experts["balancedness"] <= 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_decode=2, expert_parallel=3), "must divide"),
    (dict(num_decode=4, expert_parallel=0), ">= 1"),
    (dict(num_decode=2, expert_parallel=2, expert_slots_per_worker=3), "cannot hold 8 experts"),
    (dict(num_decode=2, expert_slots_per_worker=4), "needs expert_parallel"),
], ids=["not-a-divisor", "zero", "too-few-slots", "slots-without-ep"])
def test_bad_expert_parallel_config_is_a_typed_error(tiny_model_dir, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        ClusterSpec(model_dir=str(tiny_model_dir), **kwargs)


def test_dense_model_cannot_be_expert_parallel(tiny_ckpt):
    with pytest.raises(InvalidRequestError, match="needs an MoE model"):
        ClusterSpec(model_dir=str(tiny_ckpt(text="qwen3")), num_decode=2, expert_parallel=2)


def test_expert_parallel_is_a_disagg_option(tiny_model_dir, capsys):
    assert main(["generate", str(tiny_model_dir), "--token-ids", "1,2", "--expert-parallel", "2"]) == 2
    assert "--mode disagg" in capsys.readouterr().err
