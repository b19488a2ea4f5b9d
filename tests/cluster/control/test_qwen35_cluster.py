"""Qwen3.5-MoE on Ray actors: prefill and decode workers linked over gloo and gRPC hand each request's GDN state
over beside its KV. Greedy tokens equal the local engine's; ``kv_transfer`` reports KV bytes and state bytes apart; a
corrupted state frame fails the first attempt with ChecksumMismatch and the retry is exact; a repeated prompt hits the
prefill worker's prefix cache (KV and GDN state snapshot) and the router predicts it; a decode worker killed while state frames are in flight costs one retry; no block or state slot is
left on any worker."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.control.disagg import DisaggCluster
from engine import LLM
from duet_testing.qwen35_checkpoints import make_tiny_qwen35_checkpoint
from tests.cluster.control.test_qwen_disagg import TRANSPORTS, _assert_idle, _spec
from tests.conftest import greedy
from tests.engine.test_qwen_vl import SIZES, build_prompt, image, request

CFG = dict(dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_qwen35_checkpoint(tmp_path_factory.mktemp("qwen35-cluster") / "ckpt")


@pytest.fixture(scope="module")
def prompts(ckpt) -> list[dict]:
    ims = [image(50 + i, SIZES[s]) for i, s in enumerate(["100x61", "47x133"])]
    return [request(build_prompt(ims, ckpt, seed=1), ims), request(build_prompt([], ckpt, seed=2, text=12), [])]


@pytest.fixture(scope="module")
def reference(ckpt, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in LLM(ckpt, **CFG).generate(prompts, greedy(8))]


@pytest.mark.parametrize("transport", TRANSPORTS, ids=TRANSPORTS)
def test_cluster_matches_local_and_reports_state_bytes_apart(ray_cluster, ckpt, prompts, reference, transport):
    """Each prompt twice: the second time the prefill worker's prefix cache restores its KV and GDN state snapshot
    (cached tokens reported by the worker and predicted by the front-end's router) and the decode side still gets
    every KV block and the final state: the same tokens."""
    import ray

    from node_common import messages

    c = DisaggCluster(_spec(ckpt, transport=transport))
    try:
        t = LLM(ckpt, **CFG).engine.model_config.text
        state = t.state_bytes_per_seq(torch.float32)
        for rnd in range(2):
            got = c.generate_batch(prompts, greedy(8))
            assert [g.token_ids for g in got] == reference and all(g.attempts == 1 for g in got)
            for g, p in zip(got, prompts, strict=True):
                kv = g.kv_transfer
                assert kv["layers"] == 1 and kv["state_frames"] == 3 and kv["state_bytes"] == state
                blocks = -(-len(p["prompt_token_ids"]) // 4)
                assert kv["bytes"] == blocks * 4 * t.kv_bytes_per_token(torch.float32)
            rows = c.status()
            summary = c.prefix_summary(rows)
            hittable = sum((len(p["prompt_token_ids"]) - 1) // 4 * 4 for p in prompts)
            assert summary["cached_tokens"] == (hittable if rnd else 0), summary
        assert summary["off_reason"] is None and summary["hit_rate"] > 0.4
        assert summary["predicted_cached_tokens"] == hittable  # the router knew where the hits end
        ends = c.prefills[0].prefix_ends  # the worker's reports say after which blocks it keeps a GDN snapshot
        assert ends is not None and len(ends) >= len(prompts)
        assert c.kv_memory_summary(rows)["state_bytes"] > 0
        stats = messages.unpack(ray.get(c.decodes[0].actor.stats.remote()))
        assert stats["kv_state_bytes"] > 0
        _assert_idle(c)
    finally:
        c.shutdown()


def test_corrupted_state_frame_is_retried_exactly(ray_cluster, ckpt, prompts, reference):
    """The first GDN layer comes first on the wire: the fault flips a byte of its state frame."""
    import ray

    c = DisaggCluster(_spec(ckpt, num_prefill=1))
    try:
        ray.get(c.prefills[0].actor.inject_fault.remote("corrupt_next", 1))
        got = c.generate_batch(prompts[:1], greedy(8))[0]
        assert got.attempts == 2 and got.token_ids == reference[0]
        _assert_idle(c)
    finally:
        c.shutdown()


def test_decode_killed_while_state_frames_are_in_flight_is_retried_and_nothing_is_held(ray_cluster, ckpt, prompts,
                                                                                      reference):
    """0.4 s per layer on prefill and the decode worker killed 0.6 s after placement: the first GDN layer's state
    frame is sent, the others are not yet computed. The request is retried on the other decode worker; the prefill
    worker and the survivor hold no block or state slot."""
    import time

    import ray

    from tests.cluster.control.test_disagg import _start, _wait_assigned

    c = DisaggCluster(_spec(ckpt, num_decode=2, lease_base_s=3.0))
    try:
        ray.get(c.prefills[0].actor.inject_fault.remote("layer_delay_s", 0.4))
        fut = _start(c, prompts[1], greedy(8))
        victim = _wait_assigned(c)
        time.sleep(0.6)
        ray.kill(next(w.actor for w in c.decodes if w.load.worker_id == victim))
        got = fut.result(timeout=90)
        assert got.attempts == 2 and got.token_ids == reference[1]
        ray.get(c.prefills[0].actor.inject_fault.remote("layer_delay_s", 0.0))
        _assert_idle(c)
    finally:
        c.shutdown()
