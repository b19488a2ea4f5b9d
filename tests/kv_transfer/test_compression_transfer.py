"""Modal KV compression through the in-process manager: decoded layers and dropped positions reach the sink, a
tampered codec header fails both sides, a context that does not fit is refused (the codec itself:
test_compression.py)."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from kv_transfer import CodecContext, CompressionPolicy, KVPoll, ModalCodec, ProtocolError
from kv_transfer.codec import decode_layer, encode_layer
from kv_transfer.compression import DEFAULT
from tests.kv_transfer.kvutil import make_manager, wait_until
from tests.kv_transfer.test_compression import MIXED, check_decoded, make_case, round_trip


# -- through a manager ----------------------------------------------------------------------------------------------
class DropSink:
    """Records decoded layers and the ``dropped=`` positions, when given."""

    def __init__(self) -> None:
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.dropped: dict[int, list[int]] = {}

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor, *, dropped: torch.Tensor | None = None) -> None:
        self.layers[layer] = (k.clone(), v.clone())
        if dropped is not None:
            self.dropped[layer] = dropped.tolist()


@pytest.fixture
def inproc():
    decode, prefill = make_manager("inproc"), make_manager("inproc")
    yield decode, prefill
    for m in (decode, prefill):
        assert wait_until(lambda m=m: m.num_active() == 0, 5.0)
    prefill.close()
    decode.close()


def transfer(inproc, policy: CompressionPolicy, sink, *, tamper=None):
    decode, prefill = inproc
    cases = [make_case(policy, tokens=30, kvh=2, d=16, block_size=4, seed=layer, scores=layer == 1)
             for layer in range(2)]
    lease = decode.lease(f"req-{uuid.uuid4().hex[:8]}", num_blocks=cases[0].num_blocks, layout=cases[0].layout,
                         deadline_s=time.time() + 20)
    receiver = decode.expect(lease, sink)
    sender = prefill.sender(lease, codec=ModalCodec(policy))
    sender.tamper = tamper
    for layer, case in enumerate(cases):
        visual = case.ctx.visual.clone()
        sender.send_layer(layer, case.k, case.v, case.ctx)
        case.ctx.visual.zero_()  # send_layer copied the context: this must not reach the wire
        case.ctx.visual = visual
    sender.finish({"first_token": 1})
    return cases, sender, receiver


@pytest.mark.parametrize("policy", [DEFAULT, MIXED], ids=["default", "dropping"])
def test_modal_transfer_delivers_decoded_layers(inproc, policy: CompressionPolicy) -> None:
    sink = DropSink()
    cases, sender, receiver = transfer(inproc, policy, sink)
    assert receiver.wait(10) is KVPoll.SUCCESS, receiver.failure_exception()
    assert sender.wait(10) is KVPoll.SUCCESS, sender.failure_exception()
    for layer, case in enumerate(cases):
        _, _, k, v, dropped = round_trip(case)
        assert torch.equal(sink.layers[layer][0], k) and torch.equal(sink.layers[layer][1], v)
        assert sink.dropped.get(layer) == (None if dropped is None else dropped.tolist())
    assert bool(sink.dropped) == (policy.keep_visual_tokens < 1)


def test_plain_three_argument_sinks_still_work_without_dropping(inproc) -> None:
    calls = []
    _, sender, receiver = transfer(inproc, DEFAULT, lambda layer, k, v: calls.append(layer))
    assert receiver.wait(10) is KVPoll.SUCCESS and sender.wait(10) is KVPoll.SUCCESS and sorted(calls) == [0, 1]


def test_tampered_codec_meta_fails_both_sides_with_protocol_error(inproc) -> None:
    def from_the_future(header: dict, payload: torch.Tensor) -> None:
        header["codec_meta"]["v"] = 2

    sink = DropSink()
    _, sender, receiver = transfer(inproc, DEFAULT, sink, tamper=from_the_future)
    assert receiver.wait(10) is KVPoll.FAILED and sender.wait(10) is KVPoll.FAILED
    assert isinstance(receiver.failure_exception(), ProtocolError) and "version 2" in str(receiver.failure_exception())
    assert isinstance(sender.failure_exception(), ProtocolError) and not sink.layers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_modal_codec_encodes_on_the_kv_device() -> None:
    case = make_case(MIXED, tokens=30, kvh=2, d=16, seed=7, visual_share=0.6, scores=True)
    cuda_ctx = CodecContext(30, case.ctx.visual.cuda(), case.ctx.k_channel_score.cuda(),
                            case.ctx.v_channel_score.cuda(), case.ctx.token_score.cuda())
    header, payload = encode_layer("r", 0, case.k.cuda(), case.v.cuda(), ModalCodec(MIXED), cuda_ctx)
    assert payload.is_cuda
    k2, v2, dropped = decode_layer(header, payload, case.layout)
    assert k2.is_cuda and dropped is not None and dropped.is_cuda
    check_decoded(case, header, payload.cpu(), k2.cpu(), v2.cpu(), dropped.cpu())
    header, payload = encode_layer("r", 0, case.k.cuda(), case.v.cuda(), ModalCodec(MIXED), cuda_ctx,
                                   payload_device=torch.device("cpu"))
    assert not payload.is_cuda
    check_decoded(case, header, payload, *decode_layer(header, payload, case.layout))


def test_send_layer_rejects_a_context_that_does_not_fit(inproc) -> None:
    decode, prefill = inproc
    case = make_case(DEFAULT, tokens=10, kvh=2, d=8, block_size=4)
    lease = decode.lease("ctx-" + uuid.uuid4().hex[:6], num_blocks=case.num_blocks, layout=case.layout)
    receiver = decode.expect(lease, DropSink())
    sender = prefill.sender(lease, codec=ModalCodec(DEFAULT))
    for bad in (CodecContext(13, torch.zeros(13, dtype=torch.bool)), CodecContext(10, torch.zeros(9, dtype=torch.bool)),
                CodecContext(10, torch.zeros(10, dtype=torch.bool), k_channel_score=torch.ones(2, 4))):
        with pytest.raises(ValueError, match="CodecContext"):
            sender.send_layer(0, case.k, case.v, bad)
    sender.abort("done")
    assert receiver.wait(5) is KVPoll.FAILED
