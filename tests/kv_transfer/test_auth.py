"""Data-plane authentication at the transport level (kv_transfer.auth): strangers cannot join a gloo pair or open a
gRPC Push; forged, replayed and cross-lease frames are refused, counted and touch no block while the target transfer
completes bit-exact; a forged link ``bye`` closes nothing; a cross-process manager needs a secret or an explicit
opt-out; the secret never reaches a log line."""

from __future__ import annotations

import base64
import logging
import threading
import time

import grpc
import pytest
import torch

from kv_transfer import ClusterSecret, KVPoll, MissingSecret, Unauthenticated, frames, get_manager_class
from kv_transfer.auth import LeaseAuth, LinkAuth
from kv_transfer.gloo import rendezvous
from kv_transfer.gloo.manager import parse_endpoint
from kv_transfer.grpc.server import PUSH, call_metadata
from kv_transfer.link import LinkState
from tests.kv_transfer.kvutil import (
    TEST_SECRET,
    TRANSPORTS,
    Collector,
    inject_after_layer0,
    make_kv,
    make_layout,
    make_manager,
    wait_until,
)

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


@pytest.mark.parametrize("pair", TRANSPORTS, ids=TRANSPORTS, indirect=True)
def test_forged_replayed_and_cross_lease_frames_are_refused(pair, monkeypatch, caplog) -> None:
    decode, prefill = pair
    transport = decode.name
    caplog.set_level(logging.DEBUG)
    lease = decode.lease(f"target-{transport}", num_blocks=2, layout=make_layout(), deadline_s=time.time() + 20)
    sink = Collector()
    receiver = decode.expect(lease, sink)
    if transport == "grpc":
        inject_after_layer0(None, monkeypatch, _bad_frames)
    sender = prefill.sender(lease)
    if transport != "grpc":
        assert wait_until(lambda: sender.poll() >= KVPoll.WAITING)
        inject_after_layer0(sender, monkeypatch, _bad_frames)
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
    slot = rendezvous.announce(store, pair_key="stranger/1", prefill_id="stranger")  # no claim: refused at once
    with pytest.raises(Unauthenticated, match="no valid claim"):
        rendezvous.prove(store, slot, pair_key="stranger/1", secret=STRANGER, timeout_s=5.0)
    # a replayed record (its claim is valid) is challenged, and the stranger cannot answer
    slot = rendezvous.announce(store, pair_key="replayed/1", prefill_id="stranger", secret=TEST_SECRET)
    with pytest.raises(Unauthenticated, match="proof is wrong"):
        rendezvous.prove(store, slot, pair_key="replayed/1", secret=STRANGER, timeout_s=5.0)
    assert wait_until(lambda: decode.refused() == {"Unauthenticated": 2}) and decode.num_pairs() == 0
    # a whole manager with the wrong secret: its transfer fails typed, and the decode side counts it
    intruder = make_manager("gloo", secret=STRANGER)
    try:
        lease = decode.lease("victim", num_blocks=1, layout=make_layout(), deadline_s=time.time() + 20)
        sink = Collector()
        receiver = decode.expect(lease, sink)
        s = intruder.sender(lease)
        assert s.wait(10) is KVPoll.FAILED and isinstance(s.failure_exception(), Unauthenticated)
        assert decode.refused() == {"Unauthenticated": 3} and not sink.calls
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


def _decode_link(decode, prefill):
    """The decode side's link to ``prefill`` (gloo: its one pair; inproc: the queue link back)."""
    return next(iter(decode._in)) if decode.name == "gloo" else decode._links.get(prefill.endpoint)


@pytest.mark.parametrize("transport", ["inproc", "gloo"], ids=["inproc", "gloo"])
def test_forged_link_frames_neither_close_the_link_nor_fail_its_transfers(transport, monkeypatch) -> None:
    """An unsealed ``bye``, one sealed under another secret and the decode side's own ``bye`` reflected back to it
    arrive on a link in the middle of a transfer: each is refused and counted, the link stays up and the transfer
    completes (an accepted ``bye`` would fail every transfer on the link)."""
    decode, prefill = make_manager(transport), make_manager(transport)
    try:
        lease = decode.lease(f"bye-{transport}", num_blocks=2, layout=make_layout(), deadline_s=time.time() + 20)
        sink = Collector()
        receiver = decode.expect(lease, sink)
        sender = prefill.sender(lease)
        assert wait_until(lambda: sender.poll() >= KVPoll.WAITING)
        bye = frames.link_frame("bye")

        def forged(header: dict, payload: torch.Tensor) -> list[tuple[bytes, None]]:
            assert wait_until(lambda: _decode_link(decode, prefill) is not None)
            reflected = _decode_link(decode, prefill).auth.seal(bye, None)
            return [(frames.pack(f), None) for f in (bye, LinkAuth(STRANGER, "x", side="1", peer="0").seal(bye, None),
                                                     reflected)]

        inject_after_layer0(sender, monkeypatch, forged)
        _send_all(sender, lease, seed=5)
        assert sender.wait(10) is KVPoll.SUCCESS, sender.failure_exception()
        assert receiver.wait(5) is KVPoll.SUCCESS and sink.matches(lease.layout, 2, seed=5)
        assert wait_until(lambda: decode.refused() == {"Unauthenticated": 3}), decode.refused()
        assert sender._link.state is LinkState.UP and _decode_link(decode, prefill).state is LinkState.UP
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("transport", ["gloo", "nccl", "grpc"])
def test_cross_process_managers_fail_closed_without_a_secret(transport: str) -> None:
    cls = get_manager_class(transport)
    for kwargs in ({}, {"secret": None}):
        with pytest.raises(MissingSecret, match="insecure=True"):
            cls(**kwargs)
    with pytest.raises(ValueError, match="one of them"):
        cls(secret=TEST_SECRET, insecure=True)
    get_manager_class("inproc")().close()  # in one process nothing crosses a boundary: no secret needed


@pytest.mark.parametrize("transport", ["gloo", "grpc"])
def test_the_explicit_opt_out_runs_the_data_plane_without_auth(transport: str) -> None:
    decode, prefill = (make_manager(transport, secret=None, insecure=True) for _ in range(2))
    try:
        lease = decode.lease(f"open-{transport}", num_blocks=1, layout=make_layout(), deadline_s=time.time() + 20)
        sink = Collector()
        receiver = decode.expect(lease, sink)
        sender = prefill.sender(lease)
        _send_all(sender, lease, seed=8)
        assert sender.wait(10) is KVPoll.SUCCESS and receiver.wait(5) is KVPoll.SUCCESS
        assert sink.matches(lease.layout, 1, seed=8) and decode.refused() == {}
    finally:
        prefill.close()
        decode.close()
