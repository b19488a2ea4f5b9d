"""The embedded default model: used by every command when no model directory is given.

Until a trained demo model ships, this is a tiny random-weight LLaVA (SigLIP + Qwen3-MoE) with a tokenizer and an
image processor, built on first use into ``$DUET_HOME/models`` (default ``~/.cache/duet/models``). Its answers are
noise; it exists so the whole pipeline (tokenizer, images, MoE, paged KV) runs with zero setup.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEMO_NAME = "tiny-llava-moe-v1"


def duet_home() -> Path:
    return Path(os.environ.get("DUET_HOME") or Path.home() / ".cache" / "duet")


def default_model_dir() -> Path:
    """Path of the embedded default model, building it first if it is not there yet."""
    target = duet_home() / "models" / DEMO_NAME
    if (target / "config.json").is_file():
        return target
    from engine.checkpoints import TinySpec, make_tiny_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=target.parent))
    try:
        make_tiny_checkpoint(tmp, TinySpec(vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                                           head_dim=32, num_experts=8, top_k=2, image_size=56, patch_size=14))
        try:
            tmp.rename(target)  # atomic: a concurrent builder that lost the race just discards its copy
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
