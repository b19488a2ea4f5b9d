"""gRPC-specific behaviour: frames split into many Push messages are reassembled exactly."""

from __future__ import annotations

import time

from kv_transfer import KVPoll
from tests.kv_transfer.kvutil import Collector, make_kv, make_layout, make_manager


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
