"""The demo model, the embedded default of every command when no model directory is given.

A small Qwen3-VL-MoE (native-resolution vision tower with DeepStack, MoE text model with 8 experts and top-2
routing, interleaved M-RoPE, the released checkpoints' layout) trained on :mod:`duet_testing.demo_tasks` by
:mod:`scripts.demo.train`, shipped in ``cluster/demo/model`` and installed with the package. It answers questions
about images of shapes of any size ("What color is the triangle?"), so a first run shows a right answer through the
flagship path and benchmarks can report task accuracy. (The LLaVA demo it replaced is a test fixture,
``tests/fixtures/llava_demo``.) Models built on demand (the bench model) are cached under ``$DUET_HOME/models``
(default ``~/.cache/duet/models``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "model"


def duet_home() -> Path:
    return Path(os.environ.get("DUET_HOME") or Path.home() / ".cache" / "duet")


def cached_model(name: str, build: Callable[[Path], object]) -> Path:
    """``$DUET_HOME/models/<name>``, calling ``build(path)`` to create it on first use.

    Builds into a temporary sibling and renames it into place, so an interrupted build never leaves a half-written
    model and a concurrent builder that loses the race just discards its copy.
    """
    target = duet_home() / "models" / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build(tmp / "m")
        try:
            (tmp / "m").rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_model_dir() -> Path:
    """The shipped demo model's directory."""
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        from engine.errors import CheckpointError

        raise CheckpointError(f"the demo model is missing from {DEMO_MODEL_DIR}; reinstall duet-serve or pass MODEL_DIR")
    return DEMO_MODEL_DIR
