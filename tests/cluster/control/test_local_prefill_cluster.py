"""The default deployment on a host whose cores the workers share (``ClusterSpec.local_prefill_tokens`` unset, one CPU
node): a short text prompt is prefilled by its decode worker (no prefill worker, no KV transfer), a prompt with
images or a longer one by the prefill worker; both give the engine's tokens, the timeline says where each ran, and
nothing is held afterwards."""

from __future__ import annotations

import os

import pytest

from cluster.control.disagg import DisaggCluster
from cluster.control.spec import ClusterSpec
from tests.cluster.control.test_disagg import _assert_idle, _local
from tests.conftest import greedy, make_image, make_request


@pytest.fixture(scope="module")
def cluster(ray_cluster, tiny_model_dir):
    spec = ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=12, num_prefill=1, num_decode=1,
                       transport="gloo", num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128,
                       request_timeout_s=60)
    c = DisaggCluster(spec)
    yield c
    c.shutdown()


def test_short_text_prompts_prefill_on_the_decode_worker_the_rest_on_the_prefill_worker(cluster, tiny_model_dir):
    prompts = [make_request(8, seed=1), make_request(10, seed=2),  # local: <= 12 tokens each, 24 pending at most
               make_request(6, seed=3, images=[make_image(3)]),  # images: the prefill worker
               make_request(20, seed=4)]  # longer than 12 tokens: the prefill worker
    params = [greedy(5), greedy(4), greedy(3), greedy(6)]
    got = cluster.generate_batch(prompts, params)
    assert [c.token_ids for c in got] == _local(tiny_model_dir, prompts, params)
    where = [(c.timeline["prefill_worker"], c.kv_transfer["transport"]) for c in got]
    decode = got[0].timeline["decode_worker"]
    assert where[2] == ("prefill-0", "gloo") and where[3] == ("prefill-0", "gloo")
    assert got[2].kv_transfer["bytes"] > 0 and got[3].kv_transfer["bytes"] > 0
    # the two short ones: local (18 tokens pending at most, within twice the limit)
    assert where[:2] == [(decode, "local")] * 2
    for c in got[:2]:
        assert c.kv_transfer["bytes"] == 0 and c.timeline["ttft_breakdown"]["prefill_compute_s"] > 0
    assert all(c.attempts == 1 for c in got)
    assert all(w.lane is not None for w in cluster.decodes)  # same node: admitted and streamed over the lane
    _assert_idle(cluster)
    rows = {r["worker_id"]: r for r in cluster.status()}
    assert rows[decode]["local_steps"] >= 1
    if (os.cpu_count() or 1) >= 2:  # its steps widen to the node's idle cores while no prefill worker has work
        assert cluster.pool.share.decode["max_threads"] >= 2 and rows[decode]["wide_steps"] >= 1
    assert all(w.local_tokens == 0 for w in cluster.decodes)


def test_a_bad_text_prompt_is_a_typed_error_and_changes_nothing(cluster):
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        cluster.generate_batch([{"prompt_token_ids": [1, 2, 10_000]}], greedy(2))
    _assert_idle(cluster)
    assert all(w.local_tokens == 0 and w.inflight == 0 for w in cluster.decodes)


def test_without_the_lane_the_same_prompts_go_over_ray(ray_cluster, tiny_model_dir):
    """``fast_lane: false``: the local admission and the decode worker's events go over Ray calls; same tokens."""
    spec = ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=12, num_prefill=1, num_decode=1,
                       transport="gloo", num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128,
                       request_timeout_s=60, fast_lane=False)
    c = DisaggCluster(spec)
    try:
        prompts, params = [make_request(8, seed=1), make_request(20, seed=4)], [greedy(5), greedy(6)]
        got = c.generate_batch(prompts, params)
        assert [x.token_ids for x in got] == _local(tiny_model_dir, prompts, params)
        assert got[0].kv_transfer["transport"] == "local" and all(w.lane is None for w in c.decodes)
        _assert_idle(c)
    finally:
        c.shutdown()


def test_fast_lane_must_be_a_bool(tiny_model_dir):
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="fast_lane"):
        ClusterSpec(model_dir=str(tiny_model_dir), fast_lane="yes")
