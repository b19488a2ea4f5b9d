"""Detached workers and a front-end that reattaches to them (:mod:`cluster.control.reattach`): a front-end that
dies (``abandon``) with a request in flight leaves its workers running; the next one started with the same
``detached_name`` and configuration reuses them -- no actor started, the in-flight request ended on the workers,
nothing held -- and serves the local engine's greedy tokens; one with another configuration replaces them; a clean
shutdown leaves no worker and no record."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from cluster.control import reattach
from cluster.control.disagg import DisaggCluster
from cluster.control.spec import ClusterSpec
from cluster.demo import default_model_dir
from engine import LLM, SamplingParams
from node_common import messages

PROMPT = {"prompt_token_ids": [5, 17, 42, 9, 33, 2, 71, 8, 19]}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _names(name: str) -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == reattach.NAMESPACE and a["name"].startswith(f"{name}:"))


def _held(cluster: DisaggCluster) -> int:
    import ray

    states = [messages.unpack(r) for r in ray.get([w.actor.check_no_leaks.remote() for w in cluster.pool.workers()],
                                                  timeout=30)]
    return sum(s["held"] for s in states) + sum(not s["idle"] for s in states)


def _wait_idle(cluster: DisaggCluster, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while _held(cluster) and time.monotonic() < end:
        time.sleep(0.05)
    assert _held(cluster) == 0


@pytest.fixture(scope="module")
def want():
    return LLM(default_model_dir(), dtype="float32").generate(PROMPT, GREEDY)[0].outputs[0].token_ids


def test_a_restarted_front_end_reattaches_and_serves(ray_cluster, want):
    import ray

    spec = ClusterSpec(model_dir=str(default_model_dir()), local_prefill_tokens=0,
                       num_prefill=1, num_decode=1, transport="gloo",
                       num_kv_blocks=256, cpus_per_worker=1, request_timeout_s=60, detached_name="t-reattach")
    first = DisaggCluster(spec)
    try:
        assert _names("t-reattach") == ["t-reattach:decode-0", "t-reattach:prefill-0"]
        assert first.generate_batch([PROMPT], GREEDY)[0].token_ids == want
        ids = {w.worker_id: w.actor._actor_id for w in first.pool.workers()}

        async def start_long() -> None:  # in flight when the front-end dies: it must not stay on the workers
            async for _ in first.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)):
                return

        asyncio.run_coroutine_threadsafe(start_long(), first._loop).result(timeout=30)
        first.abandon()
        t0 = time.monotonic()
        second = DisaggCluster(spec)
        took = time.monotonic() - t0
        try:
            assert {w.worker_id: w.actor._actor_id for w in second.pool.workers()} == ids  # reused, none started
            _wait_idle(second)  # the old front-end's request was ended by the reset
            assert second.generate_batch([PROMPT], GREEDY)[0].token_ids == want
            print(f"reattached in {took:.2f} s")
        finally:
            second.abandon()
        changed = dataclasses.replace(spec, max_num_seqs=spec.max_num_seqs // 2)  # another engine configuration
        third = DisaggCluster(changed)
        try:
            assert not set(w.actor._actor_id for w in third.pool.workers()) & set(ids.values())
            assert _names("t-reattach") == sorted(f"t-reattach:{w.worker_id}" for w in third.pool.workers())
            assert third.generate_batch([PROMPT], GREEDY)[0].token_ids == want
        finally:
            third.shutdown()
        assert _names("t-reattach") == [] and reattach.read_record("t-reattach") is None
    finally:
        for name in _names("t-reattach"):
            ray.kill(ray.get_actor(name, namespace=reattach.NAMESPACE))
        reattach.forget("t-reattach")


def test_a_bad_detached_name_is_refused():
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="detached_name"):
        ClusterSpec(model_dir=str(default_model_dir()), detached_name="a b")
