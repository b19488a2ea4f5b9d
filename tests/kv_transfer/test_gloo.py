"""gloo-specific behaviour: pairs are reused, and rebuilt after they die (workers join and leave)."""

from __future__ import annotations

import time

from kv_transfer import KVPoll
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


def test_join_watcher_idle_longer_than_stale_window_still_reads_the_first_join():
    """Regression: a watcher idle for longer than its stale window must not skip a slot that was reserved a
    moment ago (the record is written right after the reservation)."""
    import threading
    import time

    from kv_transfer.gloo.rendezvous import JoinWatcher, announce, connect_store, host_store

    store = host_store("127.0.0.1")
    seen: list[dict] = []
    got = threading.Event()
    watcher = JoinWatcher("127.0.0.1", store.port, lambda rec: (seen.append(rec), got.set()), poll_s=0.01,
                          stale_s=0.1)
    try:
        time.sleep(0.4)  # idle well past the stale window
        announce(connect_store("127.0.0.1", store.port, 5.0), pair_key="p/1", prefill_id="p")
        assert got.wait(5.0) and seen[0]["pair_key"] == "p/1"
    finally:
        watcher.close()
