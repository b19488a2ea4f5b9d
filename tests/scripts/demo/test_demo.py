"""The demo task, its tokenizer, the training script and the shipped Qwen3-VL-MoE demo model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from cluster.demo import DEMO_MODEL_DIR
from duet_testing.demo_tasks import COUNT_WORDS, GRID, MAX_ASPECT, MAX_SIDE, MIN_SIDE, QTYPES, describe, make_dataset
from engine import LLM, SamplingParams
from scripts.demo.tokenizer import IMAGE_PAD, QWEN_VISION, chat_prompt, save_tokenizer, train_tokenizer
from scripts.demo.probes import MatchProbe, TokenProbe, asked_shape, centre_token, token_targets
from scripts.demo.train import SHIPPED_RUN, build_model, encode, processor_config, train


def check_answers(examples) -> None:
    """Each example's answer is what its scenes say (shared with the LLaVA fixture's tests)."""
    for e in examples:
        assert e.question.count("<image>") == len(e.scenes)
        s = e.scenes[0]
        if e.qtype == "count":
            assert e.answer == COUNT_WORDS[len(s.shapes)]
        elif e.qtype == "describe":
            assert e.answer == describe(s)
        elif e.qtype == "color":
            kind = e.question.removesuffix("?").split()[-1]
            assert [x.color for x in s.shapes if x.kind == kind] == [e.answer]
        elif e.qtype == "position":
            color, kind = e.question.removesuffix("?").split()[-2:]
            assert [x.place for x in s.shapes if (x.color, x.kind) == (color, kind)] == [e.answer]
        else:
            n1, n2 = (len(x.shapes) for x in e.scenes)
            assert e.answer == ("the first" if n1 > n2 else "the second")


def test_varied_scenes_are_deterministic_and_vary_in_size_and_place():
    a, b = make_dataset(7, 60), make_dataset(7, 60)
    assert [(e.question, e.answer) for e in a] == [(e.question, e.answer) for e in b]
    assert np.array_equal(np.asarray(a[3].images()[0]), np.asarray(b[3].images()[0]))
    assert [e.qtype for e in a[:5]] == list(QTYPES)
    check_answers(a)
    scenes = [s for e in a for s in e.scenes]
    sizes = {(s.width, s.height) for s in scenes}
    assert len(sizes) > 40  # canvases of many sizes ...
    assert any(s.width > s.height * 1.5 for s in scenes) and any(s.height > s.width * 1.5 for s in scenes)
    for s in scenes:  # ... within the generator's range, each shape's place the cell its centre is in
        assert MIN_SIDE <= min(s.width, s.height) and max(s.width, s.height) <= MAX_SIDE
        assert max(s.width, s.height) <= MAX_ASPECT * min(s.width, s.height) + 1
        for x in s.shapes:
            assert (int(x.y * GRID), int(x.x * GRID)) == (x.row, x.col)
            r = x.r * min(s.width, s.height)
            assert r <= x.x * s.width <= s.width - r and r <= x.y * s.height <= s.height - r  # on the canvas
    offsets = [abs(x.x * GRID - x.col - 0.5) for s in scenes for x in s.shapes]
    assert max(offsets) > 0.2  # not tied to the cell centres
    for e in a[:10]:
        assert [im.size for im in e.images()] == [(s.width, s.height) for s in e.scenes]
    other = make_dataset(8, 60)
    assert [(e.question, e.answer) for e in other] != [(e.question, e.answer) for e in a]
    with pytest.raises(ValueError, match="unknown scene style"):
        make_dataset(7, 1, style="nope")


def test_outside_scenes_use_what_the_generator_does_not():
    from duet_testing.outside_shapes import make_dataset as outside

    a, b = outside(11, 40), outside(11, 40)
    assert [(e.question, e.answer) for e in a] == [(e.question, e.answer) for e in b]
    assert np.array_equal(np.asarray(a[2].images()[0]), np.asarray(b[2].images()[0]))
    check_answers(a)
    for e in a:
        for s, im in zip(e.scenes, e.images(), strict=True):
            assert im.size == (s.width, s.height)
            assert max(s.width, s.height) > MAX_SIDE or max(s.width, s.height) > MAX_ASPECT * min(s.width, s.height)
            for x in s.shapes:
                assert (int(x.y * GRID / s.height), int(x.x * GRID / s.width)) == (x.row, x.col)


def test_tokenizer_chat_template_and_image_markers(tmp_path):
    from cluster.serve.chat import render_chat
    from engine.config import ModelConfig
    from engine.tokenizer import Tokenizer

    save_tokenizer(train_tokenizer(), tmp_path)
    tok = Tokenizer.from_pretrained(tmp_path)
    q = "<image>What color is the triangle?"
    want = f"<|im_start|>user\nWhat color is the triangle?{QWEN_VISION}<|im_end|>\n<|im_start|>assistant\n"
    assert chat_prompt(q) == want
    assert tok.apply_chat_template([{"role": "user", "content": q}]) == chat_prompt(q)
    parts = [{"type": "image"}, {"type": "text", "text": "What color is the triangle?"}]
    assert tok.apply_chat_template([{"role": "user", "content": parts}]) == chat_prompt(q)
    # the server's path (content parts for a Qwen3-VL checkpoint) renders the same prompt
    cfg = ModelConfig.from_pretrained(DEMO_MODEL_DIR)
    assert render_chat(tok, cfg, [{"role": "user", "content": q}]) == chat_prompt(q)
    two = "<image><image>Which image has more shapes?"
    assert chat_prompt(two).endswith(f"?{QWEN_VISION}{QWEN_VISION}<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(chat_prompt(q))
    assert ids.count(tok.token_to_id(IMAGE_PAD)) == 1
    assert tok.decode(tok.encode("red circle top left", add_special_tokens=False)) == "red circle top left"


def check_deterministic(train, tmp_path) -> None:
    """Two short runs of ``train`` from the same seed give identical weights (shared with the LLaVA fixture's tests)."""
    a = train(tmp_path / "a", steps=2, batch_size=2, progress=False, save=False).state_dict()
    b = train(tmp_path / "b", steps=2, batch_size=2, progress=False, save=False).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_training_is_deterministic(tmp_path):
    check_deterministic(train, tmp_path)


def test_two_workers_train_deterministically(tmp_path):
    """Data-parallel training (two one-thread processes, gradients averaged over gloo) gives the same checkpoint on a
    rerun, and logs each loss term averaged over the workers."""
    from safetensors.torch import load_file

    for run in ("a", "b"):
        assert train(tmp_path / run, steps=2, batch_size=4, progress=False, workers=2) is None
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = [json.loads(line) for line in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    assert log[0]["workers"] == 2 and {"loss", "answers", "token_probe"} <= log[-1].keys()


def test_shipped_checkpoint_is_what_the_script_generates(tmp_path):
    tok = train_tokenizer()
    save_tokenizer(tok, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_text() == (DEMO_MODEL_DIR / name).read_text(), name
    generated = json.loads(build_model(tok, seed=0).config.to_json_string())
    shipped = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert shipped["model_type"] == "qwen3_vl_moe"
    ignore = {"transformers_version", "architectures", "dtype"}
    assert {k: v for k, v in shipped.items() if k not in ignore} == {k: v for k, v in generated.items()
                                                                     if k not in ignore}
    assert json.loads((DEMO_MODEL_DIR / "preprocessor_config.json").read_text()) == processor_config()
    log = [json.loads(line) for line in (DEMO_MODEL_DIR / "train_log.jsonl").read_text().splitlines()]
    # the command line's defaults are the shipped run's (bfloat16 where the CPU has it natively, as the shipping host)
    recipe = ("seed", "steps", "workers", "ema", "optimizer", "min_turns", "centre_probe")
    assert {k: log[0][k] for k in recipe} == {k: SHIPPED_RUN[k] for k in recipe}
    assert log[0]["precision"] == "bfloat16" and log[-1]["step"] == log[0]["steps"] - 1


@pytest.fixture(scope="module")
def demo_llm():
    return LLM(DEMO_MODEL_DIR, dtype="float32", max_num_seqs=16)


def test_engine_and_transformers_give_the_same_answers(demo_llm):
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLMoeForConditionalGeneration

    from duet_bench.quality_bench import evaluate

    examples = make_dataset(424242, 10)
    ours = evaluate(demo_llm, examples)
    ref = Qwen3VLMoeForConditionalGeneration.from_pretrained(DEMO_MODEL_DIR).eval()
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    proc = Qwen2VLImageProcessorPil.from_pretrained(DEMO_MODEL_DIR)
    pad = ref.config.image_token_id
    for e, mine in zip(examples, ours, strict=True):
        vis = proc(images=e.images(), return_tensors="pt")
        counts = iter((vis["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [x for t in tok(chat_prompt(e.question))["input_ids"] for x in ([t] * next(counts) if t == pad else [t])]
        inp = torch.tensor([ids])
        with torch.inference_mode():
            out = ref.generate(input_ids=inp, attention_mask=torch.ones_like(inp), pixel_values=vis["pixel_values"],
                               image_grid_thw=vis["image_grid_thw"], mm_token_type_ids=(inp == pad).int(),
                               max_new_tokens=48, do_sample=False)
        text = tok.decode(out[0, inp.shape[1]:], skip_special_tokens=True).strip()
        assert mine["prediction"] == text, e.question
    assert sum(r["match"] for r in ours) >= 9  # and mostly right


def test_visual_token_counts_follow_the_image_size(demo_llm):
    singles = [e for e in make_dataset(5, 60) if len(e.scenes) == 1]
    small = next(e for e in singles if e.scenes[0].width * e.scenes[0].height < 100 * 100)
    large = next(e for e in singles if e.scenes[0].width * e.scenes[0].height > 250 * 250)
    pad = demo_llm.get_tokenizer().token_to_id(IMAGE_PAD)
    counts = []
    for e in (small, large):
        out = demo_llm.generate([{"prompt": chat_prompt(e.question), "multi_modal_data": {"image": e.images()}}],
                                SamplingParams(temperature=0, max_tokens=1))[0]
        counts.append(out.prompt_token_ids.count(pad))
    assert 12 <= counts[0] < counts[1] <= 36  # 112^2 to 192^2 pixels after the processor's resize


def test_encode_masks_the_prompt():
    tok = train_tokenizer()
    ids = {t: tok.token_to_id(t) for t in ("<|image_pad|>", "<|endoftext|>", "<|im_end|>")}
    ex = make_dataset(3, 1)[0]
    input_ids, labels = encode(tok, ex, ids, [23])
    n_prompt = sum(1 for x in labels if x == -100)
    assert input_ids[n_prompt:] == labels[n_prompt:] and labels[-1] == ids["<|im_end|>"]
    assert input_ids.count(ids["<|image_pad|>"]) == 23


def test_quality_bench_reports_per_type_and_size(tmp_path, capsys):
    from cluster.cli.main import main

    out = tmp_path / "q.json"
    assert main(["bench", "quality", "--n", "10", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["overall"]["n"] == 10 and set(res["per_type"]) == set(QTYPES) and res["images"] == "varied"
    assert sum(t["correct"] for t in res["per_type"].values()) == res["overall"]["correct"]
    assert sum(t["n"] for t in res["per_size"].values()) == 10 and len(res["per_size"]) >= 2
    assert res["overall"]["correct"] >= 9
    printed = capsys.readouterr().out
    assert "question type" in printed and "image size" in printed
    assert main(["bench", "quality", "--images", "outside", "--n", "5", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["images"] == "outside" and set(res["per_size"]) <= {"256-511 px", ">= 512 px"}


def test_generate_with_sampled_demo_is_seeded(demo_llm):
    ex = make_dataset(5, 1)[0]
    prompt = {"prompt": chat_prompt(ex.question), "multi_modal_data": {"image": ex.images()}}
    p = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
    a = demo_llm.generate([prompt], p)[0].outputs[0].token_ids
    assert demo_llm.generate([prompt], p)[0].outputs[0].token_ids == a


def test_training_probes_target_the_right_tokens():
    from duet_testing.demo_tasks import Scene, Shape

    tri = Shape("triangle", "blue", "large", 1, 2, x=0.8, y=0.5, r=0.1, rgb=(0, 0, 255))
    dot = Shape("circle", "red", "small", 0, 0, x=0.1, y=0.1, r=0.05, rgb=(255, 0, 0))
    scene = Scene((dot, tri), noisy=False, seed=1, width=120, height=60, style="varied")
    assert asked_shape(scene, "<image>What color is the triangle?") is tri
    assert asked_shape(scene, "<image>Where is the red circle?") is dot
    assert asked_shape(scene, "<image>How many shapes are there?") is None
    gh, gw = 2, 4  # 60 x 120 pixels as 2 x 4 merged tokens
    assert centre_token(tri, gh, gw) == 1 * gw + 3 and centre_token(dot, gh, gw) == 0
    kind, color, cell, owner = token_targets(scene, gh, gw)
    assert kind[0] == 1 and kind[7] == 1 + 2 and color[7] == 2  # circle; triangle (kind 2), blue (colour 2)
    assert kind.count(0) == 6 and all(c == -100 for k, c in zip(kind, color, strict=True) if k == 0)
    assert owner == [0, -1, -1, -1, -1, -1, -1, 1]
    assert cell == [0, 1, 1, 2, 6, 7, 7, 8]  # the third of the image each token's centre is in
    probe = TokenProbe(8)
    with torch.no_grad():  # no evidence: each of the four predictions costs log(its classes)
        for head in (probe.kind, probe.color, probe.cell, probe.shape_kind):
            head.weight.zero_(), head.bias.zero_()
    want = math.log(5) + math.log(6) + math.log(9) + math.log(4)
    assert probe.loss(torch.randn(gh * gw, 8), [scene], [(gh, gw)]).item() == pytest.approx(want, rel=1e-5)
    match = MatchProbe(8)
    with torch.no_grad():  # score = feature 0
        match.score.weight.zero_(), match.score.bias.zero_()
        match.score.weight[0, 0] = 1.0
    hidden = torch.zeros(1, 3 + gh * gw, 8)
    hidden[0, 3 + 7, 0] = 20.0  # the triangle's token stands out
    is_image = torch.tensor([[False] * 3 + [True] * (gh * gw)])
    assert match.loss(hidden, is_image, [None]) is None
    assert match.loss(hidden, is_image, [7]).item() < 1e-6
    assert match.loss(hidden, is_image, [0]).item() == pytest.approx(20.0, abs=1e-3)


def test_conversations_ask_at_least_min_turns_questions():
    import random

    from duet_testing.demo_tasks import make_conversation

    def singles(min_turns):
        rng = random.Random(0)
        return [c for c in (make_conversation(rng, min_turns=min_turns) for _ in range(300)) if len(c.scenes) == 1]

    full, default = singles(4), singles(1)
    # every scene answers the count and describe questions; color and position only where a shape is unambiguous
    assert full and all(len(c.turns) >= 2 for c in full)
    assert sum(len(c.turns) == 4 for c in full) > len(full) / 2
    for c in full:
        questions = [q.removeprefix("<image>") for q, _ in c.turns]
        assert c.turns[0][0].startswith("<image>") and len(set(questions)) == len(questions)
    assert any(len(c.turns) == 1 for c in default)
    assert sum(len(c.turns) for c in full) > 1.3 * sum(len(c.turns) for c in default)


def test_the_centre_probe_marks_one_token_per_shape():
    from duet_testing.demo_tasks import Scene, Shape

    tri = Shape("triangle", "blue", "large", 1, 2, x=0.8, y=0.5, r=0.1, rgb=(0, 0, 255))
    dot = Shape("circle", "red", "small", 0, 0, x=0.1, y=0.1, r=0.05, rgb=(255, 0, 0))
    scenes = [Scene((dot, tri), noisy=False, seed=1, width=120, height=60, style="varied")] * 2
    grids = [(2, 4), (2, 4)]  # the same scene twice: the second image's tokens follow the first's
    visual = torch.zeros(16, 8)
    visual[[0, 7, 8, 15], 0] = 1.0  # feature 0 set exactly on the centre tokens (0 and 7 of each image)
    probe = TokenProbe(8, centre=True)
    with torch.no_grad():  # the centre head reads feature 0: +-10 logits
        probe.centre.weight.zero_(), probe.centre.bias.zero_()
        probe.centre.weight[1, 0], probe.centre.bias[0] = 20.0, 10.0
    sharp = probe.loss(visual, scenes, grids)
    with torch.no_grad():
        probe.centre.weight.zero_(), probe.centre.bias.zero_()
    flat = probe.loss(visual, scenes, grids)
    assert (flat - sharp).item() == pytest.approx(math.log(2), abs=1e-3)  # right on every token: its term ~0
    plain = TokenProbe(8)
    plain.load_state_dict({k: v for k, v in probe.state_dict().items() if not k.startswith("centre")})
    assert (flat - plain.loss(visual, scenes, grids)).item() == pytest.approx(math.log(2), abs=1e-5)
