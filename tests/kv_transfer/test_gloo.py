"""gloo-specific behaviour: pairs are reused, and rebuilt after they die (workers join and leave); what a stranger
writes to the rendezvous store cannot stall a join."""

from __future__ import annotations

import threading
import time

import msgpack
import torch

from kv_transfer import KVPoll
from kv_transfer.gloo import rendezvous
from kv_transfer.gloo.manager import parse_endpoint
from tests.kv_transfer.kvutil import (
    Collector,
    make_kv,
    make_layout,
    make_manager,
    wait_until,
)


def transfer(decode, prefill, request_id: str) -> KVPoll:
    lease = decode.lease(request_id, num_blocks=2, layout=make_layout(), deadline_s=time.time() + 20)
    sink = Collector()
    receiver = decode.expect(lease, sink)
    sender = prefill.sender(lease)
    for layer in range(lease.layout.num_layers):
        sender.send_layer(layer, *make_kv(lease.layout, 2, seed=3, layer=layer))
    sender.finish({})
    assert sender.wait(10) is KVPoll.SUCCESS
    assert sink.matches(lease.layout, 2, seed=3)
    return receiver.wait(1)


def test_pair_is_reused_then_rebuilt_after_it_closes() -> None:
    decode, prefill = make_manager("gloo"), make_manager("gloo")
    try:
        assert transfer(decode, prefill, "a") is KVPoll.SUCCESS
        assert transfer(decode, prefill, "b") is KVPoll.SUCCESS
        assert prefill.num_pairs() == 1 and decode.num_pairs() == 1
        for pair in list(decode._in):  # the decode side drops the pair (as when its worker restarts a link)
            pair.close()
        assert wait_until(lambda: prefill.num_pairs() == 0 and decode.num_pairs() == 0)
        assert transfer(decode, prefill, "c") is KVPoll.SUCCESS
        assert prefill.num_pairs() == 1 and decode.num_pairs() == 1
    finally:
        prefill.close()
        decode.close()
    assert prefill.num_pairs() == 0 and decode.num_pairs() == 0


def test_join_watcher_reads_a_join_after_idling() -> None:
    """A watcher idle for a while still takes the next join (nothing it waits for can go stale)."""
    store = rendezvous.host_store("127.0.0.1")
    seen: list[dict] = []
    got = threading.Event()
    watcher = rendezvous.JoinWatcher("127.0.0.1", store.port, lambda rec: (seen.append(rec), got.set()), poll_s=0.01)
    try:
        time.sleep(0.3)
        slot = rendezvous.announce(rendezvous.connect_store("127.0.0.1", store.port, 5.0), pair_key="p/1",
                                   prefill_id="p")
        assert got.wait(5.0) and seen[0]["pair_key"] == "p/1" and seen[0]["slot"] == slot
    finally:
        watcher.close()


def test_a_forged_join_counter_does_not_stall_pairing() -> None:
    """A stranger on the store's host adds 1,000 to the old join counter: a new pair still forms at once (the
    watcher used to wait out every unwritten slot the counter named, ``stale_s`` each)."""
    decode, prefill = make_manager("gloo"), make_manager("gloo")
    try:
        host, port, _ = parse_endpoint(decode.endpoint)
        rendezvous.connect_store(host, port, 5.0).add("duet/join/count", 1000)
        assert transfer(decode, prefill, "after-forgery") is KVPoll.SUCCESS  # within connect_timeout_s (2 s)
        assert decode.num_pairs() == 1 and decode.refused() == {}
    finally:
        prefill.close()
        decode.close()


def test_junk_in_the_join_queue_is_dropped_or_refused_at_once() -> None:
    """Garbage, a record of another version, one without its claim and one with a forged claim are each dropped
    or refused (counted) as they are popped; the join queued behind them pairs in time."""
    decode, prefill = make_manager("gloo"), make_manager("gloo")
    try:
        host, port, _ = parse_endpoint(decode.endpoint)
        store = rendezvous.connect_store(host, port, 5.0)
        record = {"v": rendezvous.JOIN_VERSION, "slot": 7, "pair_key": "x/1", "prefill_id": "x"}
        for junk in (b"\xc1 not msgpack", msgpack.packb({**record, "v": 1}), msgpack.packb(record),
                     msgpack.packb({**record, "slot": 8, "claim": b"\0" * 32})):
            store.queue_push(rendezvous.JOIN_QUEUE, junk)
        assert transfer(decode, prefill, "behind-junk") is KVPoll.SUCCESS
        assert decode.refused() == {"Unauthenticated": 2} and decode.num_pairs() == 1
        assert store.check(["duet/join/7/verdict", "duet/join/8/verdict"])  # refusals a joiner would read
    finally:
        prefill.close()
        decode.close()


def test_an_oversized_frame_ends_the_pair_before_anything_is_allocated() -> None:
    """The prefill side (an authenticated peer: the pair formed) announces a 256 MiB payload, far beyond what any lease
    the decode side issued allows: the decode side's pair stops at the preamble (it used to allocate the size and
    wait for it) and its transfer fails at once."""
    decode, prefill = make_manager("gloo"), make_manager("gloo")
    try:
        assert transfer(decode, prefill, "a") is KVPoll.SUCCESS
        pair = next(iter(prefill._out.values()))
        transmit = pair._transmit

        def forge(header: bytes, payload) -> None:
            transmit(header, payload)
            if msgpack.unpackb(header, raw=False).get("kind") == "layer":
                pair._send(pair._ctl, torch.tensor([len(header), 256 << 20], dtype=torch.int64))
                pair._send(pair._ctl, torch.frombuffer(bytearray(header), dtype=torch.uint8))

        pair._transmit = forge
        lease = decode.lease("b", num_blocks=2, layout=make_layout(), deadline_s=time.time() + 20)
        assert lease.max_payload_bytes < 2 << 20
        receiver = decode.expect(lease, Collector())
        sender = prefill.sender(lease)
        sender.send_layer(0, *make_kv(lease.layout, 2, seed=3, layer=0))
        assert receiver.wait(5) is KVPoll.FAILED and "no lease issued here allows" in str(receiver.failure_exception())
        assert wait_until(lambda: decode.num_pairs() == 0)
    finally:
        prefill.close()
        decode.close()
