"""The lease policy is the one source of the lease defaults; the receiver contract declares what decode reads."""

from __future__ import annotations

import time

import pytest

from kv_transfer import DEFAULT_LEASE, KVReceiver, LeasePolicy, transfer_deadline


def test_default_policy_and_worked_example():
    assert DEFAULT_LEASE == LeasePolicy(base_s=5.0, min_rate_bps=50e6)
    before = time.time()
    due = DEFAULT_LEASE.deadline(100_000_000)  # 100 MB at 50 MB/s: 2 s past the 5 s base
    assert before + 7.0 <= due <= time.time() + 7.0
    assert before + 5.0 <= transfer_deadline(0) <= time.time() + 5.0  # transfer_deadline's defaults are the policy's


@pytest.mark.parametrize("kwargs", [{"base_s": -1.0}, {"min_rate_bps": 0.0}, {"min_rate_bps": float("inf")},
                                    {"base_s": float("nan")}], ids=["negative-base", "zero-rate", "inf-rate", "nan"])
def test_policy_is_validated(kwargs):
    with pytest.raises(ValueError):
        LeasePolicy(**kwargs)


def test_decode_worker_and_actor_default_to_the_policy():
    import inspect

    from decode_node.actor import DecodeActor
    from decode_node.worker import DecodeWorker

    assert inspect.signature(DecodeWorker).parameters["lease"].default is DEFAULT_LEASE
    actor = inspect.signature(DecodeActor).parameters
    assert (actor["lease_base_s"].default, actor["lease_min_rate_bps"].default) == (DEFAULT_LEASE.base_s,
                                                                                    DEFAULT_LEASE.min_rate_bps)


def test_receiver_contract_declares_what_decode_reads():
    assert KVReceiver.decode_device is None and KVReceiver.wire_bytes is None and KVReceiver.state_sink is None
