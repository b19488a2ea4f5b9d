"""Transfer scenarios on every transport, both sides in this process (managers from the ``managers`` fixture)."""

from __future__ import annotations

import random
import threading
import time
import uuid

import pytest

from kv_transfer import (
    ChecksumMismatch,
    KVLayout,
    KVManager,
    KVPoll,
    Lease,
    MissingLayer,
    PeerUnavailable,
    ProtocolError,
    TransferAborted,
    TransferError,
    TransferTimeout,
)
from tests.kv_transfer.kvutil import (
    Collector,
    make_kv,
    make_layout,
    make_manager,
    wait_until,
)

Managers = tuple[KVManager, KVManager]


def start(managers: Managers, *, num_blocks: int = 3, dtype: str = "float32", deadline_in_s: float = 20.0):
    """A lease from the decode manager, its receiver (with a Collector sink) and the prefill sender."""
    decode, prefill = managers
    layout = make_layout(dtype)
    lease = decode.lease(f"req-{uuid.uuid4().hex[:8]}", num_blocks=num_blocks, layout=layout,
                         deadline_s=time.time() + deadline_in_s)
    sink = Collector()
    receiver = decode.expect(lease, sink)
    sender = prefill.sender(Lease.from_dict(lease.to_dict()))  # the lease travels as a dict, as through Ray
    return lease, sender, receiver, sink


def send_all(sender, lease: Lease, *, seed: int, order=None, skip=()) -> None:
    for layer in order or range(lease.layout.num_layers):
        if layer not in skip:
            sender.send_layer(layer, *make_kv(lease.layout, lease.num_blocks, seed=seed, layer=layer))


@pytest.mark.parametrize("num_blocks", [1, 3, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_bit_exact(managers: Managers, dtype: str, num_blocks: int) -> None:
    lease, sender, receiver, sink = start(managers, num_blocks=num_blocks, dtype=dtype)
    send_all(sender, lease, seed=num_blocks)
    sender.finish({"first_token": 7, "experts": [[0, 3], [1, 1]]})
    assert receiver.wait(10) is KVPoll.SUCCESS, receiver.failure_exception()
    assert sender.wait(10) is KVPoll.SUCCESS, sender.failure_exception()
    assert receiver.meta == {"first_token": 7, "experts": [[0, 3], [1, 1]]}
    assert sink.matches(lease.layout, num_blocks, seed=num_blocks)
    assert receiver.failure_exception() is None and sender.failure_exception() is None


def test_on_done_gets_meta(managers: Managers) -> None:
    decode, prefill = managers
    layout = make_layout()
    lease = decode.lease("on-done-" + uuid.uuid4().hex[:6], num_blocks=2, layout=layout)
    metas = []
    receiver = decode.expect(lease, Collector(), on_done=metas.append)
    sender = prefill.sender(lease)
    send_all(sender, lease, seed=1)
    sender.finish({"t": 1})
    assert receiver.wait(10) is KVPoll.SUCCESS and wait_until(lambda: metas == [{"t": 1}])
    assert sender.wait(10) is KVPoll.SUCCESS


def test_layers_out_of_order(managers: Managers) -> None:
    lease, sender, receiver, sink = start(managers, num_blocks=2)
    order = [3, 0, 2, 1]
    send_all(sender, lease, seed=5, order=order)
    sender.finish({})
    assert receiver.wait(10) is KVPoll.SUCCESS, receiver.failure_exception()
    assert sender.wait(10) is KVPoll.SUCCESS
    assert sink.calls == order  # one link: arrival order is send order
    assert sink.matches(lease.layout, 2, seed=5)


def test_concurrent_requests_on_one_pair(managers: Managers) -> None:
    runs = [start(managers, num_blocks=n, dtype=d) for n, d in [(1, "float32"), (4, "bfloat16"), (2, "float32"),
                                                                 (5, "bfloat16")]]

    def drive(i: int) -> None:
        lease, sender, _, _ = runs[i]
        order = list(range(lease.layout.num_layers))
        random.Random(i).shuffle(order)
        send_all(sender, lease, seed=100 + i, order=order)
        sender.finish({"i": i})

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(len(runs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for i, (lease, sender, receiver, sink) in enumerate(runs):
        assert receiver.wait(10) is KVPoll.SUCCESS, receiver.failure_exception()
        assert sender.wait(10) is KVPoll.SUCCESS, sender.failure_exception()
        assert receiver.meta == {"i": i} and sink.matches(lease.layout, lease.num_blocks, seed=100 + i)


def test_corrupted_block_fails_with_checksum_mismatch(managers: Managers) -> None:
    lease, sender, receiver, sink = start(managers, num_blocks=3)

    def flip_a_byte_of_block_1(header: dict, payload) -> None:
        if header["layer"] == 2:
            kbytes = header["codec_meta"]["planes"][0]
            payload[kbytes + kbytes // 3 + 5] ^= 0x40  # V plane, block 1

    sender.tamper = flip_a_byte_of_block_1
    send_all(sender, lease, seed=9)
    sender.finish({})
    assert receiver.wait(10) is KVPoll.FAILED
    assert isinstance(receiver.failure_exception(), ChecksumMismatch)
    assert "block(s) [1]" in str(receiver.failure_exception())
    assert 2 not in sink.calls and 3 not in sink.calls  # nothing after the failure either
    assert sender.wait(10) is KVPoll.FAILED and isinstance(sender.failure_exception(), ChecksumMismatch)


def test_missing_layer(managers: Managers) -> None:
    lease, sender, receiver, _ = start(managers)
    send_all(sender, lease, seed=3, skip={1})
    sender.finish({})
    assert receiver.wait(10) is KVPoll.FAILED and isinstance(receiver.failure_exception(), MissingLayer)
    assert sender.wait(10) is KVPoll.FAILED and isinstance(sender.failure_exception(), MissingLayer)
    assert receiver.meta is None


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_abort_reaches_the_other_side(managers: Managers, side: str) -> None:
    lease, sender, receiver, sink = start(managers)
    send_all(sender, lease, seed=4, order=[0, 1])
    assert wait_until(lambda: len(sink.calls) == 2)
    here, there = (sender, receiver) if side == "sender" else (receiver, sender)
    t0 = time.monotonic()
    here.abort("operator said so")
    assert here.poll() is KVPoll.FAILED and isinstance(here.failure_exception(), TransferAborted)
    assert there.wait(5) is KVPoll.FAILED
    assert time.monotonic() - t0 < 3.0
    assert isinstance(there.failure_exception(), TransferAborted)
    assert "operator said so" in str(there.failure_exception()) or side == "receiver"
    send_all(sender, lease, seed=4, order=[2, 3])  # dropped silently after the failure
    sender.finish({})
    assert sorted(sink.calls) == [0, 1]


def test_abort_before_any_frame(managers: Managers) -> None:
    _, sender, receiver, _ = start(managers)
    receiver.abort("changed my mind")
    assert sender.wait(5) is KVPoll.FAILED and isinstance(sender.failure_exception(), TransferAborted)


def test_lease_deadline_without_sender(managers: Managers) -> None:
    decode, _ = managers
    layout = make_layout()
    deadline = time.time() + 1.0
    receiver = decode.expect(decode.lease("late-" + uuid.uuid4().hex[:6], num_blocks=2, layout=layout,
                                          deadline_s=deadline), Collector())
    assert receiver.poll() is KVPoll.WAITING
    assert wait_until(lambda: receiver.failure_exception() is not None, 3.0)  # the deadline watch, no polling
    assert time.time() <= deadline + 1.0
    assert receiver.poll() is KVPoll.FAILED and isinstance(receiver.failure_exception(), TransferTimeout)


def test_sender_stalls_past_deadline(managers: Managers) -> None:
    lease, sender, receiver, _ = start(managers, deadline_in_s=1.0)
    send_all(sender, lease, seed=2, order=[0])
    t0 = time.time()
    assert receiver.wait(5) is KVPoll.FAILED and sender.wait(5) is KVPoll.FAILED
    assert time.time() <= lease.deadline_s + 1.0 and time.time() - t0 < 2.5
    assert isinstance(receiver.failure_exception(), TransferTimeout)
    assert isinstance(sender.failure_exception(), TransferTimeout)


def _queued_lease(managers: Managers, *, start_in_s: float, transfer_s: float) -> tuple[Lease, object, Collector]:
    """A lease whose clock starts with its transfer (``start_by_s``), its receiver and sink."""
    import dataclasses

    decode, _ = managers
    base = decode.lease(f"queued-{uuid.uuid4().hex[:8]}", num_blocks=2, layout=make_layout())
    lease = dataclasses.replace(base, start_by_s=time.time() + start_in_s, transfer_s=transfer_s)
    sink = Collector()
    return lease, decode.expect(lease, sink), sink


def test_a_start_counted_lease_waits_for_its_prefill_then_bounds_the_transfer(managers: Managers) -> None:
    """The lease's clock does not run while the request waits for its prefill (longer than the whole transfer
    allowance here); once the first layer moves, a transfer that stalls fails ``transfer_s`` later on both sides."""
    _, prefill = managers
    lease, receiver, _ = _queued_lease(managers, start_in_s=30.0, transfer_s=0.8)
    time.sleep(1.5)  # queued: nearly twice transfer_s
    assert receiver.poll() is KVPoll.WAITING and receiver.failure_exception() is None
    sender = prefill.sender(Lease.from_dict(lease.to_dict()))
    send_all(sender, lease, seed=8, order=[0])  # starts the clock, then stalls
    t0 = time.time()
    assert receiver.wait(5) is KVPoll.FAILED and sender.wait(5) is KVPoll.FAILED
    assert isinstance(receiver.failure_exception(), TransferTimeout)
    assert isinstance(sender.failure_exception(), TransferTimeout)
    assert time.time() - t0 < 3.0  # transfer_s after the start, far from start_by_s


def test_a_start_counted_lease_completes_after_a_long_queue(managers: Managers) -> None:
    _, prefill = managers
    lease, receiver, sink = _queued_lease(managers, start_in_s=30.0, transfer_s=2.0)
    time.sleep(2.5)  # longer than the transfer allowance
    sender = prefill.sender(Lease.from_dict(lease.to_dict()))
    send_all(sender, lease, seed=9)
    sender.finish({"first_token": 1})
    assert receiver.wait(10) is KVPoll.SUCCESS, receiver.failure_exception()
    assert sender.wait(10) is KVPoll.SUCCESS, sender.failure_exception()
    assert sink.matches(lease.layout, 2, seed=9)


def test_a_start_counted_lease_that_never_starts_fails_at_start_by(managers: Managers) -> None:
    lease, receiver, _ = _queued_lease(managers, start_in_s=1.0, transfer_s=30.0)
    assert receiver.poll() is KVPoll.WAITING
    assert wait_until(lambda: receiver.failure_exception() is not None, 4.0)  # the deadline watch, no polling
    assert time.time() <= lease.start_by_s + 2.0
    assert isinstance(receiver.failure_exception(), TransferTimeout)


def test_unknown_frame_version_is_rejected(managers: Managers) -> None:
    lease, sender, receiver, sink = start(managers)

    def from_the_future(header: dict, payload) -> None:
        if header["layer"] == 1:
            header["v"] = 99

    sender.tamper = from_the_future
    send_all(sender, lease, seed=6)
    sender.finish({})
    assert receiver.wait(10) is KVPoll.FAILED
    assert isinstance(receiver.failure_exception(), ProtocolError) and "version 99" in str(receiver.failure_exception())
    assert 1 not in sink.calls
    assert sender.wait(10) is KVPoll.FAILED and isinstance(sender.failure_exception(), TransferError)


def test_sender_for_unexpected_request_fails_fast(managers: Managers) -> None:
    decode, prefill = managers
    lease = decode.lease("never-expected-" + uuid.uuid4().hex[:6], num_blocks=1, layout=make_layout())
    sender = prefill.sender(lease)
    assert sender.wait(5) is KVPoll.FAILED and isinstance(sender.failure_exception(), TransferAborted)


def test_contract_errors(managers: Managers) -> None:
    decode, prefill = managers
    lease, sender, receiver, _ = start(managers, num_blocks=2)
    with pytest.raises(ValueError, match="already exists"):
        decode.expect(lease, Collector())
    k, v = make_kv(lease.layout, 2, seed=0, layer=0)
    with pytest.raises(ValueError, match="out of range"):
        sender.send_layer(4, k, v)
    with pytest.raises(ValueError, match="the lease needs"):
        sender.send_layer(0, k[:1], v[:1])
    with pytest.raises(ValueError, match="the lease needs"):
        sender.send_layer(0, k.double(), v.double())
    sender.send_layer(0, k, v)
    with pytest.raises(ValueError, match="sent twice"):
        sender.send_layer(0, k, v)
    with pytest.raises(TypeError, match="msgpack"):
        sender.finish({"bad": object()})
    with pytest.raises(ValueError, match="transport"):
        prefill.sender(Lease(**{**lease.__dict__, "transport": "nope"}))
    sender.abort("done testing")
    assert receiver.wait(5) is KVPoll.FAILED


def test_caller_may_reuse_its_buffers(managers: Managers) -> None:
    lease, sender, receiver, sink = start(managers, num_blocks=2)
    for layer in range(lease.layout.num_layers):
        k, v = make_kv(lease.layout, 2, seed=11, layer=layer)
        sender.send_layer(layer, k, v)
        k.zero_(), v.zero_()  # send_layer copied them
    sender.finish({})
    assert receiver.wait(10) is KVPoll.SUCCESS and sink.matches(lease.layout, 2, seed=11)
    assert sender.wait(10) is KVPoll.SUCCESS


def test_closed_peer_manager_fails_transfers(managers: Managers) -> None:
    decode, prefill = managers
    other = make_manager(decode.name)
    layout = make_layout()
    lease = other.lease("closing-" + uuid.uuid4().hex[:6], num_blocks=2, layout=layout)
    receiver = other.expect(lease, Collector())
    sender = prefill.sender(lease)
    send_all(sender, lease, seed=1, order=[0])
    assert wait_until(lambda: receiver.poll() is KVPoll.TRANSFERRING)
    other.close()
    assert receiver.poll() is KVPoll.FAILED
    assert sender.wait(5) is KVPoll.FAILED
    assert isinstance(sender.failure_exception(), (TransferAborted, PeerUnavailable))


def test_unreachable_decode_fails_the_sender(managers: Managers) -> None:
    decode, prefill = managers
    other = make_manager(decode.name)
    lease = other.lease("orphan-" + uuid.uuid4().hex[:6], num_blocks=1, layout=make_layout(),
                        deadline_s=time.time() + 10)
    other.close()  # nobody listens at the lease's endpoint any more
    sender = prefill.sender(lease)
    assert sender.wait(8) is KVPoll.FAILED and isinstance(sender.failure_exception(), PeerUnavailable)


def test_large_layer(managers: Managers) -> None:
    decode, prefill = managers
    layout = KVLayout(num_layers=2, block_size=16, num_kv_heads=8, head_dim=128, dtype="float32")
    lease = decode.lease("big-" + uuid.uuid4().hex[:6], num_blocks=40, layout=layout, deadline_s=time.time() + 30)
    assert layout.layer_nbytes(40) > 4 << 20  # more than one gRPC message
    sink = Collector()
    receiver = decode.expect(lease, sink)
    sender = prefill.sender(lease)
    send_all(sender, lease, seed=12)
    sender.finish({})
    assert receiver.wait(20) is KVPoll.SUCCESS, receiver.failure_exception()
    assert sender.wait(20) is KVPoll.SUCCESS
    assert sink.matches(layout, 40, seed=12)
