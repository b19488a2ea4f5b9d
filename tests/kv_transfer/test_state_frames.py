"""State frames (hybrid models' per-layer recurrent state) on every transport: the lease carries their layout
(version 2; version-1 leases still parse), frames round-trip bit for bit beside the KV layers, the receiver commits
only with every KV layer and every state frame, a flipped bit is a ChecksumMismatch before the state sink sees it, and
a frame of another format is a ProtocolError."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from kv_transfer import (
    ChecksumMismatch,
    KVManager,
    KVPoll,
    Lease,
    MissingLayer,
    ProtocolError,
    StateLayout,
    TensorSpec,
)
from kv_transfer.state_frames import decode_state, encode_state
from tests.kv_transfer.kvutil import Collector, make_kv, make_layout

STATE = StateLayout(2, (TensorSpec("conv", (6, 3), "bfloat16"), TensorSpec("recurrent", (2, 4, 4), "float32")))


def _state(index: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(index)
    return {"conv": torch.randn(6, 3, generator=g).bfloat16(), "recurrent": torch.randn(2, 4, 4, generator=g)}


def _start(managers: tuple[KVManager, KVManager]):
    decode, prefill = managers
    lease = decode.lease(f"req-{uuid.uuid4().hex[:8]}", num_blocks=2, layout=make_layout("float32"),
                         deadline_s=time.time() + 20, state=STATE)
    sink, got = Collector(), {}
    receiver = decode.expect(lease, sink)
    receiver.state_sink = lambda i, tensors: got.__setitem__(i, tensors)
    return lease, prefill.sender(Lease.from_dict(lease.to_dict())), receiver, sink, got


def _send(sender, lease: Lease, frames=(0, 1)) -> None:
    for layer in range(lease.layout.num_layers):
        sender.send_layer(layer, *make_kv(lease.layout, lease.num_blocks, seed=1, layer=layer))
    for i in frames:
        sender.send_state(i, _state(i))


def test_lease_versions():
    lease = Lease("r", 2, make_layout("float32"), "inproc", "inproc://x", 1e12, state=STATE)
    assert Lease.from_dict(lease.to_dict()) == lease
    v1 = {**lease.to_dict(), "version": 1}
    del v1["state"]
    assert Lease.from_dict(v1).state is None
    with pytest.raises(ProtocolError):
        Lease.from_dict({**lease.to_dict(), "version": 4})


def test_state_round_trips_beside_the_kv(managers):
    lease, sender, receiver, sink, got = _start(managers)
    _send(sender, lease, frames=(1, 0))  # any order
    sender.finish({"first_token": 3})
    assert receiver.wait(10) is KVPoll.SUCCESS, receiver.failure_exception()
    assert sender.wait(10) is KVPoll.SUCCESS
    assert sink.matches(lease.layout, lease.num_blocks, seed=1)
    for i in (0, 1):
        assert all(torch.equal(got[i][k], v) for k, v in _state(i).items())
    assert receiver.state_bytes == STATE.transfer_nbytes == 2 * (6 * 3 * 2 + 2 * 4 * 4 * 4)


def test_finish_without_every_state_frame_is_a_missing_layer(managers):
    lease, sender, receiver, _, _ = _start(managers)
    _send(sender, lease, frames=(0,))
    sender.finish({})
    assert receiver.wait(10) is KVPoll.FAILED and isinstance(receiver.failure_exception(), MissingLayer)
    assert "state frame(s) [1]" in str(receiver.failure_exception())


def test_corrupted_state_frame_never_reaches_the_sink(managers):
    lease, sender, receiver, _, got = _start(managers)

    def flip(header: dict, payload: torch.Tensor) -> None:
        if header["kind"] == "state" and header["index"] == 1:
            payload[5] ^= 0x10

    sender.tamper = flip
    _send(sender, lease)
    sender.finish({})
    assert receiver.wait(10) is KVPoll.FAILED and isinstance(receiver.failure_exception(), ChecksumMismatch)
    assert sender.wait(10) is KVPoll.FAILED and isinstance(sender.failure_exception(), ChecksumMismatch)
    assert 1 not in got


def test_contract_errors():
    header, payload = encode_state("r", 0, _state(0), STATE)
    assert all(torch.equal(decode_state(header, payload, STATE)[k], v) for k, v in _state(0).items())
    for bad in ({**header, "format": 2}, {**header, "tensors": header["tensors"][:1]}):
        with pytest.raises(ProtocolError):
            decode_state(bad, payload, STATE)
    with pytest.raises(ProtocolError):
        decode_state(header, payload[:-1], STATE)
    for tensors in ({"conv": _state(0)["conv"]}, {**_state(0), "conv": torch.zeros(6, 3)}):
        with pytest.raises(ValueError):
            encode_state("r", 0, tensors, STATE)
    with pytest.raises(ValueError):
        encode_state("r", 2, _state(0), STATE)
