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
