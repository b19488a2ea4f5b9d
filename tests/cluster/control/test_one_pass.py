"""One pass over a prompt (issue 17, item 3): the front-end validates, tokenizes, decodes and preprocesses each image
once (:meth:`DisaggCluster._prepare`); the prefill worker gets the processed prompt with preprocessed pixels (no PNG
re-encode) and neither re-tokenizes nor re-decodes; the decode worker gets no image data at all, keys images in its
prefix cache by content hash, and fails a preempted image prompt with ``PromptRecomputeUnavailable`` rather than
recompute it. Greedy tokens equal the local engine's for LLaVA and Qwen3-VL tiny checkpoints."""

from __future__ import annotations

import msgpack
import PIL.Image
import pytest
import torch

from cluster.control.disagg import DisaggCluster
from cluster.control.local_pair import LocalPair
from cluster.control.spec import ClusterSpec
from engine import LLM, EngineConfig
from engine.inputs import InputProcessor
from engine.models.qwen3_vl.image_processor import QwenVLImageProcessor
from node_common import messages, prompt_wire
from tests.cluster.control.test_qwen_disagg import qwen_image, qwen_request
from tests.conftest import LLM_DEFAULTS, greedy, make_image, make_request

PNG = b"\x89PNG"


@pytest.fixture(scope="module")
def qwen_dir(tiny_qwen_ckpt):
    return tiny_qwen_ckpt()


def llava_prompts() -> list[dict]:
    return [make_request(6, seed=1, images=[make_image(1)]), make_request(5, seed=2, images=[make_image(2), make_image(3)]),
            make_request(7, seed=3)]


def qwen_prompts(qwen_dir) -> list[dict]:
    ims = [qwen_image(0, (100, 61)), qwen_image(1, (47, 133))]
    return [qwen_request(qwen_dir, ims[:1], seed=1), qwen_request(qwen_dir, ims, seed=2),
            {"prompt": "look <image> at it", "multi_modal_data": {"image": [ims[1]]}}]


def reference(model_dir, prompts, **cfg) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in LLM(model_dir, **{**LLM_DEFAULTS, **cfg}).generate(prompts, greedy(6))]


class _FrontEnd:  # what DisaggCluster._prepare reads
    def __init__(self, llm: LLM) -> None:
        e = llm.engine
        self.inputs = InputProcessor(e.model_config, e.tokenizer, e.image_processor, e.max_model_len)


# ----------------------------------------------------------------------------------------------------- the wire
@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_the_wire_carries_pixels_to_prefill_and_no_image_data_to_decode(family, tiny_model_dir, qwen_dir, monkeypatch):
    model_dir = tiny_model_dir if family == "llava" else qwen_dir
    front = _FrontEnd(LLM(model_dir, **LLM_DEFAULTS))
    prompt = (llava_prompts() if family == "llava" else qwen_prompts(qwen_dir))[1]
    images = prompt["multi_modal_data"]["image"]
    want = front.inputs.image_processor(images)
    want = want[0] if isinstance(want, tuple) else want
    monkeypatch.setattr(PIL.Image.Image, "save", lambda *a, **k: pytest.fail("the front-end re-encoded an image"))
    p, wire = DisaggCluster._prepare(front, prompt)
    to_prefill, to_decode = (messages.pack(request_id="r", prompt=wire[k]) for k in ("prefill", "decode"))
    assert PNG not in to_prefill and PNG not in to_decode
    decode_mm = msgpack.unpackb(to_decode)["prompt"]["mm"]
    assert decode_mm["pixels"] is None and decode_mm["images"] is None and decode_mm["mrope"] is None
    assert len(to_decode) < 1024
    # the prefill worker's: the images resized to uint8 (one byte per pixel and channel), no float pixels
    prefill_mm = msgpack.unpackb(to_prefill)["prompt"]["mm"]
    assert prefill_mm["pixels"] is None
    resized = [a["shape"] for a in prefill_mm["images"]]
    assert all(a["dtype"] == "uint8" and len(a["data"]) == a["shape"][0] * a["shape"][1] * 3
               for a in prefill_mm["images"]) and all(shape[2] == 3 for shape in resized)
    with pytest.raises(prompt_wire.PromptWireError, match="image processor"):  # a worker that cannot make pixels
        prompt_wire.prompt_from_wire(messages.unpack(to_prefill)["prompt"])
    got = prompt_wire.prompt_from_wire(messages.unpack(to_prefill)["prompt"], front.inputs.image_processor)
    assert torch.equal(got.mm.pixels(), want) and got.token_ids == p.token_ids
    assert got.mm.image_hashes == p.mm.image_hashes and (got.mm.mrope is None) == (family == "llava")
    assert wire["prefill"]["v"] == wire["decode"]["v"] == prompt_wire.PROMPT_VERSION


def test_other_prompt_versions_and_shapes_are_typed_errors():
    legacy = {"prompt_token_ids": [1, 2], "images": [b"\x89PNG..."]}  # version 1
    bad_array = {"v": 2, "token_ids": [1], "mm": {"hashes": [b"h"], "positions": {"dtype": "int64", "shape": [2],
                                                                                  "data": b"\0" * 8}}}
    for bad in (legacy, {"v": 4, "token_ids": [1]}, {"v": 2}, bad_array, [1, 2]):
        with pytest.raises(prompt_wire.PromptWireError):
            prompt_wire.prompt_from_wire(bad)


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_resized_images_of_the_wrong_size_or_type_are_typed_errors(family, tiny_model_dir, qwen_dir):
    model_dir = tiny_model_dir if family == "llava" else qwen_dir
    front = _FrontEnd(LLM(model_dir, **LLM_DEFAULTS))
    prompt = (llava_prompts() if family == "llava" else qwen_prompts(qwen_dir))[0]
    _, wire = DisaggCluster._prepare(front, prompt)
    good = messages.unpack(messages.pack(prompt=wire["prefill"]))["prompt"]
    arr = good["mm"]["images"][0]
    h, w, _ = arr["shape"]
    cropped = {"dtype": "uint8", "shape": [h - 1, w, 3], "data": arr["data"][: (h - 1) * w * 3]}
    as_float = {"dtype": "float32", "shape": [h, w, 3], "data": b"\0" * (h * w * 12)}
    short = {**arr, "data": arr["data"][:-1]}
    for image in (cropped, as_float, short, "pixels"):
        bad = {**good, "mm": {**good["mm"], "images": [image]}}
        with pytest.raises(prompt_wire.PromptWireError):
            prompt_wire.prompt_from_wire(bad, front.inputs.image_processor)
    extra = {**good, "mm": {**good["mm"], "images": [arr, arr]}}  # one more image than the prompt has
    with pytest.raises(prompt_wire.PromptWireError):
        prompt_wire.prompt_from_wire(extra, front.inputs.image_processor)
    assert prompt_wire.prompt_from_wire(good, front.inputs.image_processor).mm.pixels().numel() > 0


def test_a_version_2_prompt_with_float_pixels_is_still_read(qwen_dir):
    front = _FrontEnd(LLM(qwen_dir, **LLM_DEFAULTS))
    prompt = qwen_prompts(qwen_dir)[0]
    p, wire = DisaggCluster._prepare(front, prompt)
    want = p.mm.pixels()
    v2 = messages.unpack(messages.pack(prompt=wire["prefill"]))["prompt"]
    mm = {k: v for k, v in v2["mm"].items() if k != "images"}
    mm["pixels"] = {"dtype": "float32", "shape": list(want.shape), "data": want.numpy().tobytes()}
    got = prompt_wire.prompt_from_wire({**v2, "v": 2, "mm": mm})
    assert torch.equal(got.mm.pixels(), want)


# ------------------------------------------------------------------------------------------- the workers' intake
@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_workers_neither_retokenize_nor_redecode_and_match_the_local_engine(family, tiny_model_dir, qwen_dir,
                                                                           monkeypatch):
    model_dir = tiny_model_dir if family == "llava" else qwen_dir
    prompts = llava_prompts() if family == "llava" else qwen_prompts(qwen_dir)
    want = reference(model_dir, prompts)
    pair = LocalPair(model_dir, EngineConfig(**LLM_DEFAULTS))
    try:
        processed = [pair.inputs.process(p) for p in prompts]  # the front-end's one pass
        for p in processed:
            if p.mm is not None:
                p.mm.pixels()

        def forbidden(*a, **k):
            raise AssertionError("a worker re-processed the prompt")

        monkeypatch.setattr(InputProcessor, "process", forbidden)
        monkeypatch.setattr("engine.inputs.load_image", forbidden)
        monkeypatch.setattr("engine.image_processor.load_image", forbidden)
        monkeypatch.setattr(type(pair.inputs.image_processor), "__call__", forbidden)
        monkeypatch.setattr(type(pair.inputs.tokenizer), "encode", forbidden)
        outs, failed = pair.generate(processed, greedy(6))
        assert not failed and [o.outputs[0].token_ids for o in outs] == want
        assert len(pair.prefill.engine.runner.vision_cache) == len({h for p in processed if p.mm for h in p.mm.image_hashes})
        assert len(pair.decode.engine.runner.vision_cache) == 0
        pair.check_no_leaks()
    finally:
        pair.close()


def test_decode_prefix_cache_keys_images_by_content_hash(tiny_model_dir):
    pair = LocalPair(tiny_model_dir, EngineConfig(**LLM_DEFAULTS))
    local = LLM(tiny_model_dir, **LLM_DEFAULTS).engine
    try:
        same, other = make_request(6, seed=5, images=[make_image(5)]), make_request(6, seed=5, images=[make_image(6)])
        copy = make_request(6, seed=5, images=[make_image(5).copy()])  # another object, the same pixels
        hashes = {}
        for name, prompt in {"same": same, "copy": copy, "other": other}.items():
            pair.decode.allocate(name, pair.wire(prompt)[1], greedy(2))
            seq = pair.decode.engine.receiving[name]
            hashes[name] = [seq.block_hash(i) for i in range(seq.num_tokens // seq.block_size)]
            ref = local._new_sequence("ref", prompt, greedy(2))
            assert hashes[name] == [ref.block_hash(i) for i in range(len(hashes[name]))]
            assert seq.mm is not None and seq.mm.pixel_values is None
        assert hashes["same"] == hashes["copy"] and hashes["same"][0] != hashes["other"][0]
        for name in hashes:
            pair.decode.abort(name)
        pair.check_no_leaks()
    finally:
        pair.close()


# ----------------------------------------------------------------------------------------- decode-side preemption
def test_a_preempted_image_prompt_fails_retryably_and_a_text_prompt_recomputes(tiny_model_dir):
    """Two requests whose prompts fit the decode pool but whose generations do not: the later one is preempted.
    With images it fails with PromptRecomputeUnavailable (the front-end retries such a failure on another pair);
    text-only it is recomputed on the decode side and still equals the local engine."""
    cfg = {**LLM_DEFAULTS, "num_kv_blocks": 12, "max_model_len": 48, "max_num_seqs": 2}
    image_prompts = [make_request(6, seed=7, images=[make_image(7)]), make_request(6, seed=8, images=[make_image(8)])]
    text_prompts = [make_request(12, seed=9), make_request(12, seed=10)]
    params = greedy(30)
    pair = LocalPair(tiny_model_dir, EngineConfig(**cfg))
    try:
        for prompts, preempts in ((image_prompts, True), (text_prompts, False)):
            outs, failed = pair.generate(prompts, params)
            assert [o is None for o in outs] == [False, preempts]
            if preempts:
                assert len(failed) == 1 and next(iter(failed.values())).startswith("PromptRecomputeUnavailable")
            else:
                assert not failed
            pair.check_no_leaks()
        assert pair.decode.engine.cannot_recompute == []
    finally:
        pair.close()
    full = [o.outputs[0].token_ids for o in LLM(tiny_model_dir, **cfg).generate(text_prompts, params)]
    assert [o.outputs[0].token_ids for o in outs] == full


# -------------------------------------------------------------------------------------------- over Ray actors
def test_ray_cluster_sends_each_worker_its_form_and_matches_local(ray_cluster, qwen_dir, monkeypatch):
    prompts = qwen_prompts(qwen_dir)
    want = reference(qwen_dir, prompts)
    sent: list[dict] = []
    pack = messages.pack

    def spy(**fields):
        out = pack(**fields)
        if "prompt" in fields:
            sent.append({"to": "prefill" if "lease" in fields else "decode", "bytes": out})
        return out

    monkeypatch.setattr(messages, "pack", spy)
    spec = ClusterSpec(model_dir=str(qwen_dir), local_prefill_tokens=0,
                       num_prefill=1, num_decode=1, transport="gloo", num_kv_blocks=64,
                       block_size=4, max_num_seqs=8, max_model_len=128, dtype="float32")
    c = DisaggCluster(spec)
    try:
        outs = c.generate_batch(prompts, greedy(6))
        assert [o.token_ids for o in outs] == want
    finally:
        c.shutdown()
    proc = QwenVLImageProcessor.from_pretrained(qwen_dir)
    decode = [s["bytes"] for s in sent if s["to"] == "decode"]
    prefill = [s["bytes"] for s in sent if s["to"] == "prefill"]
    assert len(decode) == len(prefill) == len(prompts)
    by_ids = {tuple(messages.unpack(m)["prompt"]["token_ids"]): m for m in prefill}
    for prompt in prompts:
        ids = tuple(c.inputs.process(prompt).token_ids)
        got = prompt_wire.prompt_from_wire(messages.unpack(by_ids[ids])["prompt"], proc)
        assert torch.equal(got.mm.pixels(), proc(prompt["multi_modal_data"]["image"])[0])
    assert all(PNG not in m and msgpack.unpackb(m)["prompt"]["mm"]["pixels"] is None
               and msgpack.unpackb(m)["prompt"]["mm"]["images"] is None for m in decode)
