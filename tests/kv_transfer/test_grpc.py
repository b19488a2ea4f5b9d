"""gRPC-specific behaviour: frames split into many Push messages are reassembled exactly; nothing is allocated on a
header's word, and a message or frame that cannot be verified is refused alone while its transfer goes on."""

from __future__ import annotations

import math
import time
from concurrent import futures

import grpc
import msgpack
import pytest
import torch

from duet_bench.chaos.proxy import FaultProxy
from kv_transfer import KVPoll, ProtocolError, frames
from kv_transfer.grpc.server import PING, PUSH, pack_ping, unpack_ping, unpack_summary
from tests.kv_transfer.kvutil import Collector, inject_after_layer0, make_kv, make_layout, make_manager, wait_until

HUGE = 1 << 40  # what a forged header may name


def test_frames_split_into_many_messages() -> None:
    decode, prefill = make_manager("grpc"), make_manager("grpc", chunk_bytes=100)
    try:
        layout = make_layout("bfloat16")
        lease = decode.lease("chunky", num_blocks=3, layout=layout, deadline_s=time.time() + 20)
        assert layout.layer_nbytes(3) > 7 * 100
        sink = Collector()
        receiver = decode.expect(lease, sink)
        sender = prefill.sender(lease)
        for layer in range(layout.num_layers):
            sender.send_layer(layer, *make_kv(layout, 3, seed=2, layer=layer))
        sender.finish({"n": 1})
        assert receiver.wait(10) is KVPoll.SUCCESS and sender.wait(10) is KVPoll.SUCCESS
        assert sink.matches(layout, 3, seed=2) and receiver.meta == {"n": 1}
    finally:
        prefill.close()
        decode.close()


@pytest.fixture
def big_allocations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every ``torch.empty`` of more than 64 Mi elements while the test runs (each raises MemoryError)."""
    seen: list[int] = []
    empty = torch.empty

    def spy(*size, **kwargs):
        dims = size[0] if len(size) == 1 and isinstance(size[0], tuple | list | torch.Size) else size
        if math.prod(dims) > 64 << 20:
            seen.append(math.prod(dims))
            raise MemoryError(f"test: torch.empty{tuple(dims)}")
        return empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", spy)
    return seen


def test_unverifiable_messages_mid_stream_are_refused_alone(monkeypatch, big_allocations) -> None:
    """In the middle of a transfer's stream: a header naming 1 TiB (its MAC stale), bytes that are no header, and a
    forged frame of another version with its payload. Each is refused and counted, nothing is allocated for the
    1 TiB, and the layers after them still count: the transfer completes bit-exact."""
    def forged(header: dict, payload: torch.Tensor) -> list[tuple[bytes, torch.Tensor | None]]:
        return [(frames.pack({**header, "layer": 1, "nbytes": HUGE}), None), (b"\xc1 no header", None),
                (frames.pack({**header, "layer": 1, "v": 99}), payload)]

    decode, prefill = make_manager("grpc"), make_manager("grpc")
    try:
        lease = decode.lease("mid-stream", num_blocks=2, layout=make_layout(), deadline_s=time.time() + 20)
        sink = Collector()
        receiver = decode.expect(lease, sink)
        inject_after_layer0(None, monkeypatch, forged)
        sender = prefill.sender(lease)
        for layer in range(lease.layout.num_layers):
            sender.send_layer(layer, *make_kv(lease.layout, 2, seed=9, layer=layer))
        sender.finish({})
        assert sender.wait(10) is KVPoll.SUCCESS, sender.failure_exception()
        assert receiver.wait(5) is KVPoll.SUCCESS and sink.matches(lease.layout, 2, seed=9)
        assert wait_until(lambda: decode.refused() == {"Unauthenticated": 3}), decode.refused()
        assert big_allocations == []
    finally:
        prefill.close()
        decode.close()


def test_a_header_naming_more_than_its_lease_allocates_nothing_without_auth(big_allocations) -> None:
    """Auth off (explicit opt-out), a stranger's call: a layer header naming 1 TiB for a lease of 1 KiB layers is
    refused before anything is read or allocated; the transfer it named fails typed."""
    decode = make_manager("grpc", secret=None, insecure=True)
    try:
        lease = decode.lease("oversized", num_blocks=2, layout=make_layout(), deadline_s=time.time() + 20)
        receiver = decode.expect(lease, Collector())
        header = {"v": frames.FRAME_VERSION, "kind": "layer", "to": frames.TO_RECEIVER, "request_id": lease.request_id,
                  "layer": 0, "nbytes": HUGE}
        with grpc.insecure_channel(decode.endpoint) as channel:
            summary = unpack_summary(channel.stream_unary(PUSH)(iter([frames.pack(header)]), timeout=10))
        assert not summary["ok"] and "payload bytes" in summary["reason"]
        assert receiver.poll() is KVPoll.FAILED and isinstance(receiver.failure_exception(), ProtocolError)
        assert big_allocations == []
    finally:
        decode.close()


def _transfer(decode, prefill, rid: str, *, deadline_s: float = 1.5) -> bool:
    """One small transfer prefill -> decode; True when both ends reach SUCCESS and the data is exact."""
    layout = make_layout("float32")
    lease = decode.lease(rid, num_blocks=2, layout=layout, deadline_s=time.time() + deadline_s)
    sink = Collector()
    receiver = decode.expect(lease, sink)
    sender = prefill.sender(lease)
    for layer in range(layout.num_layers):
        sender.send_layer(layer, *make_kv(layout, 2, seed=5, layer=layer))
    sender.finish({"n": 1})
    ok = receiver.wait(deadline_s + 5) is KVPoll.SUCCESS and sender.wait(deadline_s + 5) is KVPoll.SUCCESS
    return ok and sink.matches(layout, 2, seed=5)


def test_a_wedged_link_is_replaced_and_a_healthy_one_kept() -> None:
    """A link that stops answering (the proxy holds every byte, nothing closes) is closed once a Push call runs into
    its deadline with no call answered meanwhile; the next transfer dials afresh. A transfer that times out on a
    link that still answers (the sender never finishes) replaces nothing."""
    proxy = FaultProxy()
    decode, prefill = make_manager("grpc"), make_manager("grpc", proxy=proxy.address)
    try:
        assert _transfer(decode, prefill, "warm")
        layout = make_layout("float32")
        lease = decode.lease("unfinished", num_blocks=2, layout=layout, deadline_s=time.time() + 1.0)
        receiver, sender = decode.expect(lease, Collector()), prefill.sender(lease)
        assert receiver.wait(10) is KVPoll.FAILED and sender.wait(10) is KVPoll.FAILED
        assert wait_until(lambda: sender.call.done(), 10)
        assert wait_until(lambda: not any(link.probing for link in list(prefill._links)), 10)  # the link answered
        assert prefill.links_replaced == 0 and proxy.connections == 1
        proxy.set_mode("stall")
        assert not _transfer(decode, prefill, "stalled", deadline_s=1.0)
        assert wait_until(lambda: prefill.links_replaced == 1, 10)
        proxy.set_mode("forward")
        assert _transfer(decode, prefill, "after") and proxy.connections == 2
        assert prefill.num_active() == 0 and wait_until(lambda: decode.num_active() == 0, 10)
    finally:
        prefill.close()
        decode.close()
        proxy.close()


def test_a_sender_made_while_its_link_is_probed_dials_afresh() -> None:
    """A transfer fails on a stalled link, so the link is probed; a sender made meanwhile does not wait for the
    verdict: it dials a fresh channel. The probe answers once the bytes flow again, so nothing counts as replaced,
    and the probed channel, retired, is closed once idle (no transfer is left on it)."""
    proxy = FaultProxy()
    decode, prefill = make_manager("grpc"), make_manager("grpc", proxy=proxy.address, probe_s=10.0)
    try:
        assert _transfer(decode, prefill, "warm")
        layout = make_layout("float32")
        proxy.set_mode("stall")
        assert not _transfer(decode, prefill, "stalled", deadline_s=1.0)
        old = prefill._channels[decode.endpoint]
        assert wait_until(lambda: old.probing, 5)
        lease = decode.lease("fresh", num_blocks=2, layout=layout, deadline_s=time.time() + 10)
        sink = Collector()
        receiver, sender = decode.expect(lease, sink), prefill.sender(lease)
        assert prefill._channels[decode.endpoint] is not old and old.retired
        for layer in range(layout.num_layers):
            sender.send_layer(layer, *make_kv(layout, 2, seed=5, layer=layer))
        sender.finish({"n": 1})
        proxy.set_mode("forward")
        assert sender.wait(10) is KVPoll.SUCCESS and receiver.wait(10) is KVPoll.SUCCESS
        assert sink.matches(layout, 2, seed=5) and proxy.connections == 2
        assert wait_until(lambda: old.closed, 10) and prefill.links_replaced == 0
        assert old not in prefill._links
    finally:
        prefill.close()
        decode.close()
        proxy.close()


def test_ping_echoes_its_nonce_and_refuses_anything_else() -> None:
    """The probe method answers a versioned msgpack nonce with the same nonce, without a lease; anything else ends
    INVALID_ARGUMENT, and the data plane goes on."""
    decode = make_manager("grpc")
    try:
        with grpc.insecure_channel(decode.endpoint) as channel:
            ping = channel.unary_unary(PING)
            assert unpack_ping(ping(pack_ping(b"n0nce"), timeout=5)) == b"n0nce"
            for bad in (b"", b"\xc1", msgpack.packb({"v": 2, "nonce": b"x"}), msgpack.packb({"v": 1}),
                        msgpack.packb({"v": 1, "nonce": b"x" * 33}), b"x" * 1000):
                with pytest.raises(grpc.RpcError) as e:
                    ping(bad, timeout=5)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        with pytest.raises(ProtocolError):
            unpack_ping(msgpack.packb([1, 2]))
    finally:
        decode.close()


@pytest.mark.parametrize("seed", [0, 3])
def test_the_link_recovers_within_a_deadline_after_corrupted_bytes(seed: int) -> None:
    """Bits flipped in the prefill -> decode byte stream while transfers run (HTTP/2 frames included, which can
    leave a connection answering pings while no stream moves): once the bytes flow clean again, a transfer
    succeeds within a couple of lease deadlines, not after minutes."""
    proxy = FaultProxy(seed=seed)
    decode, prefill = make_manager("grpc"), make_manager("grpc", proxy=proxy.address)
    try:
        assert _transfer(decode, prefill, "warm")
        proxy.set_mode("corrupt")
        with futures.ThreadPoolExecutor(32) as pool:  # a transfer started every 0.1 s for 3 s
            for i in range(30):
                pool.submit(_transfer, decode, prefill, f"c{i}", deadline_s=2.0)
                time.sleep(0.1)
            proxy.set_mode("forward")
            assert proxy.corrupted_chunks > 0
            # the transfers begun on corrupted bytes run out over the next lease deadline, each closing the link it
            # used (a fresh transfer sharing that link fails with it); counted from then, a couple of deadlines
            until = time.monotonic() + 2.0 + 3 * 2.0
            ok, i = False, 0
            while not ok and time.monotonic() < until:
                ok, i = _transfer(decode, prefill, f"p{i}", deadline_s=2.0), i + 1
            assert ok, (i, prefill.links_replaced)
        assert wait_until(lambda: prefill.num_active() == 0 and decode.num_active() == 0, 10)
    finally:
        prefill.close()
        decode.close()
        proxy.close()
