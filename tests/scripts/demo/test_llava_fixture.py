"""The LLaVA test fixture (the demo model before the Qwen3-VL-MoE one): its training script, tokenizer, and
answers equal to transformers'; the task in its grid96 style."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from duet_testing.demo_tasks import QTYPES, make_dataset
from engine import LLM, SamplingParams
from scripts.demo.tokenizer import IMAGE_TOKEN, save_tokenizer, train_tokenizer
from scripts.demo.tokenizer import chat_prompt as _chat_prompt
from scripts.demo.train_llava import PATCH, TOKENS_PER_IMAGE, build_model, encode, train
from tests.fixtures import LLAVA_DEMO_DIR as DEMO_MODEL_DIR
from tests.scripts.demo.test_demo import check_answers, check_deterministic


def chat_prompt(question: str) -> str:
    return _chat_prompt(question, "llava")


def test_dataset_is_deterministic_balanced_and_consistent():
    a, b = make_dataset(7, 40, style="grid96"), make_dataset(7, 40, style="grid96")
    assert [(e.question, e.answer) for e in a] == [(e.question, e.answer) for e in b]
    assert np.array_equal(np.asarray(a[3].images()[0]), np.asarray(b[3].images()[0]))
    assert [e.qtype for e in a[:5]] == list(QTYPES)
    check_answers(a)
    other = make_dataset(8, 40, style="grid96")
    assert [(e.question, e.answer) for e in other] != [(e.question, e.answer) for e in a]  # the seed matters


def test_tokenizer_chat_template_and_image_token(tmp_path):
    from engine.tokenizer import Tokenizer

    save_tokenizer(train_tokenizer(family="llava"), tmp_path, "llava")
    tok = Tokenizer.from_pretrained(tmp_path)
    q = "<image>What color is the triangle?"
    assert tok.apply_chat_template([{"role": "user", "content": q}]) == chat_prompt(q)
    ids = tok.encode(chat_prompt(q))
    assert ids.count(tok.token_to_id(IMAGE_TOKEN)) == 1
    assert tok.decode(tok.encode("red circle top left", add_special_tokens=False)) == "red circle top left"


def test_training_is_deterministic(tmp_path):
    check_deterministic(train, tmp_path)


def test_shipped_checkpoint_is_what_the_script_generates(tmp_path):
    tok = train_tokenizer(family="llava")
    save_tokenizer(tok, tmp_path, "llava")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_text() == (DEMO_MODEL_DIR / name).read_text(), name
    ids = {t: tok.token_to_id(t) for t in ("<image>", "<pad>", "<|end|>")}
    generated = build_model(tok.get_vocab_size(), ids["<image>"], ids["<pad>"], ids["<|end|>"], seed=0).config
    shipped = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    ignore = {"transformers_version", "architectures", "dtype"}
    want = {k: v for k, v in json.loads(generated.to_json_string()).items() if k not in ignore}
    assert {k: v for k, v in shipped.items() if k not in ignore} == want
    log = [json.loads(line) for line in (DEMO_MODEL_DIR / "train_log.jsonl").read_text().splitlines()]
    assert log[0]["seed"] == 0 and log[0]["steps"] > 0 and log[-1]["step"] == log[0]["steps"] - 1


@pytest.fixture(scope="module")
def demo_llm():
    return LLM(DEMO_MODEL_DIR, dtype="float32", max_num_seqs=16)


def test_engine_and_transformers_give_the_same_answers(demo_llm):
    from transformers import AutoTokenizer, LlavaForConditionalGeneration, LlavaProcessor, SiglipImageProcessorPil

    from duet_bench.quality_bench import evaluate

    examples = make_dataset(424242, 10, style="grid96")
    ours = evaluate(demo_llm, examples)
    ref = LlavaForConditionalGeneration.from_pretrained(DEMO_MODEL_DIR).eval()
    proc = LlavaProcessor(image_processor=SiglipImageProcessorPil.from_pretrained(DEMO_MODEL_DIR),
                          tokenizer=AutoTokenizer.from_pretrained(DEMO_MODEL_DIR), patch_size=PATCH,
                          vision_feature_select_strategy="full", image_token=IMAGE_TOKEN,
                          num_additional_image_tokens=0)
    for e, mine in zip(examples, ours, strict=True):
        inputs = proc(images=e.images(), text=chat_prompt(e.question), return_tensors="pt")
        assert (inputs["input_ids"] == ref.config.image_token_index).sum() == TOKENS_PER_IMAGE * len(e.scenes)
        with torch.inference_mode():
            out = ref.generate(**inputs, max_new_tokens=48, do_sample=False)
        text = proc.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        assert mine["prediction"] == text, e.question


def test_encode_masks_the_prompt():
    tok = train_tokenizer(family="llava")
    ids = {t: tok.token_to_id(t) for t in ("<image>", "<pad>", "<|end|>")}
    ex = make_dataset(3, 1, style="grid96")[0]
    input_ids, labels = encode(tok, ex, ids)
    n_prompt = sum(1 for x in labels if x == -100)
    assert input_ids[n_prompt:] == labels[n_prompt:] and labels[-1] == ids["<|end|>"]
    assert input_ids.count(ids["<image>"]) == TOKENS_PER_IMAGE


def test_quality_bench_on_the_fixture(tmp_path, capsys):
    from cluster.cli.main import main

    out = tmp_path / "q.json"
    assert main(["bench", "quality", str(DEMO_MODEL_DIR), "--images", "grid96", "--n", "10", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["overall"]["n"] == 10 and set(res["per_type"]) == set(QTYPES)
    assert sum(t["correct"] for t in res["per_type"].values()) == res["overall"]["correct"]
    assert "overall" in capsys.readouterr().out


def test_generate_with_sampled_demo_is_seeded(demo_llm):
    ex = make_dataset(5, 1, style="grid96")[0]
    prompt = {"prompt": chat_prompt(ex.question), "multi_modal_data": {"image": ex.images()}}
    p = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
    a = demo_llm.generate([prompt], p)[0].outputs[0].token_ids
    assert demo_llm.generate([prompt], p)[0].outputs[0].token_ids == a


def test_training_probes_target_the_right_cells():
    from duet_testing.demo_tasks import Scene, Shape
    from scripts.demo.train_llava import CellProbe, MatchProbe, asked_cell

    scene = Scene((Shape("circle", "red", "small", 0, 0), Shape("triangle", "blue", "large", 1, 2),
                   Shape("circle", "blue", "small", 2, 1)), noisy=False, seed=1)
    assert asked_cell(scene, "<image>What color is the triangle?") == 5
    assert asked_cell(scene, "What color is the circle?") is None  # two circles: not asked
    assert asked_cell(scene, "<image>Where is the blue circle?") == 7
    assert asked_cell(scene, "<image>How many shapes are there?") is None
    probe = CellProbe(8)
    # cell (1, 2) covers patches (2..3, 4..5) of the 6x6 grid
    assert probe.cells[5].tolist() == [16, 17, 22, 23] and probe.cells.shape == (9, 4)
    with torch.no_grad():  # no evidence, and a strong prior for "empty": only the three occupied cells cost ~10
        for head in (probe.kind, probe.color, probe.size):
            head.weight.zero_(), head.bias.zero_()
        probe.kind.bias[0] = 10.0
    visual = torch.zeros(1, TOKENS_PER_IMAGE, 8)
    want = 3 / 9 * (10 + math.log1p(4 * math.exp(-10))) + 6 / 9 * math.log1p(4 * math.exp(-10)) + math.log(6) \
        + math.log(2)  # kind over all 9 cells; colour and size only over the 3 shapes
    assert probe.loss(visual, [scene]).item() == pytest.approx(want, rel=1e-5)
    match = MatchProbe(8)
    with torch.no_grad():  # score = sum of feature 0 over the cell's four tokens
        match.score.weight.zero_(), match.score.bias.zero_()
        match.score.weight[0, ::8] = 1.0
    hidden = torch.zeros(1, 3 + TOKENS_PER_IMAGE, 8)  # three text tokens, then the image's
    hidden[0, 3 + probe.cells[5], 0] = 10.0  # cell 5's tokens stand out
    is_image = torch.tensor([[False] * 3 + [True] * TOKENS_PER_IMAGE])
    assert match.loss(hidden, is_image, [None]) is None
    assert match.loss(hidden, is_image, [5]).item() < 1e-6
    assert match.loss(hidden, is_image, [0]).item() == pytest.approx(40.0, abs=1e-3)


def test_chat_template_puts_images_after_the_question():
    assert chat_prompt("<image>What color is the triangle?") == \
        "<|user|>What color is the triangle?<image><|end|><|assistant|>"
    assert chat_prompt("<image><image>Which image has more shapes?").endswith("?<image><image><|end|><|assistant|>")
