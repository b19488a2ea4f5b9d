"""Errors keep their type across process boundaries: every class in the error-code registry round-trips through an
error reply, codes are unique, unknown codes fall back to DuetError, and retryable is declared per class."""

from __future__ import annotations

import pytest

import cluster.control.disagg  # noqa: F401 - registers the cluster's errors
import decode_node.expert_group  # noqa: F401 - registers GroupUnavailable
from engine import errors
from engine.errors import REGISTRY, DuetError, OutOfBlocksError
from node_common import messages


@pytest.mark.parametrize("code", sorted(REGISTRY))
def test_every_registered_error_round_trips_with_its_type(code):
    cls = REGISTRY[code]
    with pytest.raises(cls) as got:
        messages.unpack(messages.error_reply(cls(f"boom {code}")))
    assert type(got.value) is cls and str(got.value) == f"boom {code}"
    assert messages.error_code(got.value) == code


def test_the_registry_covers_every_package():
    from decode_node.expert_group import GroupUnavailable
    from kv_transfer.base import PeerUnavailable, ProtocolError
    from kv_transfer.handoff import HandoffMismatch

    for cls in (OutOfBlocksError, errors.PromptTooLongError, ProtocolError, HandoffMismatch, PeerUnavailable,
                GroupUnavailable, cluster.control.disagg.TransferFailedError, messages.MessageError):
        assert REGISTRY[cls.code] is cls


def test_retryable_is_declared():
    from decode_node.expert_group import GroupUnavailable
    from kv_transfer.base import ChecksumMismatch

    assert errors.is_retryable(GroupUnavailable("x")) and errors.is_retryable(OutOfBlocksError("x"))
    assert errors.is_retryable(ChecksumMismatch("x"))
    assert not errors.is_retryable(errors.PromptTooLongError("x")) and not errors.is_retryable(KeyError("x"))


def test_unregistered_subclass_travels_as_its_registered_base():
    class Local(errors.InvalidRequestError):
        pass

    with pytest.raises(errors.InvalidRequestError) as got:
        messages.unpack(messages.error_reply(Local("x")))
    assert type(got.value) is errors.InvalidRequestError


def test_unknown_code_and_foreign_errors_become_duet_error():
    assert type(messages.error_from_dict({"code": "from-a-newer-peer", "message": "m"})) is DuetError
    with pytest.raises(DuetError) as got:
        messages.unpack(messages.error_reply(KeyError("k")))
    assert type(got.value) is DuetError


def test_a_taken_code_cannot_be_reused():
    with pytest.raises(TypeError, match="taken"):
        class Clash(DuetError):  # noqa: F841
            code = "out_of_blocks"


# ------------------------------------------------------------------------------------- across the actor boundary
def _faulty_decode_actor():
    """A DecodeActor whose ``allocate`` answers GroupUnavailable (as a broken expert-parallel group's does) while
    its fault is on (on at start for ``decode-1``: the worker the router tries first, having as many free blocks)."""
    from decode_node.actor import DecodeActor
    from decode_node.expert_group import GroupUnavailable

    class FaultyDecodeActor(DecodeActor):
        def __init__(self, worker_id, *args, **kwargs):
            super().__init__(worker_id, *args, **kwargs)
            self.group_broken = worker_id == "decode-1"

        def break_group(self, on: bool) -> None:
            self.group_broken = on

        def allocate(self, msg: bytes) -> bytes:
            if self.group_broken:
                return messages.error_reply(GroupUnavailable(f"{self.worker_id}: expert-parallel group broke"))
            return super().allocate(msg)

    return FaultyDecodeActor


@pytest.fixture(scope="module")
def faulty_cluster(ray_cluster, tiny_model_dir):
    import decode_node.actor as actor_module

    from cluster.control.disagg import DisaggCluster
    from cluster.control.spec import ClusterSpec

    spec = ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=0,
                       num_prefill=1, num_decode=2, num_kv_blocks=16, block_size=4,
                       max_num_seqs=4, max_model_len=128, cpus_per_worker=1, request_timeout_s=60)
    real = actor_module.DecodeActor
    actor_module.DecodeActor = _faulty_decode_actor()
    try:
        c = DisaggCluster(spec)
    finally:
        actor_module.DecodeActor = real
    yield c
    c.shutdown()


def test_group_unavailable_from_a_decode_worker_is_retried_on_another(faulty_cluster, tiny_model_dir):
    from engine import LLM
    from tests.conftest import greedy, make_request

    prompt = make_request(8, seed=9)
    got = faulty_cluster.generate_batch([prompt], greedy(3))[0]
    assert got.attempts == 2 and got.timeline["decode_worker"] == "decode-0"
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=16, block_size=4, max_model_len=64)
    assert got.token_ids == llm.generate([prompt], greedy(3))[0].outputs[0].token_ids


def test_group_unavailable_everywhere_reaches_the_client_typed(faulty_cluster):
    import ray

    from decode_node.expert_group import GroupUnavailable
    from tests.conftest import greedy, make_request

    ray.get([w.actor.break_group.remote(True) for w in faulty_cluster.decodes], timeout=10)
    try:
        with pytest.raises(GroupUnavailable):
            faulty_cluster.generate_batch([make_request(8, seed=10)], greedy(2))
    finally:
        ray.get([w.actor.break_group.remote(w.load.worker_id == "decode-1") for w in faulty_cluster.decodes])
    assert set(faulty_cluster.check_no_leaks().values()) == {0}


def test_the_front_end_and_the_workers_agree_on_max_model_len(faulty_cluster):
    # 16 blocks of 4 tokens cap every worker at 64 positions, below the configured 128
    lens = {r["worker_id"]: r["max_model_len"] for r in faulty_cluster.status()}
    assert set(lens.values()) == {64} and faulty_cluster.inputs.max_model_len == 64
    from tests.conftest import make_request

    with pytest.raises(errors.PromptTooLongError):
        faulty_cluster.prepare(make_request(70))
