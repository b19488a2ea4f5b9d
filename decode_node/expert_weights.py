"""Reads single experts' weights straight from the checkpoint, so a worker holds only its slots' experts.

Both key layouts the loader accepts are served: per-expert tensors (``experts.N.{gate,up,down}_proj.weight``, or
Mixtral's ``w1/w3/w2``) and fused ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]`` (read with a
lazy slice, so only the asked rows leave the file). Returned tensors use the runtime layout of
:class:`engine.moe.SparseMoe`: ``gate_up [n, 2I, H]`` (gate rows, then up rows) and ``down [n, H, I]``.

Thread-safe: every call opens the files it needs (safetensors maps them; opening is cheap), so the background
placement loader and the decode loop never share a handle.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.errors import CheckpointError
from engine.loader import canonical_name, weight_files


class ExpertWeightSource:
    def __init__(self, model_dir: str | Path, *, dtype: torch.dtype) -> None:
        self.dtype = dtype
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
            gu = torch.stack([self._get(base + "gate_up_proj", e) for e in experts])
            down = torch.stack([self._get(base + "down_proj", e) for e in experts])
        else:
            gu = torch.stack([torch.cat([self._get(f"{base}{e}.gate_proj.weight"),
                                         self._get(f"{base}{e}.up_proj.weight")]) for e in experts])
            down = torch.stack([self._get(f"{base}{e}.down_proj.weight") for e in experts])
        return gu.to(self.dtype), down.to(self.dtype)

    def _get(self, name: str, row: int | None = None) -> torch.Tensor:
        try:
            file, key = self._where[name]
        except KeyError:
            raise CheckpointError(f"checkpoint has no expert tensor {name}") from None
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(key) if row is None else f.get_slice(key)[row]
