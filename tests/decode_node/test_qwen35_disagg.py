"""Qwen3.5-MoE disaggregated in one process: the prefill worker streams each attention layer's KV and each GDN
layer's final state (state frames) to the decode worker, which commits the request only when all of them arrived.

Greedy tokens and logits equal the local engine's (one image, two images of different sizes, text only, a prompt of
several prefill chunks, a mixed batch); a corrupted state frame fails its request with ChecksumMismatch and the retry
is exact; an abort while state frames are in flight leaves no KV block and no state slot on either side; an
expert-parallel decode group of 2 (the shared expert on every rank) decodes as the local engine does.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from cluster.control.local_pair import LocalPair
from engine import LLM, EngineConfig
from duet_testing.qwen35_checkpoints import make_tiny_qwen35_checkpoint
from kv_transfer import ChecksumMismatch, KVPoll
from kv_transfer.state_frames import STATE_FORMAT
from tests.conftest import LLM_DEFAULTS, greedy
from tests.decode_node.test_expert_parallel import _decode_group
from tests.engine.test_qwen_vl import SIZES, build_prompt, image, request

CFG = dict(dtype="float32", num_kv_blocks=96, block_size=4, max_num_seqs=8, max_model_len=256,
           max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_qwen35_checkpoint(tmp_path_factory.mktemp("qwen35-disagg") / "ckpt")


@pytest.fixture(scope="module")
def prompts(ckpt) -> dict[str, dict]:
    ims = [image(30 + i, SIZES[s]) for i, s in enumerate(["100x61", "47x133", "33x47"])]
    return {"one-image": request(build_prompt(ims[:1], ckpt, seed=1), ims[:1]),
            "two-images": request(build_prompt(ims[1:], ckpt, seed=2), ims[1:]),
            "text-only": request(build_prompt([], ckpt, seed=3, text=9), []),
            "long": request(build_prompt(ims[:1], ckpt, seed=4, text=40), ims[:1])}  # 4 prefill chunks of 24


def _local(ckpt, prompts, params):
    return LLM(ckpt, **CFG).generate(prompts, params)


def test_pair_matches_local_and_moves_state_beside_kv(ckpt, prompts):
    params = greedy(8, return_logits=True)
    local = _local(ckpt, list(prompts.values()), params)
    pair = LocalPair(ckpt, EngineConfig(**CFG))
    lease = pair.decode.state_layout
    assert pair.decode.layout.num_layers == 1 and lease.num_frames == 3  # 1 attention layer, 3 GDN layers
    try:
        outs, failed = pair.generate(list(prompts.values()), params)
        assert not failed
        pair.check_no_leaks()
        assert pair.prefill_manager.num_active() == pair.decode_manager.num_active() == 0
    finally:
        pair.close()
    for name, want, got in zip(prompts, local, outs, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, name
        for a, b in zip(got.outputs[0].logits, want.outputs[0].logits[1:], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def _tamper_state_frames(pair: LocalPair, tamper) -> None:
    make = pair.prefill_manager.sender

    def sender(lease, **kw):
        s = make(lease, **kw)
        s.tamper = tamper
        return s

    pair.prefill_manager.sender = sender


def test_corrupted_state_frame_is_a_typed_failure_and_the_retry_is_exact(ckpt, prompts):
    seen: list[dict] = []

    def flip(header: dict, payload: torch.Tensor) -> None:
        if header["kind"] == "state" and header["index"] == 1:
            seen.append(dict(header))
            payload[-1] ^= 0x01  # one bit of the recurrent state

    want = _local(ckpt, [prompts["two-images"]], greedy(6))[0].outputs[0].token_ids
    pair = LocalPair(ckpt, EngineConfig(**CFG))
    try:
        _tamper_state_frames(pair, flip)
        outs, failed = pair.generate([prompts["two-images"]], greedy(6))
        assert outs == [None] and ChecksumMismatch.__name__ in failed["pair-0"]
        assert seen and seen[0]["format"] == STATE_FORMAT and seen[0]["nbytes"] == pair.decode.state_layout.frame_nbytes
        pair.check_no_leaks()
        _tamper_state_frames(pair, None)  # the retry (a fresh transfer) travels clean
        outs, failed = pair.generate([prompts["two-images"]], greedy(6))
        assert not failed and outs[0].outputs[0].token_ids == want
        pair.check_no_leaks()
    finally:
        pair.close()


def test_abort_while_state_frames_are_in_flight_frees_both_sides(ckpt, prompts):
    """State frame 0 arrived, frame 1 is held on the wire: aborting the request on both workers leaves no block,
    no state slot and no live transfer."""
    hold, reached = threading.Event(), threading.Event()

    def stall(header: dict, payload: torch.Tensor) -> None:
        if header["kind"] == "state" and header["index"] == 1:
            reached.set()
            hold.wait(10)

    pair = LocalPair(ckpt, EngineConfig(**CFG))
    try:
        _tamper_state_frames(pair, stall)
        to_prefill, to_decode = pair.wire(prompts["one-image"])
        lease = pair.decode.allocate("r", to_decode, greedy(4))
        assert pair.decode.engine.requests["r"].state_slot is not None
        pair.prefill.submit("r", to_prefill, greedy(4), pair.prefill_manager.sender(lease, codec=pair.prefill.codec))
        while not reached.is_set():
            pair.prefill.step()
        receiver = pair.decode.receivers["r"]
        for _ in range(200):  # frame 0 left the sender; the receiver's transport thread verifies it on its own time
            if receiver.state_bytes > 0:
                break
            threading.Event().wait(0.025)
        assert receiver.poll() is KVPoll.TRANSFERRING and receiver.state_bytes > 0  # frame 0 landed
        assert pair.decode.abort("r", "client went away")
        pair.prefill.abort("r", "client went away")  # prefill already handed its part to the wire: a no-op
        hold.set()
        receiver.wait(5)
        assert receiver.poll() is KVPoll.FAILED
        for _ in range(50):
            if pair.prefill_manager.num_active() == pair.decode_manager.num_active() == 0:
                break
            threading.Event().wait(0.05)
        assert pair.prefill_manager.num_active() == pair.decode_manager.num_active() == 0
        pair.check_no_leaks()
        assert pair.decode.engine.block_manager.state_slots.num_free == pair.decode.engine.num_state_slots
    finally:
        hold.set()
        pair.close()


def test_expert_parallel_decode_group_of_2_keeps_the_shared_expert_on_every_rank(ckpt, prompts):
    names = ["one-image", "text-only", "two-images"]
    params = [greedy(8), greedy(6), greedy(7)]
    want = [o.outputs[0].token_ids for o in LLM(ckpt, **LLM_DEFAULTS).generate([prompts[n] for n in names], params)]
    got, _, workers = _decode_group(ckpt, 2, 4, [prompts[n] for n in names], params, None, change_at=-1)
    assert got == want
    for w in workers:
        moe = [layer.mlp for layer in w.engine.model.text.layers]
        assert all(m.executor is not None and m.shared_expert.gate_up_proj.weight.abs().sum() > 0 for m in moe)
        w.engine.block_manager.check_no_leaks()


def test_choices_fork_on_the_decode_side_with_the_received_state(ckpt, prompts):
    import dataclasses

    params = dataclasses.replace(greedy(6), n=2)
    want = _local(ckpt, [prompts["one-image"]], greedy(6))[0].outputs[0].token_ids
    pair = LocalPair(ckpt, EngineConfig(**CFG))
    try:
        outs, failed = pair.generate([prompts["one-image"]], params)
        assert not failed and [c.token_ids for c in outs[0].outputs] == [want, want]
        pair.check_no_leaks()
    finally:
        pair.close()


def test_decode_side_keeps_the_image_kv_coded_beside_the_received_state(ckpt, prompts):
    """Hybrid model, ``visual_kv_cache="int8"`` on the decode side: the attention layer's whole image blocks go into
    pages (the GDN state arrives as before); decoding stays close to the local engine's and frees everything."""
    names = ["one-image", "two-images", "long"]
    local = _local(ckpt, [prompts[n] for n in names], greedy(8))
    pair = LocalPair(ckpt, EngineConfig(**CFG, visual_kv_cache="int8"), prefill_config=EngineConfig(**CFG))
    pages, step = [0], pair.decode.step

    def watched():
        report = step()
        pages[0] = max(pages[0], pair.decode.engine.block_manager.num_pages)
        return report

    pair.decode.step = watched
    try:
        outs, failed = pair.generate([prompts[n] for n in names], greedy(8))
        assert not failed
        pair.check_no_leaks()
        assert pair.decode.engine.block_manager.num_pages == 0
    finally:
        pair.close()
    assert pages[0] > 0
    same = [a == b for want, got in zip(local, outs, strict=True)
            for a, b in zip(want.outputs[0].token_ids, got.outputs[0].token_ids, strict=True)]
    assert sum(same) >= 0.8 * len(same)
