"""A cluster's decode workers keep received image KV coded (``visual_kv_cache``, engine.coded_kv) where the KV
compression policy codes visual KV on the wire and the workers run on CPU; prefill workers never do."""

from __future__ import annotations

from cluster.control.spec import ClusterSpec


def test_decode_workers_keep_image_kv_coded_where_the_policy_codes_it(tiny_model_dir):
    for policy, cache in (("none", "plain"), ("default", "int8"), ("aggressive", "int8")):
        spec = ClusterSpec(model_dir=str(tiny_model_dir), kv_compression=policy)
        assert spec.engine_config("decode")["visual_kv_cache"] == cache
        assert "visual_kv_cache" not in spec.engine_config("prefill")  # it prefills plain, codes at export
    mine = ClusterSpec(model_dir=str(tiny_model_dir), kv_compression="default",
                       extra_engine={"visual_kv_cache": "plain"})
    assert mine.engine_config("decode")["visual_kv_cache"] == "plain"
    gpu = ClusterSpec(model_dir=str(tiny_model_dir), kv_compression="default", gpus_per_worker=1)
    assert gpu.engine_config("decode")["visual_kv_cache"] == "plain"  # no GPU kernel reads the codes yet
