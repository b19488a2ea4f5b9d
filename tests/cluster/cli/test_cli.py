"""``duet generate``: JSON output that matches transformers, text + image prompts, the embedded demo model, and the
one-line, exit-code-2 contract for every error a user can cause.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster.cli.main import EXIT_USAGE, main
from cluster.demo import cached_model
from duet_testing.checkpoints import load_reference_model
from tests.conftest import make_image

REPO_ROOT = Path(__file__).resolve().parents[3]
PROMPT_IDS = [253, 17, 4, 99, 23, 5, 180, 42]


@pytest.fixture(autouse=True)
def duet_home(tmp_path, monkeypatch) -> Path:
    """Keep the embedded demo model (and anything else) out of the user's home."""
    home = tmp_path / "duet-home"
    monkeypatch.setenv("DUET_HOME", str(home))
    return home


@pytest.fixture
def image_file(tmp_path) -> Path:
    path = tmp_path / "cat.png"
    make_image(3).save(path)
    return path


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["generate", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _hf_greedy(model_dir: Path, ids: list[int], max_new: int, **inputs) -> list[int]:
    ref = load_reference_model(model_dir)
    with torch.inference_mode():
        seq = ref.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=max_new, do_sample=False, **inputs)
    return seq[0, len(ids):].tolist()


def test_token_ids_json_matches_transformers(tiny_model_dir, capsys):
    ids = ",".join(map(str, PROMPT_IDS))
    rc, out, _ = _run(capsys, str(tiny_model_dir), "--token-ids", ids, "--max-tokens", "8", "--json")
    assert rc == 0
    result = json.loads(out)
    assert set(result) == {"token_ids", "text", "finish_reason", "metrics"}
    assert set(result["metrics"]) == {"ttft_s", "tpot_s"}
    assert result["metrics"]["ttft_s"] >= 0
    assert result["token_ids"] == _hf_greedy(tiny_model_dir, PROMPT_IDS, 8)
    assert result["finish_reason"] in ("length", "stop")
    assert isinstance(result["text"], str)


def test_prompt_with_image_matches_transformers(tiny_model_dir, image_file, capsys):
    from PIL import Image
    from transformers import AutoProcessor

    prompt = "<image> what is in the picture?"
    rc, out, _ = _run(capsys, str(tiny_model_dir), "--prompt", prompt, "--image", str(image_file), "--max-tokens",
                      "6", "--json")
    assert rc == 0
    result = json.loads(out)
    inputs = AutoProcessor.from_pretrained(tiny_model_dir)(text=prompt, images=Image.open(image_file),
                                                           return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    assert result["token_ids"] == _hf_greedy(tiny_model_dir, ids, 6, pixel_values=inputs["pixel_values"])


def test_plain_text_output(tiny_model_dir, capsys):
    rc, out, err = _run(capsys, str(tiny_model_dir), "--prompt", "hello there", "--max-tokens", "4")
    assert rc == 0 and out.endswith("\n") and "Traceback" not in err


def _unsupported(src: Path, tmp: Path) -> Path:
    path = Path(shutil.copytree(src, tmp / "unsupported"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["model_type"] = "gpt_neox"
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _garbage_image(tmp: Path) -> Path:
    path = tmp / "broken.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    return path


# case -> (argv from (model dir, tmp dir, good image file), substring the one-line message must contain)
BAD_INPUTS = {
    "missing-model-dir": (lambda m, t, i: [str(t / "nope"), "--prompt", "hi"], "model directory not found"),
    "unsupported-model-type": (lambda m, t, i: [str(_unsupported(m, t)), "--prompt", "hi"], "gpt_neox"),
    "image-does-not-decode": (lambda m, t, i: [str(m), "--prompt", "<image>hi", "--image", str(_garbage_image(t))],
                              "broken.png"),
    "image-file-missing": (lambda m, t, i: [str(m), "--prompt", "<image>hi", "--image", str(t / "none.png")],
                           "none.png"),
    "prompt-longer-than-context": (lambda m, t, i: [str(m), "--token-ids", ",".join(["7"] * 4096)], "4096"),
    "token-id-out-of-vocab": (lambda m, t, i: [str(m), "--token-ids", "253,5,999"], "999"),
    "placeholder-without-image": (lambda m, t, i: [str(m), "--prompt", "<image> hi"], "1 <image> placeholder"),
    "image-without-placeholder": (lambda m, t, i: [str(m), "--prompt", "hi", "--image", str(i)], "0 <image>"),
    "token-ids-image-mismatch": (lambda m, t, i: [str(m), "--token-ids", "253,255,255,5", "--image", str(i)],
                                 "image tokens"),
    "bad-max-tokens": (lambda m, t, i: [str(m), "--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
    "unknown-device": (lambda m, t, i: [str(m), "--prompt", "hi", "--device", "tpu9"], "unsupported device"),
}


def _assert_one_line_error(rc: int, out: str, err: str, needle: str) -> None:
    assert rc == EXIT_USAGE, (rc, out, err)
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("duet: error: ") and needle in lines[0], lines[0]
    assert out == ""


@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(tiny_model_dir, tmp_path, image_file, capsys, case):
    make_argv, needle = BAD_INPUTS[case]
    rc, out, err = _run(capsys, *make_argv(tiny_model_dir, tmp_path, image_file))
    _assert_one_line_error(rc, out, err, needle)


def _subprocess(*argv: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "DUET_HOME": str(home), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "cluster.cli", "generate", *argv], capture_output=True, text=True,
                          cwd=REPO_ROOT, env=env, timeout=120)


def test_real_process_exit_codes(tiny_model_dir, tmp_path, duet_home):
    bad = _subprocess(str(tmp_path / "nope"), "--prompt", "hi", home=duet_home)
    _assert_one_line_error(bad.returncode, bad.stdout, bad.stderr, "model directory not found")
    ok = _subprocess(str(tiny_model_dir), "--token-ids", ",".join(map(str, PROMPT_IDS)), "--max-tokens", "3",
                     "--json", home=duet_home)
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout)["token_ids"]) <= 3


def test_default_model_answers_the_readme_question(capsys):
    """No MODEL_DIR: the shipped demo model answers the README's question about the shipped example image."""
    rc, out, _ = _run(capsys, "--prompt", "<image>Describe the image.", "--image",
                      str(REPO_ROOT / "examples" / "shapes.png"), "--json")
    assert rc == 0
    got = json.loads(out)
    assert got["text"] == "red triangle top left, blue circle right, green square bottom"
    assert got["finish_reason"] == "stop"


def test_cached_model_builds_once_atomically(duet_home):
    calls = []

    def build(path: Path) -> None:
        calls.append(path)
        path.mkdir()
        (path / "config.json").write_text("{}")

    first = cached_model("thing", build)
    assert first == duet_home / "models" / "thing" and (first / "config.json").is_file()
    assert [p.name for p in (duet_home / "models").iterdir()] == ["thing"]  # no temporary leftovers
    assert cached_model("thing", build) == first and len(calls) == 1


def test_client_and_status_start_without_torch_and_generate_still_checks_its_transport():
    code = ("import sys\nfrom cluster.cli.main import build_parser, main\n"
            "for argv in (['client', '--help'], ['status', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules, 'engine' in sys.modules)\n"
            "try:\n    build_parser(['generate']).parse_args(['generate', '--prompt', 'x', '--kv-transport', 'pigeon'])\n"
            "except SystemExit as e:\n    print('refused', e.code)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-2:] == ["False False", "refused 2"], out.stdout[-2000:]
    assert "invalid choice: 'pigeon'" in out.stderr
