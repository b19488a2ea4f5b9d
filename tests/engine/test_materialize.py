"""A model built on the meta device gets real storage (engine.model.materialize): the dtype asked for floating
tensors only, tensors shared between modules stay shared, and a worker's load never imports sympy (torch's
meta-tensor path does, 0.3 s of every worker's start)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from engine.model import materialize

ROOT = Path(__file__).resolve().parents[2]


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.frozen = nn.Linear(4, 4)
        self.frozen.weight.requires_grad_(False)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.long))
        self.register_buffer("scale", torch.ones(2))


def test_materialize_gives_storage_in_the_dtype_and_keeps_sharing():
    with torch.device("meta"):
        m = _Tied()
    materialize(m, torch.device("cpu"), torch.bfloat16)
    assert all(t.device.type == "cpu" for t in (*m.parameters(), *m.buffers()))
    assert m.head.weight is m.embed.weight and isinstance(m.head.weight, nn.Parameter)
    assert len(list(m.parameters())) == 3  # the tied weight once, the frozen layer's weight and bias
    assert m.embed.weight.dtype == torch.bfloat16 and m.scale.dtype == torch.bfloat16
    assert m.steps.dtype == torch.long and m.steps.shape == (3,)
    assert not m.frozen.weight.requires_grad and m.frozen.bias.requires_grad
    assert set(m.state_dict()) == {"embed.weight", "head.weight", "frozen.weight", "frozen.bias", "steps", "scale"}


def test_loading_the_demo_model_imports_no_sympy():
    code = ("import sys, torch; from engine.config import ModelConfig; from engine.model import LlavaModel; "
            "from cluster.demo import default_model_dir; d = default_model_dir(); "
            "m = LlavaModel.load(d, ModelConfig.from_pretrained(d), torch.float32, 'cpu', 'native'); "
            "print('sympy' in sys.modules, sum(p.numel() for p in m.parameters()) > 0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]
