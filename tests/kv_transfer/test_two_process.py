"""Decode side here, prefill side in a spawned process: a real two-process round trip, and a prefill process
killed mid-transfer (the receiver must end FAILED by its deadline, never hang)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import uuid

import pytest

from kv_transfer import KVPoll, PeerUnavailable, TransferTimeout
from tests.kv_transfer import peer
from tests.kv_transfer.kvutil import (
    PROCESS_TRANSPORTS,
    Collector,
    make_kv,
    make_layout,
    make_manager,
    wait_until,
)

SPAWN = mp.get_context("spawn")


@pytest.fixture(params=PROCESS_TRANSPORTS, ids=PROCESS_TRANSPORTS)
def decode(request: pytest.FixtureRequest):
    manager = make_manager(request.param)
    yield manager
    manager.close()


def spawn_prefill(transport: str, leases, seeds, mode: str):
    results = SPAWN.Queue()
    proc = SPAWN.Process(target=peer.prefill_main, args=(transport, [l.to_dict() for l in leases], seeds, mode,
                                                         results), daemon=True)
    proc.start()
    return proc, results


def test_round_trip_across_processes(decode) -> None:
    specs = [("float32", 2), ("bfloat16", 5), ("float32", 1)]
    leases, sinks, receivers = [], [], []
    for i, (dtype, num_blocks) in enumerate(specs):
        lease = decode.lease(f"xproc-{i}-{uuid.uuid4().hex[:6]}", num_blocks=num_blocks, layout=make_layout(dtype),
                             deadline_s=time.time() + 60)
        sinks.append(Collector())
        receivers.append(decode.expect(lease, sinks[-1]))
        leases.append(lease)
    seeds = [40 + i for i in range(len(specs))]
    proc, results = spawn_prefill(decode.name, leases, seeds, "all")
    try:
        for lease, receiver, sink, seed in zip(leases, receivers, sinks, seeds):
            assert receiver.wait(45) is KVPoll.SUCCESS, receiver.failure_exception()
            assert receiver.meta == {"seed": seed}
            assert sink.matches(lease.layout, lease.num_blocks, seed=seed)
        report = results.get(timeout=30)
        assert report[0] == "done" and report[1] == ["SUCCESS"] * len(specs), report
        proc.join(15)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
    assert wait_until(lambda: decode.num_active() == 0)


def test_prefill_killed_mid_transfer(decode) -> None:
    lease = decode.lease("victim-" + uuid.uuid4().hex[:6], num_blocks=3, layout=make_layout(),
                         deadline_s=time.time() + 40)
    sink = Collector()
    receiver = decode.expect(lease, sink)
    proc, results = spawn_prefill(decode.name, [lease], [7], "hang")
    try:
        assert results.get(timeout=35) == ("sent",)
        assert wait_until(lambda: len(sink.calls) == 2, 10)
        assert receiver.poll() is KVPoll.TRANSFERRING
        os.kill(proc.pid, signal.SIGKILL)
        assert receiver.wait(lease.deadline_s - time.time() + 1) is KVPoll.FAILED
        assert time.time() <= lease.deadline_s + 1
        assert isinstance(receiver.failure_exception(), (PeerUnavailable, TransferTimeout))
    finally:
        proc.kill()
        proc.join(5)
    assert sorted(sink.calls) == [0, 1]
    assert wait_until(lambda: decode.num_active() == 0)

    # the decode worker keeps serving: a new prefill worker (here, in this process) can join
    prefill = make_manager(decode.name)
    try:
        lease = decode.lease("after-" + uuid.uuid4().hex[:6], num_blocks=2, layout=make_layout(),
                             deadline_s=time.time() + 20)
        sink = Collector()
        receiver = decode.expect(lease, sink)
        sender = prefill.sender(lease)
        for layer in range(lease.layout.num_layers):
            sender.send_layer(layer, *make_kv(lease.layout, 2, seed=8, layer=layer))
        sender.finish({})
        assert receiver.wait(10) is KVPoll.SUCCESS and sink.matches(lease.layout, 2, seed=8)
        assert sender.wait(10) is KVPoll.SUCCESS
    finally:
        prefill.close()
