"""CUDA paths (skipped without a GPU): CUDA tensors through every transport, and NCCL pairs on 2+ GPUs."""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid

import pytest
import torch

from kv_transfer import IdentityCodec, KVPoll, get_manager_class
from kv_transfer.codec import decode_layer, encode_layer
from tests.kv_transfer import peer
from tests.kv_transfer.kvutil import (
    TRANSPORTS,
    Collector,
    make_kv,
    make_layout,
    make_manager,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_identity_codec_on_cuda_matches_cpu() -> None:
    layout = make_layout("bfloat16")
    k, v = make_kv(layout, 4, seed=1, layer=2)
    cpu_header, _ = encode_layer("r", 2, k, v, IdentityCodec())
    header, payload = encode_layer("r", 2, k.cuda(), v.cuda(), IdentityCodec())
    assert payload.is_cuda and header["checksums"] == cpu_header["checksums"]
    k2, v2, _ = decode_layer(header, payload, layout)
    assert k2.is_cuda and torch.equal(k2.cpu(), k) and torch.equal(v2.cpu(), v)


@pytest.mark.parametrize("transport", TRANSPORTS, ids=TRANSPORTS)
def test_cuda_layers_round_trip(transport: str) -> None:
    decode, prefill = make_manager(transport), make_manager(transport)
    try:
        layout = make_layout("bfloat16")
        lease = decode.lease("gpu-" + uuid.uuid4().hex[:6], num_blocks=3, layout=layout,
                             deadline_s=time.time() + 20)
        sink = Collector()
        receiver = decode.expect(lease, sink)
        sender = prefill.sender(lease)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):  # layers produced on a side stream, as by a model runner
            for layer in range(layout.num_layers):
                k, v = make_kv(layout, 3, seed=5, layer=layer)
                sender.send_layer(layer, k.cuda(non_blocking=True), v.cuda(non_blocking=True))
        sender.finish({})
        assert receiver.wait(10) is KVPoll.SUCCESS, receiver.failure_exception()
        assert sender.wait(10) is KVPoll.SUCCESS
        on_gpu = {k.is_cuda for k, _ in sink.layers.values()}
        assert on_gpu == ({True} if decode.supports_gpu_direct else {False})
        sink.layers = {i: (k.cpu(), v.cpu()) for i, (k, v) in sink.layers.items()}
        assert sink.matches(layout, 3, seed=5)
    finally:
        prefill.close()
        decode.close()


def test_nccl_manager_constructs() -> None:
    manager = get_manager_class("nccl")(insecure=True)
    try:
        assert manager.supports_gpu_direct and manager.endpoint
    finally:
        manager.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU")
def test_nccl_round_trip_across_processes() -> None:
    torch.cuda.set_device(0)
    decode = make_manager("nccl")
    try:
        layout = make_layout("bfloat16")
        lease = decode.lease("nccl-" + uuid.uuid4().hex[:6], num_blocks=4, layout=layout,
                             deadline_s=time.time() + 90)
        sink = Collector()
        receiver = decode.expect(lease, sink)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        proc = ctx.Process(target=peer.prefill_main, args=("nccl", [lease.to_dict()], [3], "all", results, "cuda:1"),
                           daemon=True)
        proc.start()
        try:
            assert receiver.wait(80) is KVPoll.SUCCESS, receiver.failure_exception()
            assert results.get(timeout=30)[1] == ["SUCCESS"]
        finally:
            proc.join(15)
            if proc.is_alive():
                proc.kill()
        sink.layers = {i: (k.cpu(), v.cpu()) for i, (k, v) in sink.layers.items()}
        assert sink.matches(layout, 4, seed=3)
    finally:
        decode.close()
