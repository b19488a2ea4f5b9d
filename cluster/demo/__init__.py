"""The embedded default model: used by every command when no model directory is given.

Until a trained demo model ships, this is a tiny random-weight LLaVA (SigLIP + Qwen3-MoE) with a tokenizer and an
image processor, built on first use into ``$DUET_HOME/models`` (default ``~/.cache/duet/models``). Its answers are
noise; it exists so the whole pipeline (tokenizer, images, MoE, paged KV) runs with zero setup.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

DEMO_NAME = "tiny-llava-moe-v1"


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
    """Path of the embedded default model, building it first if it is not there yet."""
    from engine.checkpoints import TinySpec, make_tiny_checkpoint

    spec = TinySpec(vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                    num_experts=8, top_k=2, image_size=56, patch_size=14)
    return cached_model(DEMO_NAME, lambda path: make_tiny_checkpoint(path, spec))
