"""Data-plane authentication at the transport level (kv_transfer.auth): strangers cannot join a gloo pair or open a
gRPC Push; forged, replayed and cross-lease frames are refused, counted and touch no block while the target transfer
completes bit-exact; the secret never reaches a log line."""

from __future__ import annotations

import base64
import logging
import threading
import time

import grpc
import msgpack
import pytest
import torch

from kv_transfer import ClusterSecret, KVPoll, Unauthenticated, frames
from kv_transfer.auth import LeaseAuth
from kv_transfer.gloo import rendezvous
from kv_transfer.gloo.manager import parse_endpoint
from kv_transfer.grpc import client as grpc_client
from kv_transfer.grpc.server import PUSH, call_metadata
from tests.kv_transfer.kvutil import TEST_SECRET, TRANSPORTS, Collector, make_kv, make_layout, make_manager, wait_until

STRANGER = ClusterSecret(b"not-the-cluster-secret-000000000")


@pytest.fixture
def pair(request):
    decode, prefill = make_manager(request.param), make_manager(request.param)
    yield decode, prefill
    prefill.close()
    decode.close()


def _send_all(sender, lease, seed: int) -> None:
    for layer in range(lease.layout.num_layers):
        sender.send_layer(layer, *make_kv(lease.layout, lease.num_blocks, seed=seed, layer=layer))
    sender.finish({"seed": seed})


def _bad_frames(header: dict, payload: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
    """After layer 0 went out as (header, payload): its replay, a forged layer 1 (MAC of layer 0), an unsealed
    stranger's layer 1, and a layer 1 bound to another lease of the same request -- all with a zero payload but
    the replay."""
    zeros = torch.zeros_like(payload)
    forged = {**header, "layer": 1}
    bare = {k: v for k, v in forged.items() if k not in ("lease", "seq", "mac")}
    other = LeaseAuth(TEST_SECRET, header["request_id"], "another-lease").seal(bare, zeros)
    return [(frames.pack(header), payload), (frames.pack(forged), zeros), (frames.pack(bare), zeros),
            (frames.pack(other), zeros)]


def _inject_after_layer0(transport: str, sender, monkeypatch) -> None:
    if transport == "grpc":
        original = grpc_client.Sender._messages

        def messages(self):
            pending = None
            for m in original(self):
                yield m
                if pending is not None:  # m was layer 0's payload (one message: the layers are small)
                    for h, p in _bad_frames(pending, torch.frombuffer(bytearray(m), dtype=torch.uint8)):
                        yield h
                        yield p.numpy().tobytes()
                    pending = None
                else:
                    try:
                        h = msgpack.unpackb(m, raw=False)
                    except Exception:  # noqa: BLE001 - a payload chunk
                        continue
                    if isinstance(h, dict) and h.get("kind") == "layer" and h.get("layer") == 0:
                        pending = h

        monkeypatch.setattr(grpc_client.Sender, "_messages", messages)
        return
    link = sender._link
    transmit = link._transmit

    def tx(header: bytes, payload) -> None:
        transmit(header, payload)
        h = msgpack.unpackb(header, raw=False)
        if h.get("kind") == "layer" and h.get("layer") == 0:
            for hb, p in _bad_frames(h, payload):
                transmit(hb, p)

    link._transmit = tx


@pytest.mark.parametrize("pair", TRANSPORTS, ids=TRANSPORTS, indirect=True)
def test_forged_replayed_and_cross_lease_frames_are_refused(pair, monkeypatch, caplog) -> None:
    decode, prefill = pair
    transport = decode.name
    caplog.set_level(logging.DEBUG)
    lease = decode.lease(f"target-{transport}", num_blocks=2, layout=make_layout(), deadline_s=time.time() + 20)
    sink = Collector()
    receiver = decode.expect(lease, sink)
    if transport == "grpc":
        _inject_after_layer0(transport, None, monkeypatch)
    sender = prefill.sender(lease)
    if transport != "grpc":
        assert wait_until(lambda: sender.poll() >= KVPoll.WAITING)
        _inject_after_layer0(transport, sender, monkeypatch)
    _send_all(sender, lease, seed=11)
    assert sender.wait(10) is KVPoll.SUCCESS, sender.failure_exception()
    assert receiver.wait(5) is KVPoll.SUCCESS
    assert sorted(sink.calls) == [0, 1, 2, 3] and sink.matches(lease.layout, 2, seed=11)  # no block touched
    assert wait_until(lambda: decode.refused() == {"FrameReplayed": 1, "Unauthenticated": 2, "LeaseMismatch": 1})
    assert prefill.refused() == {}
    assert any("refused" in r.getMessage() and "FrameReplayed" in r.getMessage() for r in caplog.records)
    _assert_secret_absent(caplog.text)


@pytest.mark.parametrize("pair", ["gloo"], indirect=True)
def test_stranger_cannot_join_a_gloo_pair(pair) -> None:
    decode, prefill = pair
    host, port, _ = parse_endpoint(decode.endpoint)
    store = rendezvous.connect_store(host, port, 5.0)
    slot = rendezvous.announce(store, pair_key="stranger/1", prefill_id="stranger")
    with pytest.raises(Unauthenticated, match="proof is wrong"):
        rendezvous.prove(store, slot, pair_key="stranger/1", secret=STRANGER, timeout_s=5.0)
    assert wait_until(lambda: decode.refused() == {"Unauthenticated": 1}) and decode.num_pairs() == 0
    # a whole manager with the wrong secret: its transfer fails typed, and the decode side counts it
    intruder = make_manager("gloo", secret=STRANGER)
    try:
        lease = decode.lease("victim", num_blocks=1, layout=make_layout(), deadline_s=time.time() + 20)
        sink = Collector()
        receiver = decode.expect(lease, sink)
        s = intruder.sender(lease)
        assert s.wait(10) is KVPoll.FAILED and isinstance(s.failure_exception(), Unauthenticated)
        assert decode.refused() == {"Unauthenticated": 2} and not sink.calls
        # the request still completes from its real prefill side
        real = prefill.sender(lease)
        _send_all(real, lease, seed=3)
        assert real.wait(10) is KVPoll.SUCCESS and receiver.wait(5) is KVPoll.SUCCESS
        assert sink.matches(lease.layout, 1, seed=3)
    finally:
        intruder.close()


@pytest.mark.parametrize("pair", ["grpc"], indirect=True)
def test_stranger_cannot_open_a_grpc_push(pair) -> None:
    decode, prefill = pair
    lease = decode.lease("victim", num_blocks=1, layout=make_layout(), deadline_s=time.time() + 20)
    sink = Collector()
    receiver = decode.expect(lease, sink)
    with grpc.insecure_channel(decode.endpoint) as channel:
        push = channel.stream_unary(PUSH)
        for metadata in (None, call_metadata(STRANGER, lease)):  # no token; a token from another secret
            with pytest.raises(grpc.RpcError) as info:
                push(iter([b"\x00" * 64]), timeout=5, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert decode.refused() == {"Unauthenticated": 2} and not sink.calls and receiver.poll() is KVPoll.WAITING
    intruder = make_manager("grpc", secret=STRANGER)
    try:
        s = intruder.sender(lease)
        _send_all(s, lease, seed=1)
        assert s.wait(10) is KVPoll.FAILED and isinstance(s.failure_exception(), Unauthenticated)
    finally:
        intruder.close()
    real = prefill.sender(lease)
    _send_all(real, lease, seed=4)
    assert real.wait(10) is KVPoll.SUCCESS and receiver.wait(5) is KVPoll.SUCCESS
    assert sink.matches(lease.layout, 1, seed=4) and decode.refused() == {"Unauthenticated": 3}


def test_auth_off_interoperates_and_secret_never_shows() -> None:
    secret = ClusterSecret.generate()
    assert "redacted" in repr(secret) and "redacted" in str(secret) and secret._key.hex() not in repr(secret)
    with pytest.raises(ValueError):
        ClusterSecret(b"short")
    decode, prefill = make_manager("inproc", secret=None), make_manager("inproc", secret=None)
    try:
        lease = decode.lease("open", num_blocks=1, layout=make_layout(), deadline_s=time.time() + 20)
        sink = Collector()
        receiver = decode.expect(lease, sink)
        sender = prefill.sender(lease)
        _send_all(sender, lease, seed=2)
        assert sender.wait(10) is KVPoll.SUCCESS and receiver.wait(5) is KVPoll.SUCCESS
    finally:
        prefill.close()
        decode.close()


def test_concurrent_leases_on_one_gloo_pair_keep_their_own_keys() -> None:
    decode, prefill = make_manager("gloo"), make_manager("gloo")
    try:
        leases = [decode.lease(f"c{i}", num_blocks=2, layout=make_layout(), deadline_s=time.time() + 20)
                  for i in range(4)]
        sinks = [Collector() for _ in leases]
        receivers = [decode.expect(lease, s) for lease, s in zip(leases, sinks, strict=True)]
        senders = [prefill.sender(lease) for lease in leases]
        threads = [threading.Thread(target=_send_all, args=(s, lease, i)) for i, (s, lease)
                   in enumerate(zip(senders, leases, strict=True))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(s.wait(10) is KVPoll.SUCCESS for s in senders)
        assert all(r.wait(5) is KVPoll.SUCCESS for r in receivers)
        assert all(s.matches(make_layout(), 2, seed=i) for i, s in enumerate(sinks))
        assert decode.refused() == {} and prefill.refused() == {}
    finally:
        prefill.close()
        decode.close()


def _assert_secret_absent(text: str) -> None:
    key = TEST_SECRET._key
    for form in (key.hex(), base64.b64encode(key).decode(), base64.urlsafe_b64encode(key).decode(), repr(key)):
        assert form not in text
