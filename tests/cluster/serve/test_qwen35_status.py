"""ClusterStatus (gRPC) of a hybrid model: GDN state bytes per worker and in total, its prefix cache's hit rate, and
why prefix caching is off when it is (``state_snapshots=0``); each prefill worker's vision cache bytes; each worker's
pool regions (plain text KV, coded image KV)."""

from __future__ import annotations

from cluster.control import cluster_ops
from cluster.serve.grpc_api import status_to_proto

REASON = "hybrid model with state_snapshots=0: a prefix hit needs the GDN layers' state after it"


def _status(rows: list[dict]) -> dict:
    return {"model": "m", "transport": "gloo", "workers": rows, "in_flight": 0, "max_concurrent": 8, "kv_usage": 0.0,
            "experts": {}, "requests_served": 3, "draining": False, "prefix_cache": cluster_ops.prefix_summary(rows),
            "kv_memory": cluster_ops.kv_memory_summary(rows),
            "healing": {"respawns": {"prefill": 0, "decode": 0}, "given_up": {"prefill": [], "decode": []},
                        "respawning": []}}


def test_cluster_status_reports_state_bytes_and_the_prefix_cache_reason():
    rows = [{"worker_id": "prefill-0", "role": "prefill", "alive": True, "kv_pool_bytes": 100, "kv_mirror_bytes": 10,
             "kv_state_bytes": 7, "prefix_cache_off": REASON, "prompt_tokens": 40, "cached_tokens": 0},
            {"worker_id": "decode-0", "role": "decode", "alive": True, "kv_pool_bytes": 200, "kv_mirror_bytes": 20,
             "kv_state_bytes": 9}]
    st = status_to_proto(_status(rows))
    assert st.kv_state_bytes == 16 and st.kv_memory_bytes == 100 + 10 + 7 + 200 + 20 + 9
    assert st.prefix_cache_off_reason == REASON and st.prefix_hit_rate == 0.0
    assert [w.kv_state_bytes for w in st.workers] == [7, 9] and st.workers[0].prefix_cache_off == REASON
    assert st.workers[1].prefix_cache_off == ""


def test_cluster_status_reports_a_hybrid_prefix_caches_hits():
    rows = [{"worker_id": "prefill-0", "role": "prefill", "alive": True, "kv_pool_bytes": 100, "kv_mirror_bytes": 0,
             "kv_state_bytes": 7, "prefix_cache_off": None, "prompt_tokens": 40, "cached_tokens": 30}]
    st = status_to_proto(_status(rows))
    assert st.prefix_cache_off_reason == "" and st.workers[0].prefix_cache_off == ""
    assert abs(st.prefix_hit_rate - 0.75) < 1e-6


def test_cluster_status_reports_each_workers_vision_cache_bytes():
    rows = [{"worker_id": "prefill-0", "role": "prefill", "alive": True, "kv_pool_bytes": 100, "kv_mirror_bytes": 0,
             "vision_cache_bytes": 48, "vision_cache_entries": 2},
            {"worker_id": "decode-0", "role": "decode", "alive": True, "kv_pool_bytes": 200, "kv_mirror_bytes": 20}]
    st = status_to_proto(_status(rows))
    assert [w.vision_cache_bytes for w in st.workers] == [48, 0]
    assert st.kv_memory_bytes == 100 + 200 + 20  # the cache's blocks are part of the pool's bytes
    assert cluster_ops.kv_memory_summary(rows)["vision_cache_bytes"] == 48  # the HTTP status's kv_memory


def test_cluster_status_reports_each_workers_pool_regions():
    rows = [{"worker_id": "prefill-0", "role": "prefill", "alive": True, "kv_pool_bytes": 100, "kv_text_bytes": 30,
             "kv_visual_bytes": 0, "encoder_workspace_bytes": 25},
            {"worker_id": "decode-0", "role": "decode", "alive": True, "kv_pool_bytes": 200, "kv_text_bytes": 40,
             "kv_visual_bytes": 60},
            {"worker_id": "decode-1", "role": "decode", "alive": False, "kv_pool_bytes": 200, "kv_visual_bytes": 9}]
    st = status_to_proto(_status(rows))
    assert [(w.kv_text_bytes, w.kv_visual_bytes) for w in st.workers] == [(30, 0), (40, 60), (0, 9)]
    summary = cluster_ops.kv_memory_summary(rows)  # the HTTP status's kv_memory: alive workers only
    assert summary["text_kv_bytes"] == 70 and summary["visual_kv_bytes"] == 60 and summary["pool_bytes"] == 300
    assert st.workers[0].encoder_workspace_bytes == summary["encoder_workspace_bytes"] == 25
