"""Worker actors fail closed on the data plane: built for a cross-process transport without the cluster's secret,
they refuse to start (MissingSecret) unless ``insecure=True`` (what ``data_plane_auth: "off"`` passes) says so."""

from __future__ import annotations

import pytest

from decode_node.actor import DecodeActor
from kv_transfer.auth import MissingSecret
from prefill_node.actor import PrefillActor

CFG = dict(dtype="float32", num_kv_blocks=32, block_size=4, max_num_seqs=4, max_model_len=64)


@pytest.mark.parametrize("cls", [PrefillActor, DecodeActor], ids=["prefill", "decode"])
def test_no_secret_is_refused_unless_insecure_is_explicit(tiny_model_dir, cls):
    with pytest.raises(MissingSecret):
        cls(f"{cls.__name__}-nosecret", str(tiny_model_dir), CFG, "grpc")
    actor = cls(f"{cls.__name__}-insecure", str(tiny_model_dir), CFG, "grpc", insecure=True)
    try:
        assert actor.manager.refused() == {}
    finally:
        actor.shutdown()
