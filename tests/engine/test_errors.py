"""Typed errors through the public API (``engine.errors``): bad checkpoints fail at load time, bad requests fail
before anything is admitted, and the engine keeps serving afterwards with no leaked KV block.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from engine import (LLM, CheckpointError, DuetError, ImageDecodeError, ImageTokenMismatchError, InvalidRequestError,
                    PromptTooLongError, SamplingParams, TokenOutOfVocabError, UnsupportedModelError)
from tests.conftest import LLM_DEFAULTS, assert_no_leaked_blocks, greedy, make_image, make_request

# --------------------------------------------------------------------------------------------------- checkpoints


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "copy"))


def _edit_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_model_dir(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError, match="model directory not found") as info:
        LLM(missing, **LLM_DEFAULTS)
    assert str(missing) in str(info.value)


def test_missing_config(tiny_model_dir, tmp_path):
    path = _copy(tiny_model_dir, tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(path, **LLM_DEFAULTS)


def test_missing_safetensors(tiny_model_dir, tmp_path):
    path = _copy(tiny_model_dir, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        LLM(path, **LLM_DEFAULTS)


@pytest.mark.parametrize("where", ["top", "text_config", "vision_config"])
def test_unsupported_model_type(tiny_model_dir, tmp_path, where):
    path = _copy(tiny_model_dir, tmp_path)

    def edit(cfg: dict) -> None:
        (cfg if where == "top" else cfg[where])["model_type"] = "gpt_neox"

    _edit_config(path, edit)
    with pytest.raises(UnsupportedModelError, match="unsupported .*model_type 'gpt_neox'"):
        LLM(path, **LLM_DEFAULTS)
    assert issubclass(UnsupportedModelError, CheckpointError)


@pytest.mark.parametrize("device", ["foo", "meta"])
def test_unsupported_device(tiny_model_dir, device):
    with pytest.raises(InvalidRequestError, match=f"unsupported device '{device}'"):
        LLM(tiny_model_dir, **{**LLM_DEFAULTS, "device": device})


def test_checkpoint_without_tokenizer_takes_token_ids_only(tiny_ckpt, make_llm):
    llm = make_llm(tiny_ckpt(with_tokenizer=False, with_processor=False))
    assert llm.get_tokenizer() is None
    with pytest.raises(InvalidRequestError, match="no tokenizer.json"):
        llm.generate(["hello"], greedy(2))
    outs = llm.generate([make_request(4, images=[make_image(1)])], greedy(3))  # default image preprocessing
    assert len(outs[0].outputs[0].token_ids) == 3 and outs[0].outputs[0].text == ""


# ------------------------------------------------------------------------------------------------------ requests
def _png_bytes() -> bytes:
    buf = io.BytesIO()
    make_image(1).save(buf, format="PNG")
    return buf.getvalue()


IMAGE_PROMPT = "<image>what is it?"
BAD_REQUESTS = {
    "garbage-image-bytes": ({"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": b"definitely not an image"}},
                            ImageDecodeError),
    "truncated-png": ({"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": _png_bytes()[:80]}}, ImageDecodeError),
    "missing-image-file": ({"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": "/nonexistent/cat.png"}},
                           ImageDecodeError),
    "image-of-wrong-type": ({"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": 42}}, InvalidRequestError),
    "prompt-too-long": ({"prompt_token_ids": [1] * 128}, PromptTooLongError),
    "text-prompt-too-long": ("ba" * 200, PromptTooLongError),
    "token-id-too-big": ({"prompt_token_ids": [253, 3, 256]}, TokenOutOfVocabError),
    "token-id-negative": ({"prompt_token_ids": [253, -1, 4]}, TokenOutOfVocabError),
    "token-ids-not-ints": ({"prompt_token_ids": [253, "a"]}, InvalidRequestError),
    "placeholder-without-image": ("<image>what is it?", ImageTokenMismatchError),
    "image-without-placeholder": ({"prompt": "what is it?", "multi_modal_data": {"image": make_image(2)}},
                                  ImageTokenMismatchError),
    "two-images-one-placeholder": ({"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": [make_image(2),
                                                                                           make_image(3)]}},
                                   ImageTokenMismatchError),
    "token-ids-image-count": ({"prompt_token_ids": [253, 255, 255, 5], "multi_modal_data": {"image": make_image(4)}},
                              ImageTokenMismatchError),
    "token-ids-image-no-pixels": ({"prompt_token_ids": [253, 255, 255, 255, 5]}, ImageTokenMismatchError),
    "empty-prompt": ({"prompt_token_ids": []}, InvalidRequestError),
    "not-a-prompt": (12345, InvalidRequestError),
    "unknown-modality": ({"prompt": "hi", "multi_modal_data": {"audio": b"x"}}, InvalidRequestError),
}


def _good(llm: LLM) -> None:
    """The engine still serves a good request (text + image) and is idle afterwards."""
    prompts = [make_request(5, seed=1, images=[make_image(5)]), "hello"]
    outs = llm.generate(prompts, greedy(4))
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("case", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_bad_request_is_typed_and_harmless(make_llm, case):
    prompt, err = BAD_REQUESTS[case]
    llm = make_llm()
    with pytest.raises(err) as info:
        llm.generate([prompt], greedy(4))
    assert isinstance(info.value, InvalidRequestError) and isinstance(info.value, DuetError)
    message = str(info.value)
    assert message and "\n" not in message
    assert_no_leaked_blocks(llm)
    with pytest.raises(err):
        llm.engine.add_request(f"bad-{case}", prompt, greedy(4))
    assert_no_leaked_blocks(llm)
    _good(llm)


def test_one_bad_prompt_rejects_the_whole_batch(make_llm):
    llm = make_llm()
    with pytest.raises(TokenOutOfVocabError):
        llm.generate([make_request(4, seed=1), {"prompt_token_ids": [253, 999]}, "ok"], greedy(4))
    assert_no_leaked_blocks(llm)
    _good(llm)


def test_duplicate_request_id(make_llm):
    llm = make_llm()
    llm.engine.add_request("same", make_request(4), greedy(2))
    with pytest.raises(InvalidRequestError, match="duplicate request id"):
        llm.engine.add_request("same", make_request(4), greedy(2))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert_no_leaked_blocks(llm)
    _good(llm)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_tokens=0),
                                    dict(min_tokens=5, max_tokens=2)], ids=str)
def test_bad_sampling_params(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_prompt_limit_follows_max_model_len_and_pool(make_llm):
    llm = make_llm(max_model_len=16)
    with pytest.raises(PromptTooLongError, match="16"):
        llm.generate({"prompt_token_ids": [1] * 16}, greedy(2))
    assert len(llm.generate({"prompt_token_ids": [1] * 15}, greedy(4))[0].outputs[0].token_ids) == 1
    small_pool = make_llm(num_kv_blocks=3)  # 12 slots: the pool, not the model, bounds the context
    per_token = small_pool.engine.runner.kv_bytes_per_token
    with pytest.raises(PromptTooLongError, match=rf"{12 * per_token / 2**20:.1f} MiB \({per_token} bytes a token\)"):
        small_pool.generate({"prompt_token_ids": [1] * 12}, greedy(2))
    small_pool.engine.block_manager.check_no_leaks()
    _good(llm)
