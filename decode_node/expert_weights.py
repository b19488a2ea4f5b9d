"""Reads single experts' weights straight from the checkpoint, so a worker holds only its slots' experts.

Both key layouts the loader accepts are served: per-expert tensors (``experts.N.{gate,up,down}_proj.weight``, or
Mixtral's ``w1/w3/w2``) and fused ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]`` (read with a
lazy slice, so only the asked rows leave the file), either as transformers 5 saves them or transposed as the released
Qwen3-VL-MoE checkpoints store them (``[E, H, 2I]`` / ``[E, I, H]``; the shape tells, and where it cannot, the
checkpoint's ``ModelConfig.expert_layout_hint``, as the engine's loader decides). Returned tensors use the runtime
layout of :class:`engine.moe.SparseMoe`: ``gate_up [n, 2I, H]`` (gate rows, then up rows) and ``down [n, H, I]``.

Thread-safe: every call opens the files it needs (safetensors maps them; opening is cheap), so the background
placement loader and the decode loop never share a handle.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.config import ModelConfig
from engine.errors import CheckpointError
from engine.loader import canonical_name, weight_files


class ExpertWeightSource:
    def __init__(self, model_dir: str | Path, *, dtype: torch.dtype) -> None:
        self.dtype = dtype
        cfg = ModelConfig.from_pretrained(Path(model_dir))
        hidden, inter = cfg.text.hidden_size, cfg.text.moe_intermediate_size
        self._runtime = {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}  # one expert's [out, in]
        self._hint = cfg.expert_layout_hint
        self._where: dict[str, tuple[Path, str]] = {}  # canonical name -> (file, checkpoint key)
        for file in weight_files(Path(model_dir)):
            try:
                with safe_open(str(file), framework="pt") as f:
                    for key in f.keys():
                        name = canonical_name(key)
                        if name is not None and ".mlp.experts." in name:
                            self._where[name] = (file, key)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot read {file}: {e}") from None

    def read(self, layer: int, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer ``layer``'s ``experts`` (logical ids, any order, repeats allowed) -> (gate_up, down) on the
        CPU in ``dtype``."""
        base = f"text.layers.{layer}.mlp.experts."
        if base + "gate_up_proj" in self._where:
            gu = torch.stack([self._fused(base + "gate_up_proj", e) for e in experts])
            down = torch.stack([self._fused(base + "down_proj", e) for e in experts])
        else:
            gu = torch.stack([torch.cat([self._get(f"{base}{e}.gate_proj.weight"),
                                         self._get(f"{base}{e}.up_proj.weight")]) for e in experts])
            down = torch.stack([self._get(f"{base}{e}.down_proj.weight") for e in experts])
        return gu.to(self.dtype), down.to(self.dtype)

    def _fused(self, name: str, expert: int) -> torch.Tensor:
        """One expert's rows of a fused tensor in the runtime's ``[out, in]``, transposing a released checkpoint's."""
        row = self._get(name, expert)
        want = self._runtime[name.rsplit(".", 1)[1]]
        flipped = (want[1], want[0])
        if tuple(row.shape) == flipped and (flipped != want or self._hint == "published"):
            return row.t()
        return row

    def _get(self, name: str, row: int | None = None) -> torch.Tensor:
        try:
            file, key = self._where[name]
        except KeyError:
            raise CheckpointError(f"checkpoint has no expert tensor {name}") from None
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(key) if row is None else f.get_slice(key)[row]
