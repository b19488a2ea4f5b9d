"""How many threads a prefill worker runs and at what priority (:func:`cluster.control.worker_pool.prefill_threads`):
pure, no Ray."""

from __future__ import annotations

import pytest

from cluster.control.spec import PREFILL_NICE, ClusterSpec, shared_core_options
from cluster.control.worker_pool import prefill_threads
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


def test_only_a_prefill_worker_sharing_cores_sleeps_its_idle_openmp_threads(tiny_model_dir):
    shared = prefill_threads(ClusterSpec(model_dir=str(tiny_model_dir)), nodes=1, cores=2)
    assert shared_core_options(shared) == {"runtime_env": {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}}
    own = prefill_threads(ClusterSpec(model_dir=str(tiny_model_dir), pin_cpus=True), nodes=1, cores=2)
    assert shared_core_options(own) == {}


@pytest.mark.parametrize("name", ["prefill_threads", "decode_threads"])
def test_thread_counts_are_validated(tiny_model_dir, name):
    with pytest.raises(InvalidRequestError, match=name):
        ClusterSpec(model_dir=str(tiny_model_dir), **{name: 0})
