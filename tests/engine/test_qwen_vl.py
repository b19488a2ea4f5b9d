"""Qwen3-VL(-MoE) in the local engine against transformers' own ``generate`` on tiny random checkpoints.

Greedy tokens must be identical and every step's logits within 1e-4 (float32): images of sizes that are not
multiples of the patch grid (so each has its own visual-token count), two images of different sizes in one prompt,
text only, a batch of different images, a chunked prefill whose chunk boundary falls inside an image, a prefix-cache
hit on a repeated image, both key layouts (single file and sharded), the dense family, tied embeddings and
``mlp_only_layers``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig, parse_config
from engine.errors import (
    CheckpointError,
    ImageTokenMismatchError,
    InvalidRequestError,
    UnsupportedInputError,
    UnsupportedModelError,
)
from duet_testing.qwen_checkpoints import QwenTinySpec, load_qwen_reference, make_tiny_qwen_checkpoint
from engine.models.qwen3_vl.image_processor import QwenVLImageProcessor
from tests.conftest import assert_no_leaked_blocks

SPEC = QwenTinySpec()
IDS = SPEC.special_token_ids
PAD, START, END = SPEC.image_token_id, IDS["<|vision_start|>"], IDS["<|vision_end|>"]
LOGIT_ATOL = 1e-4
BF16_ATOL, BF16_RTOL = 0.1, 2 ** -6  # bf16 against transformers' bf16: see the CUDA test
ENGINE = dict(dtype="float32", num_kv_blocks=96, block_size=4, max_num_seqs=8, max_model_len=256)


def image(seed: int, size: tuple[int, int]) -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    return PIL.Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


SIZES = {"100x61": (100, 61), "47x133": (47, 133), "33x47": (33, 47), "150x170": (150, 170)}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    cache: dict[str, Path] = {}

    def make(name: str, **overrides) -> Path:
        if name not in cache:
            cache[name] = make_tiny_qwen_checkpoint(tmp_path_factory.mktemp(f"qwen-{name}") / "ckpt",
                                                    dataclasses.replace(SPEC, **overrides))
        return cache[name]

    return make


@pytest.fixture(scope="module")
def hf_dir(ckpts) -> Path:
    return ckpts("hf")


@pytest.fixture(scope="module")
def reference(hf_dir):
    return load_qwen_reference(hf_dir)


def build_prompt(images: list[PIL.Image.Image], model_dir: Path, seed: int = 0, text: int = 3) -> list[int]:
    """``<|im_start|> text (<|vision_start|> pad*n <|vision_end|> text)* <|im_end|>`` as transformers' processor
    expands it."""
    proc = QwenVLImageProcessor.from_pretrained(model_dir)
    rng = np.random.default_rng(seed)
    words = lambda: rng.integers(0, SPEC.vocab_size - len(IDS), text).tolist()  # noqa: E731
    ids = [IDS["<|im_start|>"], *words()]
    for im in images:
        ids += [START] + [PAD] * proc.num_visual_tokens(im.height, im.width) + [END] + words()
    return ids + [IDS["<|im_end|>"]]


def reference_generate(model, model_dir: Path, ids: list[int], images: list[PIL.Image.Image], n: int):
    inp = torch.tensor([ids])
    kwargs = {}
    if images:
        pv, grid = QwenVLImageProcessor.from_pretrained(model_dir)(images)
        kwargs = dict(pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=(inp == PAD).int())
    with torch.no_grad():
        # an eos id no token has: the reference runs n steps, as the engine's ignore_eos
        out = model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), max_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, eos_token_id=SPEC.vocab_size + 7,
                             pad_token_id=IDS["<|endoftext|>"], **kwargs)
    return out.sequences[0, len(ids):].tolist(), [x[0] for x in out.logits]


def greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, return_logits=True)


def assert_matches(out, ref_tokens: list[int], ref_logits: list[torch.Tensor]) -> None:
    got = out.outputs[0]
    assert got.token_ids == ref_tokens
    for step, (a, b) in enumerate(zip(got.logits, ref_logits, strict=True)):
        torch.testing.assert_close(a, b.float(), rtol=0, atol=LOGIT_ATOL, msg=f"step {step}")


def request(ids: list[int], images: list[PIL.Image.Image]) -> dict:
    return {"prompt_token_ids": ids, **({"multi_modal_data": {"image": images}} if images else {})}


CASES = {
    "one-100x61": [("100x61", 0)],
    "one-150x170": [("150x170", 1)],
    "two-sizes": [("47x133", 2), ("100x61", 3)],
    "text-only": [],
}


@pytest.mark.parametrize("cpu_linear", ["auto", "packed"])  # packed: every linear layer and expert through oneDNN
@pytest.mark.parametrize("case", list(CASES))
def test_generate_matches_transformers(hf_dir, reference, case, cpu_linear):
    images = [image(seed, SIZES[name]) for name, seed in CASES[case]]
    ids = build_prompt(images, hf_dir, seed=len(case))
    llm = LLM(hf_dir, **ENGINE, cpu_linear=cpu_linear)
    assert_matches(llm.generate([request(ids, images)], greedy())[0], *reference_generate(reference, hf_dir, ids,
                                                                                          images, 6))
    assert_no_leaked_blocks(llm)


def test_visual_tokens_follow_the_image(hf_dir):
    proc = QwenVLImageProcessor.from_pretrained(hf_dir)
    counts = {name: proc.num_visual_tokens(*size) for name, size in SIZES.items()}
    assert len(set(counts.values())) == len(counts), counts  # every size its own count
    llm = LLM(hf_dir, **ENGINE)
    for name, size in SIZES.items():
        p = llm.engine.inputs.process(request(build_prompt([image(0, size)], hf_dir), [image(0, size)]))
        assert p.num_visual_tokens == counts[name]
        assert p.mm.mrope.shape == (3, len(p.token_ids))
        assert p.mm.mrope_delta == int(p.mm.mrope.max()) + 1 - len(p.token_ids) <= 0
        t, h, w = p.mm.grid_thw[0] // (1, 2, 2)
        assert p.mm.mrope_delta == max(h, w) - t * h * w  # an image advances positions by its longer side


def test_batch_of_different_images(hf_dir, reference):
    images = [[image(10 + i, size)] for i, size in enumerate(SIZES.values())] + [[]]
    prompts = [build_prompt(ims, hf_dir, seed=i) for i, ims in enumerate(images)]
    llm = LLM(hf_dir, **ENGINE)
    outs = llm.generate([request(p, ims) for p, ims in zip(prompts, images, strict=True)], greedy(5))
    for out, p, ims in zip(outs, prompts, images, strict=True):
        assert_matches(out, *reference_generate(reference, hf_dir, p, ims, 5))
    assert_no_leaked_blocks(llm)


def test_chunk_boundary_inside_an_image(hf_dir, reference):
    images = [image(4, SIZES["150x170"]), image(5, SIZES["47x133"])]
    ids = build_prompt(images, hf_dir)
    first_image = ids.index(PAD)
    budget = first_image + 7  # the first chunk ends 7 tokens into the first image
    assert ids[budget - 1] == PAD and ids[budget] == PAD
    llm = LLM(hf_dir, **{**ENGINE, "max_num_batched_tokens": budget})
    out = llm.generate([request(ids, images)], greedy())[0]
    assert_matches(out, *reference_generate(reference, hf_dir, ids, images, 6))
    assert_no_leaked_blocks(llm)


def test_prefix_cache_hit_on_a_repeated_image(hf_dir, reference):
    im = image(6, SIZES["150x170"])
    first = build_prompt([im], hf_dir, seed=1)
    second = first[:-1] + [7, 8, 9, IDS["<|im_end|>"]]  # same image and text before it, new text after
    llm = LLM(hf_dir, **ENGINE)
    llm.generate([request(first, [im])], greedy(2))
    out = llm.generate([request(second, [im])], greedy())[0]
    assert out.num_cached_tokens >= first.index(END), "the image's blocks come from the prefix cache"
    assert_matches(out, *reference_generate(reference, hf_dir, second, [im], 6))
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("layout,sharded", [("hf", True), ("published", False), ("published", True)],
                         ids=["hf-sharded", "published", "published-sharded"])
def test_layouts_give_the_same_model(ckpts, hf_dir, reference, layout, sharded):
    path = ckpts(f"{layout}-{sharded}", layout=layout, sharded=sharded)
    if sharded:
        assert (path / "model.safetensors.index.json").is_file()
    images = [image(7, SIZES["100x61"])]
    ids = build_prompt(images, path)
    llm = LLM(path, **ENGINE)
    assert_matches(llm.generate([request(ids, images)], greedy())[0],
                   *reference_generate(reference, hf_dir, ids, images, 6))
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("variant", ["dense", "tied", "mlp-only", "sparse-step"])
def test_family_variants(ckpts, variant):
    overrides = {"dense": dict(text="qwen3_vl"), "tied": dict(tie_word_embeddings=True),
                 "mlp-only": dict(mlp_only_layers=(1,)), "sparse-step": dict(decoder_sparse_step=2)}[variant]
    path = ckpts(variant, **overrides)
    cfg = ModelConfig.from_pretrained(path)
    if variant == "dense":
        assert not cfg.text.is_moe
    elif variant != "tied":
        assert cfg.text.moe_layers == ((True, False, True) if variant == "mlp-only" else (False, True, False))
    images = [image(8, SIZES["47x133"]), image(9, SIZES["33x47"])]
    ids = build_prompt(images, path)
    llm = LLM(path, **ENGINE)
    assert_matches(llm.generate([request(ids, images)], greedy())[0],
                   *reference_generate(load_qwen_reference(path), path, ids, images, 6))
    assert_no_leaked_blocks(llm)


def test_text_prompt_with_image_placeholder_expands_like_the_processor(hf_dir):
    im = image(11, SIZES["100x61"])
    llm = LLM(hf_dir, **ENGINE)
    tok = llm.engine.tokenizer
    text = "<|im_start|>user\nba<image>ka<|im_end|>\n<|im_start|>assistant\n"
    got = llm.engine.inputs.process({"prompt": text, "multi_modal_data": {"image": [im]}}).token_ids
    n = QwenVLImageProcessor.from_pretrained(hf_dir).num_visual_tokens(im.height, im.width)
    expanded = text.replace("<image>", "<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>")
    assert got == tok.encode(expanded)
    native = text.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
    assert llm.engine.inputs.process({"prompt": native, "multi_modal_data": {"image": [im]}}).token_ids == got


def test_bad_input_is_refused_and_changes_nothing(hf_dir):
    im = image(12, SIZES["100x61"])
    llm = LLM(hf_dir, **ENGINE)
    ids = build_prompt([im], hf_dir)
    short = list(ids)
    short.remove(PAD)  # the run no longer matches the image's grid
    split = list(ids)
    split[ids.index(PAD) + 2] = 5  # one image's tokens in two runs
    cases = [
        (ImageTokenMismatchError, request(short, [im])),
        (ImageTokenMismatchError, request(split, [im])),
        (ImageTokenMismatchError, request(ids, [im, im])),
        (ImageTokenMismatchError, request(ids, [])),
        (UnsupportedInputError, request(ids[:3] + [IDS["<|video_pad|>"]] + ids[3:], [im])),
        (UnsupportedInputError, {"prompt_token_ids": ids, "multi_modal_data": {"video": [im]}}),
        (InvalidRequestError, request(ids, [image(0, (2, 500))])),  # aspect ratio over 200
        (ImageTokenMismatchError, {"prompt": "<image><image>hi", "multi_modal_data": {"image": [im]}}),
    ]
    for i, (err, prompt) in enumerate(cases):
        with pytest.raises(err):
            llm.engine.add_request(f"bad-{i}", prompt, greedy())
    assert_no_leaked_blocks(llm)
    out = llm.generate([request(ids, [im])], greedy(2))[0]  # the engine still serves
    assert len(out.outputs[0].token_ids) == 2
    assert_no_leaked_blocks(llm)


def test_vision_cache_encodes_a_repeated_image_once(hf_dir):
    im = image(13, SIZES["100x61"])
    llm = LLM(hf_dir, **ENGINE)
    calls = []
    tower = llm.engine.model.vision
    hook = tower.register_forward_hook(lambda mod, args, out: calls.append(int(args[1].shape[0])))
    try:
        ids = build_prompt([im, im], hf_dir)
        first = llm.generate([request(ids, [im, im])], greedy(2))[0]
        again = llm.generate([request(build_prompt([im], hf_dir, seed=5), [im])], greedy(2))[0]
    finally:
        hook.remove()
    assert calls == [1], "one encoding for the image, however often it appears"
    assert len(first.outputs[0].token_ids) == len(again.outputs[0].token_ids) == 2
    # the tower's time is the request's that waited for it (its TTFT breakdown), none for a cached image
    assert 0 < first.metrics.vision_s < first.metrics.ttft_s and again.metrics.vision_s == 0
    assert_no_leaked_blocks(llm)


def _config(**changes) -> dict:
    raw = json.loads((Path(__file__).parent / "data" / "qwen3_vl_moe_30b_config.json").read_text())
    for path, value in changes.items():
        node = raw
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        if value is _DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    return raw


_DELETE = object()


def test_released_config_parses():
    cfg = parse_config(_config())
    assert cfg.is_qwen_vl and cfg.text.num_experts == 128 and cfg.text.top_k == 8
    assert cfg.text.mrope_section == (24, 20, 20) and cfg.num_deepstack_levels == 3
    assert cfg.expert_layout_hint == "published" and cfg.image_token_index == 151655
    assert all(cfg.text.moe_layers) and not cfg.text.tie_word_embeddings


@pytest.mark.parametrize("changes,err", [
    ({"text_config.rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
     UnsupportedModelError),
    ({"text_config.rope_scaling": {"mrope_section": [24, 20, 20], "mrope_interleaved": False}}, UnsupportedModelError),
    ({"text_config.rope_scaling": {"mrope_section": [24, 20, 10], "mrope_interleaved": True}}, UnsupportedModelError),
    ({"image_token_id": None}, CheckpointError),
    ({"vision_config.out_hidden_size": 1024}, CheckpointError),
    ({"text_config.model_type": "qwen3_moe"}, UnsupportedModelError),
    ({"vision_config.hidden_act": "swish7"}, UnsupportedModelError),
], ids=["yarn", "not-interleaved", "bad-section", "no-image-token", "hidden-mismatch", "text-type", "act"])
def test_bad_configs_raise_typed_errors(changes, err):
    with pytest.raises(err):
        parse_config(_config(**changes))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bfloat16_follows_transformers(ckpts):
    """bf16 on CUDA: every greedy token and every step's logits as transformers' bf16 model on the same device.

    Two bf16 implementations round differently, and the error grows over layers and steps (on CPU, the same
    comparison differs by up to 0.11 over these three steps, logits up to 10 where a bf16 ulp is 0.0625): logits
    are compared within :data:`BF16_ATOL` + :data:`BF16_RTOL` of their size. Those bounds also settle a token that
    differs: it must be a tie the rounding decides (the reference ranks both within twice the bound), and the
    sequences share no prefix after it, so the comparison ends there (on CPU the third step's top two are 0.03
    apart)."""
    path = ckpts("hf-bf16", dtype="bfloat16")
    images = [image(14, SIZES["150x170"]), image(15, SIZES["47x133"])]
    ids = build_prompt(images, path)
    ref = load_qwen_reference(path).to("cuda")
    inp = torch.tensor([ids], device="cuda")
    pv, grid = QwenVLImageProcessor.from_pretrained(path)(images)
    with torch.no_grad():
        out = ref.generate(input_ids=inp, attention_mask=torch.ones_like(inp), pixel_values=pv.cuda(),
                           image_grid_thw=grid.cuda(), mm_token_type_ids=(inp == PAD).int(), max_new_tokens=3,
                           do_sample=False, output_logits=True, return_dict_in_generate=True,
                           eos_token_id=SPEC.vocab_size + 7, pad_token_id=IDS["<|endoftext|>"])
    llm = LLM(path, **{**ENGINE, "dtype": "bfloat16", "device": "cuda"})
    got = llm.generate([request(ids, images)], greedy(3))[0].outputs[0]
    want = out.sequences[0, len(ids):].tolist()
    assert len(got.token_ids) == len(want) == len(got.logits) == len(out.logits) == 3
    for step, (mine, theirs, a, b) in enumerate(zip(got.token_ids, want, got.logits, out.logits, strict=True)):
        b = b[0].float().cpu()
        torch.testing.assert_close(a.float().cpu(), b, rtol=BF16_RTOL, atol=BF16_ATOL, msg=f"step {step}")
        if mine != theirs:
            slack = 2 * (BF16_ATOL + BF16_RTOL * float(b[[mine, theirs]].abs().max()))
            assert float(b[theirs] - b[mine]) <= slack, (step, got.token_ids, want)
            break
    assert_no_leaked_blocks(llm)


def test_the_vision_stage_encodes_in_slices_and_lets_text_pass(hf_dir):
    """EngineConfig.vision_slice_s: the tower runs block by block ahead of scheduling (a slice this short is one
    block a step). The image prompt's tokens and logits are those of the whole-call engine; a text prompt that
    arrives while the image is being encoded gets its first token before the image's encoding is done; an abort
    in the vision stage leaves nothing behind."""
    im = image(21, SIZES["150x170"])
    ids = build_prompt([im], hf_dir, seed=9)
    whole = LLM(hf_dir, **ENGINE).generate([request(ids, [im])], greedy(4))[0]
    llm = LLM(hf_dir, **ENGINE, vision_slice_s=1e-6)
    eng = llm.engine
    depth = len(eng.runner.model.vision.blocks)
    eng.add_request("img", request(ids, [im]), greedy(4))
    eng.add_request("txt", {"prompt_token_ids": build_prompt([], hf_dir, seed=3, text=8)}, greedy(2))
    outs: dict[str, list] = {}
    steps_encoding = 0
    while eng.has_unfinished_requests():
        encoding = bool(eng.encoding)
        for o in eng.step():
            outs[o.request_id] = o
            if o.request_id == "txt" and len(o.outputs[0].token_ids) == 1:
                assert encoding, "the text prompt got its first token while the image was still in the vision stage"
        steps_encoding += encoding
    assert steps_encoding >= depth - 1  # one block a step
    img = outs["img"]
    assert img.outputs[0].token_ids == whole.outputs[0].token_ids
    torch.testing.assert_close(torch.stack(img.outputs[0].logits), torch.stack(whole.outputs[0].logits))
    assert img.metrics.vision_s > 0 and img.metrics.vision_ahead and len(outs["txt"].outputs[0].token_ids) == 2
    eng.add_request("gone", request(build_prompt([image(22, SIZES["47x133"])], hf_dir), [image(22, SIZES["47x133"])]),
                    greedy(2))
    eng.step()
    assert eng.encoding and eng.encoding.jobs
    assert eng.abort_request("gone") and not eng.encoding and not eng.encoding.jobs
    assert not eng.has_unfinished_requests()
    assert_no_leaked_blocks(llm)


def test_the_tower_run_by_rows_equals_the_whole_call(hf_dir):
    """QwenVisionTower.advance(rows=...): a block's rows in pieces (each row attends to its whole image, images of
    two sizes in one call) give the whole call's features and DeepStack levels."""
    ims = [image(31, SIZES["100x61"]), image(32, SIZES["47x133"])]
    pv, grid = QwenVLImageProcessor.from_pretrained(hf_dir)(ims)
    tower = LLM(hf_dir, **ENGINE).engine.runner.model.vision
    whole, whole_ds = tower(torch.as_tensor(pv), torch.as_tensor(grid))
    job = tower.start(torch.as_tensor(pv), torch.as_tensor(grid))
    pieces = 0
    while not tower.advance(job, rows=7):
        pieces += 1
    feats, ds = tower.finish(job)
    assert pieces > len(tower.blocks)  # more than one piece a block
    torch.testing.assert_close(feats, whole)
    for a, b in zip(ds, whole_ds, strict=True):
        torch.testing.assert_close(a, b)
