"""A restarted front-end reattaches to a live expert-parallel decode group (:func:`cluster.control.reattach.
place_groups`): the same actors serve (none started, no group formed again), its expert router goes on from the
placement the group runs and a newer placement version, and greedy tokens equal the local engine's. A group missing
a rank is replaced whole: new actors, formed anew, serving the same tokens."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from cluster.control import reattach
from cluster.control.disagg import DisaggCluster
from cluster.control.spec import ClusterSpec
from cluster.experts.placement import align, duet_placement
from engine import LLM
from node_common.messages import unpack
from tests.conftest import greedy, make_request

WORLD = 2


def _spec(model_dir, name: str) -> ClusterSpec:
    return ClusterSpec(model_dir=str(model_dir), num_prefill=1, num_decode=WORLD, expert_parallel=WORLD,
                       expert_slots_per_worker=8 // WORLD + 1, expert_rebalance_s=0, transport="gloo",
                       num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128, cpus_per_worker=1,
                       request_timeout_s=60, local_prefill_tokens=0, detached_name=name)


@pytest.fixture(scope="module")
def want(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128)
    prompts = [make_request(6 + i, seed=70 + i) for i in range(3)]
    params = [greedy(12 + 3 * i) for i in range(3)]
    return prompts, params, [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _ids(cluster: DisaggCluster) -> dict[str, bytes]:
    return {w.worker_id: w.actor._actor_id for w in cluster.pool.workers()}


def _keys(cluster: DisaggCluster) -> set[str]:
    import ray

    return {unpack(r)["experts"]["group"] for r in
            ray.get([w.actor.stats.remote() for w in cluster.decodes], timeout=30)}


def _names(name: str) -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == reattach.NAMESPACE and a["name"].startswith(f"{name}:"))


@contextlib.contextmanager
def _front_ends(spec: ClusterSpec) -> Iterator[Callable[[], DisaggCluster]]:
    """``start()`` makes a front-end of ``spec``; the last one started is shut down at the end, and then no worker
    of the name is left."""
    started: list[DisaggCluster] = []

    def start() -> DisaggCluster:
        started.append(DisaggCluster(spec))
        return started[-1]

    try:
        yield start
    finally:
        if started:
            started[-1].shutdown()
    assert _names(spec.detached_name) == []


def test_a_restarted_front_end_reattaches_a_live_group(ray_cluster, tiny_model_dir, want):
    prompts, params, tokens = want
    with _front_ends(_spec(tiny_model_dir, "t-ep-reattach")) as start:
        first = start()
        router = first.expert_routers[0]
        skew = np.array([[40.0, 1, 1, 1, 9, 1, 1, 1], [1.0, 1, 30, 1, 1, 1, 12, 1]])  # a placement of its own
        moved = align(duet_placement(skew, router.current.workers, router.current.slots_per_worker), router.current)
        assert router.apply(moved, wait_s=30) and router.version == 1
        assert [c.token_ids for c in first.generate_batch(prompts, params)] == tokens
        ids, keys = _ids(first), _keys(first)
        first.abandon()
        t0 = time.monotonic()
        second = start()
        print(f"expert-parallel group reattached in {time.monotonic() - t0:.2f} s")
        assert _ids(second) == ids  # every worker reused, the group's ranks in their slots
        assert _keys(second) == keys  # the same group, not formed again
        again = second.expert_routers[0]
        assert np.array_equal(again.current.slots, moved.slots) and again.version == 1
        assert [c.token_ids for c in second.generate_batch(prompts, params)] == tokens
        back = align(duet_placement(skew[:, ::-1].copy(), again.current.workers, again.current.slots_per_worker),
                     again.current)
        assert again.apply(back, wait_s=30) and again.version == 2  # the next version is newer than the group's
        assert [c.token_ids for c in second.generate_batch(prompts, params)] == tokens


def test_a_group_missing_a_rank_is_formed_anew(ray_cluster, tiny_model_dir, want):
    import ray

    prompts, params, tokens = want
    with _front_ends(_spec(tiny_model_dir, "t-ep-broken")) as start:
        first = start()
        ids, keys = _ids(first), _keys(first)
        first.abandon()
        ray.kill(first.decodes[1].actor)  # rank 1 dies with its front-end: rank 0 is left alone
        second = start()
        now = _ids(second)
        assert now["prefill-0"] == ids["prefill-0"]  # the prefill worker is reused
        assert not {now[w.worker_id] for w in second.decodes} & {ids["decode-0"], ids["decode-1"]}  # both new
        assert "decode-0" not in {w.worker_id for w in second.decodes}  # the survivor was killed, not reused
        assert len(_keys(second)) == 1 and not _keys(second) & keys
        assert [c.token_ids for c in second.generate_batch(prompts, params)] == tokens
