"""Disaggregated serving on a local Ray cluster: prefill and decode actors, KV over gloo and gRPC.

Greedy tokens through ``--mode disagg`` equal the local engine's (float32), with and without images, one and several
concurrent requests; faults end with a typed error or a correct retried result, and no worker holds a block after.
"""

from __future__ import annotations

import pytest

from cluster.control.disagg import DisaggCluster
from cluster.control.spec import ClusterSpec
from engine import LLM
from engine.errors import DuetError, InvalidRequestError
from tests.conftest import greedy, make_image, make_request

TRANSPORTS = ["gloo", "grpc"]


@pytest.fixture(scope="module", params=TRANSPORTS, ids=TRANSPORTS)
def cluster(request, ray_cluster, tiny_model_dir):
    spec = ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=0,
                       num_prefill=1, num_decode=2, transport=request.param,
                       num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128, cpus_per_worker=1,
                       request_timeout_s=60)
    c = DisaggCluster(spec)
    yield c
    c.shutdown()


def _local(model_dir, prompts, params):
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _assert_idle(cluster):
    held = cluster.check_no_leaks()
    assert held and all(v == 0 for v in held.values()), held


def test_single_request_matches_local(cluster, tiny_model_dir):
    prompt = make_request(9, seed=1)
    got = cluster.generate_batch([prompt], greedy(6))[0]
    assert got.token_ids == _local(tiny_model_dir, [prompt], greedy(6))[0]
    assert got.finish_reason == "length" and got.kv_transfer["layers"] == 2 and got.kv_transfer["bytes"] > 0
    _assert_idle(cluster)


def test_concurrent_requests_with_images_match_local(cluster, tiny_model_dir):
    prompts = [make_request(5 + i, seed=10 + i, images=[make_image(i)] * (i % 3)) for i in range(5)]
    params = [greedy(3 + i) for i in range(5)]
    got = cluster.generate_batch(prompts, params)
    assert [c.token_ids for c in got] == _local(tiny_model_dir, prompts, params)
    assert all(c.attempts == 1 for c in got)
    assert cluster.clear_vision_caches() >= 3 and cluster.clear_vision_caches() == 0  # 3 distinct images encoded
    _assert_idle(cluster)


def test_bad_request_is_a_typed_error_and_changes_nothing(cluster):
    with pytest.raises(InvalidRequestError):
        cluster.generate_batch([{"prompt_token_ids": [1, 2, 10_000]}], greedy(2))
    _assert_idle(cluster)


def test_spec_is_validated(tiny_model_dir, tmp_path):
    with pytest.raises(InvalidRequestError):
        ClusterSpec(model_dir=str(tmp_path))
    with pytest.raises(InvalidRequestError):
        ClusterSpec(model_dir=str(tiny_model_dir), transport="carrier-pigeon")
    with pytest.raises(InvalidRequestError):
        ClusterSpec(model_dir=str(tiny_model_dir), num_decode=0)
    with pytest.raises(DuetError):
        ClusterSpec(model_dir=str(tiny_model_dir), transport="inproc")
    with pytest.raises(InvalidRequestError, match="prefill_max_batched_tokens"):
        ClusterSpec(model_dir=str(tiny_model_dir), prefill_max_batched_tokens=0)
    with pytest.raises(InvalidRequestError, match="prefill_vision_slice_s"):
        ClusterSpec(model_dir=str(tiny_model_dir), prefill_vision_slice_s=0)
    for bad in ("always", True, -1.0):
        with pytest.raises(InvalidRequestError, match="prefill_vision_slice_s"):
            ClusterSpec(model_dir=str(tiny_model_dir), prefill_vision_slice_s=bad)


def test_prefill_workers_run_the_vision_tower_in_slices_by_default(tiny_model_dir):
    spec = ClusterSpec(model_dir=str(tiny_model_dir))
    assert spec.engine_config("prefill")["vision_slice_s"] == 0.05 and "vision_slice_s" not in spec.engine_config("decode")
    off = ClusterSpec(model_dir=str(tiny_model_dir), prefill_vision_slice_s=None)
    assert "vision_slice_s" not in off.engine_config("prefill")
    mine = ClusterSpec(model_dir=str(tiny_model_dir), extra_engine={"vision_slice_s": 0.2})
    assert mine.engine_config("prefill")["vision_slice_s"] == 0.2  # an engine setting of one's own is kept
    # a decode worker never encodes an image: no vision cache taken off its KV budget, no tower loaded or tuned
    assert spec.engine_config("decode")["vision_cache_mb"] == 0 and spec.engine_config("decode")["vision_tower"] is False
    assert "vision_cache_mb" not in spec.engine_config("prefill") and "vision_tower" not in spec.engine_config("prefill")
    keep = ClusterSpec(model_dir=str(tiny_model_dir), extra_engine={"vision_tower": True})
    assert keep.engine_config("decode")["vision_tower"] is True  # kept where the config asks for it


def test_prefill_workers_can_take_their_own_step_budget(ray_cluster, tiny_model_dir):
    spec = ClusterSpec(model_dir=str(tiny_model_dir), max_num_batched_tokens=4096, prefill_max_batched_tokens=1100)
    assert spec.engine_config("prefill")["max_num_batched_tokens"] == 1100
    assert spec.engine_config("decode")["max_num_batched_tokens"] == 4096
    assert ClusterSpec(model_dir=str(tiny_model_dir)).engine_config("prefill")["max_num_batched_tokens"] == 4096
    # a budget smaller than the prompts: they are prefilled in chunks across steps, and stream the same KV
    spec = ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=0,
                       num_prefill=1, num_decode=1, num_kv_blocks=64, block_size=4,
                       max_num_seqs=8, max_model_len=128, cpus_per_worker=1, request_timeout_s=60,
                       prefill_max_batched_tokens=8)
    prompts = [make_request(20 + i, seed=30 + i, images=[make_image(i)] * (i % 2)) for i in range(3)]
    params = [greedy(4)] * 3
    c = DisaggCluster(spec)
    try:
        got = c.generate_batch(prompts, params)
        assert [x.token_ids for x in got] == _local(tiny_model_dir, prompts, params)
        _assert_idle(c)
    finally:
        c.shutdown()


# ------------------------------------------------------------------------------------------------------------ faults
@pytest.fixture
def fault_cluster(ray_cluster, tiny_model_dir):
    """A fresh 2 prefill + 2 decode cluster per test (faults kill workers); short leases."""
    spec = ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=0,
                       num_prefill=2, num_decode=2, transport="gloo",
                       num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128, cpus_per_worker=1,
                       request_timeout_s=60, lease_base_s=1.5)
    c = DisaggCluster(spec)
    yield c
    c.shutdown()


def _start(cluster, prompt, params):
    """Run one request in the background; returns a concurrent future of its Completion."""
    import asyncio

    return asyncio.run_coroutine_threadsafe(cluster._collect(prompt, params), cluster._loop)


def _wait_assigned(cluster, timeout_s=10.0):
    import time

    end = time.monotonic() + timeout_s
    while not cluster.streams.owners() and time.monotonic() < end:
        time.sleep(0.01)
    assert cluster.streams.owners(), "request was never placed"
    return next(iter(cluster.streams.owners().values()))


def test_corrupted_block_is_never_decoded_and_the_retry_is_correct(fault_cluster, tiny_model_dir):
    import ray

    prompt = make_request(10, seed=3)
    ray.get(fault_cluster.prefills[0].actor.inject_fault.remote("corrupt_next", 1))  # the router's first pick
    got = fault_cluster.generate_batch([prompt], greedy(5))[0]
    assert got.attempts == 2
    assert got.token_ids == _local(tiny_model_dir, [prompt], greedy(5))[0]
    _assert_idle(fault_cluster)


def test_expired_lease_ends_in_a_typed_error(fault_cluster):
    import ray

    from cluster.control.disagg import TransferFailedError

    ray.get([w.actor.inject_fault.remote("layer_delay_s", 2.0) for w in fault_cluster.prefills])
    with pytest.raises(TransferFailedError):
        fault_cluster.generate_batch([make_request(6, seed=4)], greedy(3))
    ray.get([w.actor.inject_fault.remote("layer_delay_s", 0.0) for w in fault_cluster.prefills])
    _assert_idle(fault_cluster)


def test_decode_killed_mid_transfer_is_retried_on_the_other(fault_cluster, tiny_model_dir):
    import time

    import ray

    prompt = make_request(8, seed=5)
    ray.get([w.actor.inject_fault.remote("layer_delay_s", 0.4) for w in fault_cluster.prefills])
    fut = _start(fault_cluster, prompt, greedy(4))
    victim = _wait_assigned(fault_cluster)
    time.sleep(0.2)
    ray.kill(next(w.actor for w in fault_cluster.decodes if w.load.worker_id == victim))
    got = fut.result(timeout=60)
    assert got.attempts == 2 and got.token_ids == _local(tiny_model_dir, [prompt], greedy(4))[0]
    ray.get([w.actor.inject_fault.remote("layer_delay_s", 0.0) for w in fault_cluster.prefills])
    _assert_idle(fault_cluster)


def test_prefill_killed_mid_prefill_is_retried_on_the_other(fault_cluster, tiny_model_dir):
    import time

    import ray

    prompt = make_request(8, seed=6)
    ray.get([w.actor.inject_fault.remote("layer_delay_s", 0.6) for w in fault_cluster.prefills])
    fut = _start(fault_cluster, prompt, greedy(4))
    _wait_assigned(fault_cluster)
    time.sleep(0.3)
    busy = [w for w in fault_cluster.prefills if w.prefill_tokens > 0] or fault_cluster.prefills[:1]
    ray.kill(busy[0].actor)
    survivor = next(w for w in fault_cluster.prefills if w is not busy[0])
    ray.get(survivor.actor.inject_fault.remote("layer_delay_s", 0.0))
    got = fut.result(timeout=60)
    assert got.attempts == 2 and got.token_ids == _local(tiny_model_dir, [prompt], greedy(4))[0]
    _assert_idle(fault_cluster)


def test_client_abort_frees_everything(fault_cluster):
    import time

    import ray

    ray.get([w.actor.inject_fault.remote("layer_delay_s", 0.5) for w in fault_cluster.prefills])
    fut = _start(fault_cluster, make_request(8, seed=7), greedy(50))
    _wait_assigned(fault_cluster)
    time.sleep(0.2)
    fut.cancel()
    ray.get([w.actor.inject_fault.remote("layer_delay_s", 0.0) for w in fault_cluster.prefills])
    time.sleep(0.5)
    _assert_idle(fault_cluster)


def _patch_decode_steps(cluster, mode: str) -> None:
    """Every live decode worker's engine step: ``"fail"`` after its first call (a decode token streams, the next step
    raises), ``"slow"`` (0.2 s a step) or ``"restore"``. Runs inside each actor (``__ray_call__``)."""
    import ray

    def patch(actor_self, mode=mode):
        import time as t

        eng = actor_self.worker.engine
        eng.__dict__.pop("step", None)  # back to the class's method
        if mode == "restore":
            return
        orig, calls = eng.step, [0]

        def step():
            calls[0] += 1
            if mode == "fail" and calls[0] > 1:
                raise RuntimeError("injected decode step failure")
            if mode == "slow":
                t.sleep(0.2)
            return orig()

        eng.step = step

    ray.get([w.actor.__ray_call__.remote(patch) for w in cluster.decodes if w.load.alive], timeout=30)


def _stream_then(cluster, prompt, params, request_id, after_first=lambda: None):
    """Stream one request on the cluster's loop; ``after_first()`` runs once its first delta arrived. Returns the
    deltas and the error the stream ended with (None when it finished)."""
    import asyncio

    async def run():
        items = []
        try:
            async for item in cluster.generate(prompt, params, request_id=request_id):
                items.append(item)
                if len(items) == 1:
                    after_first()
        except DuetError as e:
            return items, e
        return items, None

    return asyncio.run_coroutine_threadsafe(run(), cluster._loop).result(timeout=120)


def test_decode_failure_after_streamed_tokens_is_a_typed_retryable_error(fault_cluster):
    """A decode worker whose step raises, or that is killed, after the request's first tokens were streamed: the
    stream ends with DecodeInterruptedError (retryable, registry code ``decode_interrupted``; UNAVAILABLE / 503 on
    the APIs), never a retry that would stream those tokens again, never a hang; no block held after."""
    import ray

    from cluster.control.errors import DecodeInterruptedError
    from cluster.serve.errors import classify
    from engine.errors import is_retryable
    from node_common import messages

    _patch_decode_steps(fault_cluster, "fail")
    items, err = _stream_then(fault_cluster, make_request(8, seed=11), greedy(30), "mid-fail")
    assert isinstance(err, DecodeInterruptedError) and "injected decode step failure" in str(err)
    assert items and all(it.attempt == 1 for it in items) and sum(len(it.token_ids) for it in items) < 30
    assert is_retryable(err) and messages.error_code(err) == "decode_interrupted"
    with pytest.raises(DecodeInterruptedError):  # keeps its type across a process boundary
        messages.unpack(messages.error_reply(err))
    info = classify(err)
    assert (info.grpc_code.name, info.http_status, info.openai_code) == ("UNAVAILABLE", 503, "decode_interrupted")
    _patch_decode_steps(fault_cluster, "restore")
    _assert_idle(fault_cluster)

    _patch_decode_steps(fault_cluster, "slow")

    def kill_owner():
        ray.kill(next(w.actor for w in fault_cluster.decodes if w.worker_id == fault_cluster.streams.owners()["mid-kill"]))

    items, err = _stream_then(fault_cluster, make_request(8, seed=12), greedy(30), "mid-kill", kill_owner)
    assert isinstance(err, DecodeInterruptedError) and "died" in str(err)
    assert items and all(it.attempt == 1 for it in items) and sum(len(it.token_ids) for it in items) < 30
    _patch_decode_steps(fault_cluster, "restore")
    _assert_idle(fault_cluster)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("policy", ["default", "aggressive"])
def test_compressed_kv_runs_end_to_end(ray_cluster, tiny_model_dir, transport, policy):
    spec = ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=0,
                       transport=transport, kv_compression=policy, num_kv_blocks=64,
                       block_size=4, max_num_seqs=8, max_model_len=128, request_timeout_s=60)
    c = DisaggCluster(spec)
    try:
        prompts = [make_request(5 + i, seed=20 + i, images=[make_image(i)] * (1 + i % 2)) for i in range(3)]
        got = c.generate_batch(prompts, greedy(4))
        assert [len(x.token_ids) for x in got] == [4, 4, 4] and all(x.attempts == 1 for x in got)
        assert all(0 < x.kv_transfer["wire_bytes"] < x.kv_transfer["bytes"] for x in got)
        _assert_idle(c)
    finally:
        c.shutdown()


def test_bad_compression_policy_is_rejected_before_anything_starts(tiny_model_dir):
    with pytest.raises(InvalidRequestError, match="kv_compression"):
        ClusterSpec(model_dir=str(tiny_model_dir), kv_compression={"visual": {"kind": "int", "bits": 3, "group": 8}})


@pytest.mark.parametrize("queue_tokens", [1, None], ids=["configured", "measured"])
def test_requests_beyond_prefill_capacity_wait_at_the_front_end(ray_cluster, tiny_model_dir, queue_tokens):
    """With a slow prefill, a burst still succeeds on its first attempt: later requests wait at the front-end instead
    of holding leases (3 s here: a third of the ~6 s the last prompt would wait in the prefill queue) that would expire
    there. The queue bound is either configured (room for one prompt) or the default, which the front-end derives from
    the worker's measured speed (the burst's 6 prompts are within the static default of 4 x 12 tokens)."""
    spec = ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=0,
                       num_kv_blocks=64, block_size=4, max_num_seqs=8,
                       max_num_batched_tokens=12, max_model_len=128, request_timeout_s=60, lease_base_s=3.0,
                       max_prefill_queue_tokens=queue_tokens)
    c = DisaggCluster(spec)
    try:
        import ray

        ray.get(c.prefills[0].actor.inject_fault.remote("layer_delay_s", 0.5), timeout=10)  # ~1 s per prompt
        prompts = [make_request(5 + i, seed=40 + i) for i in range(6)]
        got = c.generate_batch(prompts, greedy(2))
        assert all(x.attempts == 1 and len(x.token_ids) == 2 for x in got)
        assert c.prefills[0].prefill_tokens == 0
        if queue_tokens is None:  # ~1 s per 5-10 token prompt: half a lease holds about one of them
            assert 0.05 < c.prefills[0].s_per_token < 0.5 and c.admission.cap(c.prefills[0]) < 15
        _assert_idle(c)
    finally:
        c.shutdown()


def test_a_request_queued_in_its_prefill_worker_longer_than_its_lease_completes(ray_cluster, tiny_model_dir):
    """The lease's clock starts with the transfer (kv_transfer.lease): a burst the front-end admits all at once (a
    queue bound far above it) waits 3-4 s in the prefill worker's own queue (one step of ~1 s at a time), several
    times the lease's ~1 s allowance, and every request completes on its first attempt; nothing is held after."""
    spec = ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=0,
                       num_kv_blocks=64, block_size=4, max_num_seqs=8,
                       max_num_batched_tokens=12, max_model_len=128, request_timeout_s=60, lease_base_s=1.0,
                       max_prefill_queue_tokens=10_000)
    c = DisaggCluster(spec)
    try:
        import ray

        ray.get(c.prefills[0].actor.inject_fault.remote("layer_delay_s", 0.5), timeout=10)  # ~1 s per prompt
        prompts = [make_request(5 + i, seed=50 + i) for i in range(5)]  # one prompt per prefill step
        got = c.generate_batch(prompts, greedy(2))
        assert all(x.attempts == 1 and len(x.token_ids) == 2 for x in got), [x.attempts for x in got]
        assert max(x.ttft_s for x in got) > 2 * spec.lease_base_s  # the queue really outlasted the lease
        _assert_idle(c)
    finally:
        c.shutdown()


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="needs Linux CPU affinity")
def test_pinned_workers_run_on_cores_of_their_own(ray_cluster, tiny_model_dir):
    import os

    import ray

    from node_common import messages

    spec = ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=0,
                       num_kv_blocks=64, block_size=4, max_num_seqs=8,
                       max_model_len=128, request_timeout_s=60, pin_cpus=True)
    c = DisaggCluster(spec)
    try:
        cpus = [messages.unpack(ray.get(w.actor.ping.remote(), timeout=30))["cpus"] for w in c.prefills + c.decodes]
        n = os.cpu_count()
        assert cpus == [[0], [1 % n]]
        assert len(c.generate_batch([make_request(5, seed=3)], greedy(2))[0].token_ids) == 2
        _assert_idle(c)
    finally:
        c.shutdown()
