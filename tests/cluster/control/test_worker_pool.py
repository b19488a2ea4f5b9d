"""How many threads a prefill worker runs and at what priority (:func:`cluster.control.spec.prefill_threads`),
and which text prompts the decode workers prefill themselves (:func:`cluster.control.spec.local_prefill`): pure, no
Ray."""

from __future__ import annotations

import pytest

from cluster.control.spec import (
    LOCAL_PREFILL_TOKENS,
    PREFILL_NICE,
    VISION_SLICE_S,
    ClusterSpec,
    NodeShare,
    decode_threads,
    local_prefill,
    prefill_threads,
)
from cluster.control.admission import PrefillAdmission
from engine.errors import InvalidRequestError


def test_a_one_node_cpu_cluster_gives_prefill_every_core_below_decode(tiny_model_dir):
    spec = ClusterSpec(model_dir=str(tiny_model_dir))
    assert prefill_threads(spec, nodes=1, cores=2) == {"num_threads": 2, "nice": PREFILL_NICE, "adaptive_threads": True}
    two = ClusterSpec(model_dir=str(tiny_model_dir), num_prefill=2, num_decode=2)
    assert prefill_threads(two, nodes=1, cores=8) == {"num_threads": 4, "nice": PREFILL_NICE, "adaptive_threads": True}
    assert prefill_threads(two, nodes=1, cores=1) == {"num_threads": 1, "nice": PREFILL_NICE, "adaptive_threads": False}
    fixed = ClusterSpec(model_dir=str(tiny_model_dir), prefill_adaptive_threads=False)
    assert prefill_threads(fixed, nodes=1, cores=2)["adaptive_threads"] is False


@pytest.mark.parametrize("kw,nodes", [({"pin_cpus": True}, 1), ({"gpus_per_worker": 1.0}, 1), ({}, 3),
                                      ({"prefill_threads": 3}, 1)], ids=["pinned", "gpu", "multi-node", "set"])
def test_otherwise_the_spec_says(tiny_model_dir, kw, nodes):
    spec = ClusterSpec(model_dir=str(tiny_model_dir), cpus_per_worker=2, **kw)
    want = kw.get("prefill_threads", 2)
    assert prefill_threads(spec, nodes=nodes, cores=16) == {"num_threads": want, "nice": 0, "adaptive_threads": False}


def test_the_vision_tower_is_sliced_only_where_text_prompts_reach_the_prefill_workers(tiny_model_dir):
    spec = ClusterSpec(model_dir=str(tiny_model_dir))
    shared = NodeShare.plan(spec, nodes=1)
    try:
        local = shared.local_prefill
        _, kw = shared.actor_args(spec, "prefill", secret=None, cpus=None)
        assert ("vision_slice_s" in kw["engine_config"]) == (local == 0)  # 0 on a host of one core per worker
    finally:
        shared.close()
    assert spec.vision_slice(local_prefill=512) is None and spec.vision_slice(local_prefill=0) == VISION_SLICE_S
    assert "vision_slice_s" not in spec.engine_config("prefill", local_prefill=512)
    assert spec.engine_config("prefill", local_prefill=0)["vision_slice_s"] == VISION_SLICE_S
    mine = ClusterSpec(model_dir=str(tiny_model_dir), prefill_vision_slice_s=0.1)
    assert mine.engine_config("prefill", local_prefill=512)["vision_slice_s"] == 0.1  # set: kept
    assert PrefillAdmission(spec, local_prefill=512).text_lane is False


@pytest.mark.parametrize("name", ["prefill_threads", "decode_threads"])
def test_thread_counts_are_validated(tiny_model_dir, name):
    with pytest.raises(InvalidRequestError, match=name):
        ClusterSpec(model_dir=str(tiny_model_dir), **{name: 0})


def test_decode_workers_prefill_short_text_prompts_where_the_cores_are_shared(tiny_model_dir):
    spec = ClusterSpec(model_dir=str(tiny_model_dir))
    assert local_prefill(spec, nodes=1, cores=2) == LOCAL_PREFILL_TOKENS
    assert decode_threads(spec, nodes=1, cores=2) == {"num_threads": 1, "max_threads": 2, "adaptive_threads": True}
    mine = ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=100, decode_adaptive_threads=False)
    assert local_prefill(mine, nodes=1, cores=4) == 100
    assert decode_threads(mine, nodes=1, cores=4) == {"num_threads": 1, "max_threads": 4, "adaptive_threads": False}
    off = ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=0, decode_adaptive_threads=False)
    assert local_prefill(off, nodes=1, cores=2) == 0
    assert decode_threads(off, nodes=1, cores=2) == {"num_threads": 1, "max_threads": 1, "adaptive_threads": False}
    two = ClusterSpec(model_dir=str(tiny_model_dir), num_decode=2)
    assert decode_threads(two, nodes=1, cores=2)["max_threads"] == 1  # a core each already


@pytest.mark.parametrize("kw,nodes", [({"pin_cpus": True}, 1), ({"gpus_per_worker": 1.0}, 1), ({}, 3),
                                      ({"prefill_threads": 1}, 1), ({"num_decode": 2, "expert_parallel": 2}, 1),
                                      ({"expert_resident": 0.5}, 1), ({"decode_threads": 1}, 1)],
                         ids=["pinned", "gpu", "multi-node", "prefill-threads-set", "expert-parallel", "tiered",
                              "decode-threads-set"])
def test_elsewhere_prompts_go_to_the_prefill_pool_and_decode_keeps_its_threads(tiny_model_dir, kw, nodes):
    spec = ClusterSpec(model_dir=str(tiny_model_dir), **kw)
    if "decode_threads" not in kw:
        assert local_prefill(spec, nodes=nodes, cores=2) == 0
    threads = decode_threads(spec, nodes=nodes, cores=2)
    if "expert_resident" not in kw:  # tiered experts: no local prefill, but its decode steps still widen
        assert threads["max_threads"] == threads["num_threads"] and not threads["adaptive_threads"]
    if "expert_parallel" not in kw and "expert_resident" not in kw:  # asked for: on, on the worker's own threads
        asked = ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=64, **kw)
        assert local_prefill(asked, nodes=nodes, cores=2) == 64


@pytest.mark.parametrize("bad", [-1, 1.5, "512", True])
def test_local_prefill_tokens_is_validated(tiny_model_dir, bad):
    with pytest.raises(InvalidRequestError, match="local_prefill_tokens"):
        ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=bad)


@pytest.mark.parametrize("name", ["decode_adaptive_threads", "prefill_adaptive_threads"])
def test_adaptive_switches_are_booleans(tiny_model_dir, name):
    with pytest.raises(InvalidRequestError, match=name):
        ClusterSpec(model_dir=str(tiny_model_dir), **{name: "yes"})


@pytest.mark.parametrize("bad", [-0.01, 0.5, "0.02", None])
def test_stream_interval_is_validated(tiny_model_dir, bad):
    with pytest.raises(InvalidRequestError, match="stream_interval_s"):
        ClusterSpec(model_dir=str(tiny_model_dir), stream_interval_s=bad)
