"""Front-end CPU per image request: ``DisaggCluster._prepare`` (validate, tokenize, decode + preprocess the images)
plus packing the decode worker's ``allocate`` and the prefill worker's ``submit`` messages, and the workers' intake
(unpacking the prompt into the engine's :class:`~engine.inputs.ProcessedPrompt`). ``time.process_time`` medians.

    python -m duet_bench.prompt_cpu [--iters 30] [--json out.json]

Cases: the demo model (Qwen3-VL-MoE, 128^2 to 224^2 px) with a 640x480 JPEG and a 96x96 PIL image; the tiny Qwen3-VL checkpoint
(max 128x128 px) and the same with a serving-size ``max_pixels`` (1280 x 28 x 28) on the 640x480 JPEG.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import PIL.Image

from cluster.control.disagg import DisaggCluster
from cluster.demo import DEMO_MODEL_DIR
from engine import SamplingParams
from engine.config import ModelConfig
from engine.inputs import InputProcessor, image_processor_for
from engine.tokenizer import Tokenizer
from node_common import messages, prompt_wire

DEMO = DEMO_MODEL_DIR


def photo(h: int, w: int, seed: int = 0) -> bytes:
    """A photo-like JPEG (gradient + noise)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // w, y * 255 // h, (x + y) * 127 // (w + h)], -1)
    buf = io.BytesIO()
    PIL.Image.fromarray(np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)).save(
        buf, format="JPEG", quality=90)
    return buf.getvalue()


class _FrontEnd:  # what DisaggCluster._prepare reads
    def __init__(self, model_dir: str) -> None:
        cfg = ModelConfig.from_pretrained(model_dir)
        tok = Tokenizer.from_pretrained(model_dir) if (Path(model_dir) / "tokenizer.json").is_file() else None
        self.inputs = InputProcessor(cfg, tok, image_processor_for(model_dir, cfg), 4096)


def measure(model_dir: str, prompt: dict, iters: int) -> dict:
    front, params = _FrontEnd(model_dir), messages.params_to_dict(SamplingParams(max_tokens=16))
    fe, intake = [], []
    for _ in range(iters):
        t = time.process_time()
        _, wire = DisaggCluster._prepare(front, prompt)
        to_decode = messages.pack(request_id="r", params=params, prompt=wire["decode"])
        to_prefill = messages.pack(request_id="r", params=params, prompt=wire["prefill"], lease={})
        fe.append(time.process_time() - t)
        t = time.process_time()
        for msg in (to_decode, to_prefill):
            front.inputs.check_processed(prompt_wire.prompt_from_wire(messages.unpack(msg)["prompt"],
                                                                      front.inputs.image_processor))
        intake.append(time.process_time() - t)
    return {"frontend_ms": 1e3 * statistics.median(fe), "intake_ms": 1e3 * statistics.median(intake),
            "prefill_msg_kb": len(to_prefill) / 1024, "decode_msg_kb": len(to_decode) / 1024}


def cases(tmp: Path) -> dict[str, tuple[str, dict]]:
    from duet_testing.qwen_checkpoints import QwenTinySpec, make_tiny_qwen_checkpoint

    qwen = make_tiny_qwen_checkpoint(tmp / "qwen", QwenTinySpec())
    big = tmp / "qwen-big"
    shutil.copytree(qwen, big)
    pc = json.loads((big / "preprocessor_config.json").read_text())
    pc.pop("min_pixels", None), pc.pop("max_pixels", None)
    pc["size"] = {"shortest_edge": 3136, "longest_edge": 1280 * 28 * 28}
    (big / "preprocessor_config.json").write_text(json.dumps(pc))
    jpeg = photo(480, 640)
    small = PIL.Image.open(io.BytesIO(photo(96, 96))).convert("RGB")
    ask = lambda im: {"prompt": "describe <image> please", "multi_modal_data": {"image": [im]}}  # noqa: E731
    return {"demo 640x480 jpeg": (str(DEMO), ask(jpeg)), "demo 96x96 PIL": (str(DEMO), ask(small)),
            "qwen3-vl tiny (max 128x128 px) 640x480 jpeg": (str(qwen), ask(jpeg)),
            "qwen3-vl (max 1280x28x28 px) 640x480 jpeg": (str(big), ask(jpeg))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = {name: measure(d, p, a.iters) for name, (d, p) in cases(Path(tmp)).items()}
    print(f"{'case':46} {'front-end ms':>12} {'intake ms':>10} {'prefill KB':>11} {'decode KB':>10}")
    for name, r in rows.items():
        print(f"{name:46} {r['frontend_ms']:12.2f} {r['intake_ms']:10.2f} {r['prefill_msg_kb']:11.1f} "
              f"{r['decode_msg_kb']:10.1f}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
