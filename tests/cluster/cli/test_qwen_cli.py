"""``duet generate`` on a tiny Qwen3-VL-MoE checkpoint: ``--token-ids`` (transformers' expanded ids) with ``--image``
and ``--prompt`` through the chat template give the local engine's greedy tokens, locally and disaggregated (gloo
with tiered experts, gRPC with an expert-parallel decode pair); ``--prompt``'s ids equal transformers' template +
Qwen3-VL placeholder expansion; over ``--max-visual-tokens``, pad runs not matching the images, and video exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import PIL.Image
import pytest

from cluster.cli.main import EXIT_USAGE, main
from engine import LLM, SamplingParams
from duet_testing.qwen_checkpoints import make_tiny_qwen_checkpoint
from engine.models.qwen3_vl.image_processor import QwenVLImageProcessor
from tests.conftest import make_image
from tests.cluster.serve.test_qwen_serve import QUESTION, SPEC, expected_prompt_ids

MAX_TOKENS = 6
VIDEO_PAD = SPEC.special_token_ids["<|video_pad|>"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen_checkpoint(tmp_path_factory.mktemp("qwen-cli") / "ckpt", SPEC)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("qwen-images")
    paths = {"small": d / "small.png", "large": d / "large.png"}  # 4 and 12 visual tokens
    make_image(0, (50, 70)).save(paths["small"])
    make_image(1, (300, 400)).save(paths["large"])
    return paths


@pytest.fixture(scope="module")
def reference(model_dir, images) -> dict:
    """transformers' prompt ids for ``[image, QUESTION]`` with the small image, and the local engine's tokens."""
    image = PIL.Image.open(images["small"])
    count = QwenVLImageProcessor.from_pretrained(model_dir).num_visual_tokens(image.height, image.width)
    ids = expected_prompt_ids(model_dir, [count])
    llm = LLM(model_dir, dtype="float32", max_model_len=256, num_kv_blocks=64)
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": image}}],
                       SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0].outputs[0]
    return {"prompt_ids": ids, "token_ids": list(out.token_ids), "llm": llm}


def _generate(capsys, *argv: str) -> tuple[int, dict | None, str]:
    rc = main(["generate", *argv, "--max-tokens", str(MAX_TOKENS), "--json"])
    out, err = capsys.readouterr()
    return rc, json.loads(out) if rc == 0 else None, err


def _ids(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def test_prompt_through_the_chat_template_gives_transformers_ids(model_dir, images, reference):
    """``--prompt "<image>..."`` renders the image as a content part, as transformers' ``apply_chat_template`` does."""
    import argparse

    from cluster.cli.generate_cmd import _prompt

    llm = reference["llm"]
    args = argparse.Namespace(prompt=f"<image>{QUESTION}", raw_prompt=False, token_ids=None)
    prompt = _prompt(args, llm.get_tokenizer(), llm.engine.inputs.cfg, [PIL.Image.open(images["small"])])
    assert llm.engine.inputs.process(prompt).token_ids == reference["prompt_ids"]


def test_token_ids_and_prompt_equal_the_local_engine(model_dir, images, reference, capsys):
    rc, out, err = _generate(capsys, str(model_dir), "--token-ids", _ids(reference["prompt_ids"]),
                             "--image", str(images["small"]))
    assert rc == 0, err
    assert out["token_ids"] == reference["token_ids"]
    rc, out, err = _generate(capsys, str(model_dir), "--prompt", f"<image>{QUESTION}", "--image", str(images["small"]))
    assert rc == 0, err
    assert out["token_ids"] == reference["token_ids"]


@pytest.mark.parametrize("flags", [
    ("--kv-transport", "gloo", "--expert-resident", "0.5"),
    ("--kv-transport", "grpc", "--decode", "2", "--expert-parallel", "2"),
], ids=["gloo-tiered", "grpc-expert-parallel"])
def test_disagg_equals_the_local_engine(ray_cluster, model_dir, images, reference, capsys, flags):
    rc, out, err = _generate(capsys, str(model_dir), "--mode", "disagg", *flags, "--prompt", f"<image>{QUESTION}",
                             "--image", str(images["small"]))
    assert rc == 0, err
    assert out["token_ids"] == reference["token_ids"]
    assert out["kv_transfer"]["transport"] == flags[1] and out["kv_transfer"]["bytes"] > 0
    assert out["kv_transfer"]["layers"] == SPEC.num_layers and "experts" in out


def test_bad_input_exits_2(model_dir, images, reference, capsys):
    ids, pad = reference["prompt_ids"], SPEC.image_token_id
    small, large = str(images["small"]), str(images["large"])
    cases = {
        "max_visual_tokens is 20": ("--prompt", "<image><image>Compare.", "--image", large, "--image", large,
                                    "--max-visual-tokens", "20"),
        "placeholder runs hold [3]": ("--token-ids", _ids(ids[:ids.index(pad)] + ids[ids.index(pad) + 1:]),
                                      "--image", small),
        "placeholder runs hold [4] tokens but the image(s) need [12]": ("--token-ids", _ids(ids), "--image", large),
        "prompt has 2 image placeholder(s)": ("--prompt", "<image><image>Compare.", "--image", small),
        "video inputs are not supported": ("--token-ids", _ids([VIDEO_PAD if t == pad else t for t in ids])),
        "video inputs are not supported yet (the prompt holds <|video_pad|>)": (
            "--prompt", "<|vision_start|><|video_pad|><|vision_end|>What?"),
    }
    for message, argv in cases.items():
        rc, _, err = _generate(capsys, str(model_dir), *argv)
        assert rc == EXIT_USAGE and message in err and err.count("\n") == 1, (message, err)


def test_a_template_without_image_parts_gets_the_placeholder_text(model_dir):
    """A Qwen template that renders only string content: the message goes as it is and the engine expands
    ``<image>`` (the same ids as the template that renders image parts)."""
    from cluster.serve.chat import render_chat
    from engine.config import ModelConfig
    from engine.tokenizer import Tokenizer

    tok, cfg = Tokenizer.from_pretrained(model_dir), ModelConfig.from_pretrained(model_dir)
    messages = [{"role": "user", "content": f"<image>{QUESTION}"}]
    with_parts = render_chat(tok, cfg, messages)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{{ '<|im_start|>assistant\\n' }}")
    as_text = render_chat(tok, cfg, messages)
    assert as_text == f"<|im_start|>user\n<image>{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    assert as_text.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>") == with_parts


def test_duet_plan_measures_the_vision_towers_cost_per_image_token(model_dir):
    """``duet plan --profile-from-bench --model-dir`` on a Qwen3-VL checkpoint: images of two sizes give the tower's
    cost per image token (its images have no fixed token count)."""
    from cluster.cli.plan_cmd import measure_profile

    prof = measure_profile(None, model_dir=model_dir, lens=(16, 32, 64), batches=(1, 2), contexts=(16, 32))
    assert 0 < prof.prefill_per_visual_token_s < 0.1 and prof.prefill_per_image_s == 0  # per token, not per image
    assert model_dir.name in prof.source
