"""Tiered expert memory in the cluster spec, the CLI and the cluster's expert summary (no Ray: the summary's
aggregation runs on a stand-in cluster)."""

from __future__ import annotations

import types

import pytest

from cluster.cli.main import build_parser
from cluster.control.disagg import DisaggCluster
from cluster.control.spec import ClusterSpec
from engine.errors import InvalidRequestError


def test_spec_fields_and_validation(tiny_model_dir, tiny_ckpt):
    spec = ClusterSpec(model_dir=str(tiny_model_dir), expert_resident=0.25, expert_cache_policy="lru")
    assert spec.tier_config() == {"resident": 0.25, "policy": "lru", "scope": "global", "max_inflight": 4,
                                  "copy_s": 0.0}
    assert ClusterSpec(model_dir=str(tiny_model_dir)).tier_config() is None  # all resident by default
    assert ClusterSpec(model_dir=str(tiny_model_dir), expert_resident=3).tier_config()["resident"] == 3
    for kw, match in [({"expert_resident": 0.0}, "fraction"), ({"expert_resident": 1.5}, "fraction"),
                      ({"expert_resident": 0}, "count"), ({"expert_resident": 9}, "exceeds"),
                      ({"expert_resident": 0.5, "expert_cache_policy": "belady"}, "expert_cache_policy"),
                      ({"expert_cache_policy": "fifo"}, "expert_cache_policy"),
                      ({"expert_resident": 0.5, "num_decode": 2, "expert_parallel": 2}, "expert_parallel")]:
        with pytest.raises(InvalidRequestError, match=match):
            ClusterSpec(model_dir=str(tiny_model_dir), **kw)
    with pytest.raises(InvalidRequestError, match="MoE"):
        ClusterSpec(model_dir=str(tiny_ckpt(text="qwen3")), expert_resident=0.5)


def test_cli_options():
    p = build_parser()
    args = p.parse_args(["generate", "--prompt", "hi", "--mode", "disagg", "--expert-resident", "0.25",
                         "--expert-cache-policy", "lru"])
    assert (args.expert_resident, args.expert_cache_policy) == (0.25, "lru")
    assert p.parse_args(["generate", "--prompt", "hi", "--expert-resident", "2"]).expert_resident == 2
    assert p.parse_args(["generate", "--prompt", "hi"]).expert_resident is None
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "--prompt", "hi", "--expert-resident", "most"])


def test_expert_summary_sums_the_decode_workers_prewarm_counts():
    from cluster.control.cluster_ops import expert_summary

    rows = [{"role": "decode", "expert_tiers": {"expert_hits": 7, "stalled_loads": 2}},
            {"role": "decode", "expert_tiers": {"expert_hits": 5, "stalled_loads": 1}}, {"role": "decode"}]
    assert expert_summary([], rows) == {"placement_changes": 0, "balancedness": None, "prewarm_hits": 12,
                                        "prewarm_misses": 3}
    assert expert_summary([], None) is None  # neither expert parallelism nor tiers
    routers = [{"placement_changes": 2, "balancedness": 0.5}, {"placement_changes": 1, "balancedness": None},
               {"placement_changes": 0, "balancedness": 0.9}]
    assert expert_summary(routers, None) == {"placement_changes": 3, "balancedness": pytest.approx(0.7),
                                             "prewarm_hits": None, "prewarm_misses": None}
