"""Qwen3-VL-MoE through every disaggregated path: the in-process pair (:class:`cluster.control.local_pair.LocalPair`), Ray
actors over gloo and gRPC, an expert-parallel decode group of 2 (on the released checkpoints' transposed expert
layout), and ``default`` KV compression.

Greedy tokens equal the local engine's (float32; logits within 1e-4 where the path returns them, and transformers'
on one prompt) for one image, two images of different sizes in one prompt, text only, a ``<image>`` text prompt and a
batch of requests with different images. The hand-off (:mod:`kv_transfer.handoff`) carries the M-RoPE delta; a
version-1 hand-off parses as delta 0; a delta that disagrees with the decode side's own is a typed failure. The
decode side never runs the vision tower nor evaluates a prompt's pixels. No worker holds a KV block after any scenario.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from cluster.control.disagg import DisaggCluster
from cluster.control.local_pair import LocalPair
from cluster.control.spec import ClusterSpec
from engine import LLM, EngineConfig
from duet_testing.qwen_checkpoints import QwenTinySpec, load_qwen_reference
from engine.models.qwen3_vl.image_processor import QwenVLImageProcessor
from kv_transfer import ProtocolError
from kv_transfer.handoff import HANDOFF_VERSION, Handoff, HandoffMismatch
from tests.conftest import greedy

SPEC = QwenTinySpec()
IDS = SPEC.special_token_ids
CFG = dict(dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128)
SIZES = [(100, 61), (47, 133), (64, 64), (33, 90)]  # (height, width): 6, 4, 4 and 2 visual tokens
TRANSPORTS = ["gloo", "grpc"]


def qwen_image(seed: int, size: tuple[int, int]) -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    return PIL.Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def qwen_request(model_dir: Path, images: list[PIL.Image.Image], *, seed: int = 0, text: int = 3) -> dict:
    """``<|im_start|> text (<|vision_start|> pad x count <|vision_end|> text)* <|im_end|>`` with each image's own
    visual-token count, as transformers' processor expands it."""
    proc = QwenVLImageProcessor.from_pretrained(model_dir)
    rng = np.random.default_rng(seed)
    words = lambda: rng.integers(0, SPEC.vocab_size - len(IDS), text).tolist()  # noqa: E731
    ids = [IDS["<|im_start|>"], *words()]
    for im in images:
        ids += [IDS["<|vision_start|>"], *[SPEC.image_token_id] * proc.num_visual_tokens(im.height, im.width),
                IDS["<|vision_end|>"], *words()]
    ids.append(IDS["<|im_end|>"])
    return {"prompt_token_ids": ids, **({"multi_modal_data": {"image": images}} if images else {})}


def scenarios(model_dir: Path) -> dict[str, dict]:
    """One image, two of different sizes in one prompt, text only, a text prompt naming its image ``<image>``, and a
    batch of requests with different images."""
    ims = [qwen_image(i, s) for i, s in enumerate(SIZES)]
    return {"one-image": qwen_request(model_dir, ims[:1], seed=1),
            "two-images": qwen_request(model_dir, ims[:2], seed=2),
            "text-only": qwen_request(model_dir, [], seed=3, text=7),
            "text-prompt": {"prompt": "look <image> at it", "multi_modal_data": {"image": [ims[1]]}},
            **{f"batch-{i}": qwen_request(model_dir, [ims[i]], seed=10 + i) for i in range(len(ims))}}


def local_outputs(model_dir: Path, prompts: list[dict], params):
    return LLM(model_dir, **CFG).generate(prompts, params)


def pair_run(model_dir: Path, prompts: list[dict], params, **pair_kwargs):
    """(outputs, failures, pair) of one LocalPair run; asserts no block or request is left on either side."""
    pair = LocalPair(model_dir, EngineConfig(**CFG), **pair_kwargs)
    try:
        outs, failed = pair.generate(prompts, params)
        pair.check_no_leaks()
        return outs, failed, pair
    finally:
        pair.close()


@pytest.fixture(scope="module")
def qwen_dir(tiny_qwen_ckpt) -> Path:
    return tiny_qwen_ckpt()


@pytest.fixture(scope="module")
def prompts(qwen_dir) -> dict[str, dict]:
    return scenarios(qwen_dir)


@pytest.fixture(scope="module")
def reference(qwen_dir, prompts) -> dict[str, list[int]]:
    """The local engine's greedy tokens for every scenario (8 each)."""
    outs = local_outputs(qwen_dir, list(prompts.values()), greedy(8))
    return {k: o.outputs[0].token_ids for k, o in zip(prompts, outs, strict=True)}


# ------------------------------------------------------------------------------------------- in-process pair
def test_pair_matches_local_engine_and_transformers(qwen_dir, prompts):
    names = list(prompts)
    params = greedy(8, return_logits=True)
    local = local_outputs(qwen_dir, list(prompts.values()), params)
    outs, failed, _ = pair_run(qwen_dir, list(prompts.values()), params)
    assert not failed
    for name, want, got in zip(names, local, outs, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, name
        # the first token's logits stay on the prefill side; every decoded one must match
        for a, b in zip(got.outputs[0].logits, want.outputs[0].logits[1:], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    # and transformers' generate on the two-image prompt
    p = prompts["two-images"]
    ims = p["multi_modal_data"]["image"]
    pixels, grid = QwenVLImageProcessor.from_pretrained(qwen_dir)(ims)
    ids = torch.tensor([p["prompt_token_ids"]])
    with torch.no_grad():
        ref = load_qwen_reference(qwen_dir).generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels, image_grid_thw=grid,
            mm_token_type_ids=(ids == SPEC.image_token_id).int(), max_new_tokens=8, do_sample=False)
    assert outs[names.index("two-images")].outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()


def test_decode_side_never_runs_the_vision_tower(qwen_dir, prompts, reference, monkeypatch):
    pair = LocalPair(qwen_dir, EngineConfig(**CFG))
    decode = pair.decode.engine
    evaluated: list[str] = []

    def no_tower(*args, **kwargs):
        raise AssertionError("the decode worker ran the vision tower")

    monkeypatch.setattr(decode.model.vision, "forward", no_tower)
    process = decode.inputs.process

    def spied(prompt):
        p = process(prompt)
        if p.mm is not None:
            p.mm.pixel_values = lambda: evaluated.append("pixels") or torch.zeros(0)
        return p

    monkeypatch.setattr(decode.inputs, "process", spied)
    try:
        names = ["one-image", "two-images", "batch-3"]
        outs, failed = pair.generate([prompts[n] for n in names], greedy(8))
        assert not failed and [o.outputs[0].token_ids for o in outs] == [reference[n] for n in names]
        assert evaluated == [] and len(pair.prefill.engine.runner.vision_cache) == 3  # prefill encoded them
        pair.check_no_leaks()
    finally:
        pair.close()


# --------------------------------------------------------------------------------------------------- hand-off
def test_handoff_carries_the_mrope_delta(qwen_dir, prompts, monkeypatch):
    sent: list[dict] = []
    current = Handoff.to_meta
    monkeypatch.setattr(Handoff, "to_meta", lambda self: sent.append(current(self)) or sent[-1])
    names = ["two-images", "text-only"]
    _, failed, _ = pair_run(qwen_dir, [prompts[n] for n in names], greedy(2))
    assert not failed
    inputs = LLM(qwen_dir, **CFG).engine.inputs
    want = [inputs.process(prompts[n]).mm for n in names]
    assert want[0].mrope_delta < 0 and want[1] is None  # images take fewer positions than tokens; text: none
    assert [m["v"] for m in sent] == [HANDOFF_VERSION] * 2
    assert [m["mrope_delta"] for m in sent] == [want[0].mrope_delta, 0]
    assert all(np.shape(m["expert_hist"]) == (SPEC.num_layers, SPEC.num_experts) for m in sent)


def test_handoff_versions():
    h = Handoff(7, mrope_delta=-5, expert_hist=[[1, 0]], generator_state=b"\x01", compute_done_s=1.5,
                stages={"prefill_queue_s": 0.5, "prefill_compute_s": 1})
    assert Handoff.from_meta(h.to_meta()) == h
    v3 = Handoff.from_meta({"v": 3, "first_token": 7})  # before stages: none
    assert (v3.version, v3.stages) == (3, None)
    legacy = Handoff.from_meta({"first_token": 7, "expert_hist": [[1, 0]]})  # version 1: no "v", no delta
    assert (legacy.version, legacy.mrope_delta, legacy.expert_hist) == (1, 0, [[1, 0]])
    for bad in ({"v": HANDOFF_VERSION + 1, "first_token": 1}, {"v": 2}, {"v": 2, "first_token": 1, "mrope_delta": "x"},
                {"v": 4, "first_token": 1, "stages": {"prefill_queue_s": "slow"}}, None):
        with pytest.raises(ProtocolError):
            Handoff.from_meta(bad)


@pytest.mark.parametrize("how", ["wrong-delta", "legacy-v1"])
def test_a_handoff_that_disagrees_is_a_typed_failure_and_frees_blocks(qwen_dir, prompts, reference, monkeypatch,
                                                                      how):
    """A delta off by one, or a version-1 prefill (no delta: 0) for an image prompt, fails that request with
    HandoffMismatch and releases its blocks; a version-1 text-only request (delta 0 either way) still decodes
    exactly."""
    current = Handoff.to_meta

    def tampered(self: Handoff) -> dict:
        meta = current(self)
        if how == "wrong-delta":
            meta["mrope_delta"] += 1
        else:  # what a version-1 prefill worker sent
            del meta["v"], meta["mrope_delta"]
        return meta

    monkeypatch.setattr(Handoff, "to_meta", tampered)
    outs, failed, _ = pair_run(qwen_dir, [prompts["one-image"], prompts["text-only"]], greedy(8))
    assert outs[0] is None and HandoffMismatch.__name__ in failed["pair-0"]
    if how == "wrong-delta":
        assert outs[1] is None and sorted(failed) == ["pair-0", "pair-1"]
    else:
        assert list(failed) == ["pair-0"] and outs[1].outputs[0].token_ids == reference["text-only"]


# -------------------------------------------------------------------------------------------------- compression
def test_default_compression_follows_each_requests_visual_tokens(qwen_dir, prompts, reference):
    """Visual-token counts differ per request: the codec's visual mask is each prompt's image positions, so text KV
    lands bit for bit, visual KV within int8 steps; tokens mostly agree with the uncompressed run."""
    names = ["two-images", "batch-0", "batch-3", "text-only"]
    pair = LocalPair(qwen_dir, EngineConfig(**CFG), compression="default")
    sent, received, masks = {}, {}, {}
    gather, write, context = (pair.prefill.engine.runner.gather_layer, pair.decode.engine.write_layer,
                              pair.prefill._codec_context)

    def spy_gather(seq, layer):
        sent[seq.request_id, layer] = gather(seq, layer)
        return sent[seq.request_id, layer]

    def spy_write(request_id, layer, k, v, dropped=None):
        received[request_id, layer] = (k.clone(), v.clone())
        write(request_id, layer, k, v, dropped)

    def spy_context(seq, k, v):
        ctx = context(seq, k, v)
        masks[seq.request_id] = ctx.visual.clone()
        return ctx

    pair.prefill.engine.runner.gather_layer, pair.decode.engine.write_layer = spy_gather, spy_write
    pair.prefill._codec_context = spy_context
    try:
        outs, failed = pair.generate([prompts[n] for n in names], greedy(8))
        assert not failed
        pair.check_no_leaks()
        assert pair.decode.engine.block_manager.hash_to_block == {}  # approximate KV never enters the prefix cache
    finally:
        pair.close()
    agree = total = 0
    for i, name in enumerate(names):
        rid, ids = f"pair-{i}", torch.tensor(prompts[name]["prompt_token_ids"])
        visual = ids == SPEC.image_token_id
        assert torch.equal(masks[rid], visual), name
        for layer in range(SPEC.num_layers):
            for ref, got in zip(sent[rid, layer], received[rid, layer], strict=True):
                ref, got = ref.flatten(0, 1)[: len(ids)], got.flatten(0, 1)[: len(ids)]
                assert torch.equal(ref[~visual], got[~visual]), name  # text: raw
                if visual.any():
                    span = ref[visual].max() - ref[visual].min()
                    assert (ref[visual] - got[visual]).abs().max() <= span / 255 * 0.51 + 1e-6, name  # visual: int8
        tokens = outs[i].outputs[0].token_ids
        assert len(tokens) == 8 and tokens[0] == reference[name][0]  # the first token is prefill's, exact
        agree += sum(a == b for a, b in zip(tokens, reference[name]))
        total += len(tokens)
    assert outs[names.index("text-only")].outputs[0].token_ids == reference["text-only"]  # nothing visual to lose
    assert agree >= 0.75 * total, (agree, total)


# ------------------------------------------------------------------------------------------------- Ray actors
def _spec(model_dir: Path, **kw) -> ClusterSpec:
    return ClusterSpec(model_dir=str(model_dir), **{**dict(num_prefill=1, num_decode=1, transport="gloo",
                                                            num_kv_blocks=64, block_size=4, max_num_seqs=8,
                                                            max_model_len=128, cpus_per_worker=1,
                                                            request_timeout_s=60, local_prefill_tokens=0), **kw})


def _assert_idle(cluster: DisaggCluster) -> None:
    held = cluster.check_no_leaks()
    assert held and all(v == 0 for v in held.values()), held


@pytest.mark.parametrize("transport", TRANSPORTS, ids=TRANSPORTS)
def test_cluster_matches_local(ray_cluster, qwen_dir, prompts, reference, transport):
    c = DisaggCluster(_spec(qwen_dir, transport=transport))
    try:
        got = c.generate_batch([prompts["two-images"]], greedy(8))[0]  # alone, then everything at once
        assert got.token_ids == reference["two-images"] and got.kv_transfer["layers"] == SPEC.num_layers
        got = c.generate_batch(list(prompts.values()), greedy(8))
        assert {k: g.token_ids for k, g in zip(prompts, got, strict=True)} == reference
        assert all(g.attempts == 1 and np.shape(g.expert_hist) == (SPEC.num_layers, SPEC.num_experts) for g in got)
        _assert_idle(c)
    finally:
        c.shutdown()


def test_expert_parallel_decode_group_of_2_matches_local(ray_cluster, tiny_qwen_ckpt, prompts, reference):
    """Published layout: every rank reads its slots' experts from the transposed fused tensors."""
    model_dir = tiny_qwen_ckpt(layout="published")
    c = DisaggCluster(_spec(model_dir, num_decode=2, expert_parallel=2, expert_slots_per_worker=5,
                            expert_rebalance_s=0))
    try:
        got = c.generate_batch(list(prompts.values()), greedy(8))
        assert {k: g.token_ids for k, g in zip(prompts, got, strict=True)} == reference  # same weights as "hf"
        _assert_idle(c)
    finally:
        c.shutdown()


def test_cluster_default_compression_runs_end_to_end(ray_cluster, qwen_dir, prompts, reference):
    c = DisaggCluster(_spec(qwen_dir, kv_compression="default"))
    try:
        names = ["two-images", "batch-0", "batch-3", "text-only"]
        got = c.generate_batch([prompts[n] for n in names], greedy(8))
        assert all(len(g.token_ids) == 8 and g.attempts == 1 for g in got)
        assert [g.token_ids[0] for g in got] == [reference[n][0] for n in names]
        assert got[-1].token_ids == reference["text-only"]
        assert all(0 < g.kv_transfer["wire_bytes"] < g.kv_transfer["bytes"] for g in got[:-1])
        _assert_idle(c)
    finally:
        c.shutdown()
