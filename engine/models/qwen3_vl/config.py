"""Qwen3-VL vision tower configuration (:class:`QwenVisionConfig`, the ``vision_config`` of a Qwen3-VL or Qwen3.5
checkpoint). Kept apart from the tower (:mod:`engine.models.qwen3_vl.vision`) so :mod:`engine.config` can name the
type without importing modules."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import CheckpointError, UnsupportedModelError
from engine.layers import ACTIVATIONS

_REQUIRED = ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "out_hidden_size",
             "num_position_embeddings", "deepstack_visual_indexes")
_INT_KEYS = ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "temporal_patch_size",
             "spatial_merge_size", "in_channels", "out_hidden_size", "num_position_embeddings")
_DEFAULTS = {"temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3}  # transformers' defaults
_ALIASES = {"depth": "num_hidden_layers", "num_heads": "num_attention_heads"}  # transformers' attribute_map


@dataclass(frozen=True)
class QwenVisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    hidden_act: str
    layer_norm_eps: float = 1e-6  # hard-coded in the reference, not a config.json key
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported vision activation {self.hidden_act!r} "
                                        f"(supported: {', '.join(ACTIVATIONS)})")
        if bad := [n for n in _INT_KEYS if getattr(self, n) <= 0]:
            raise CheckpointError(f"vision config sizes must be positive: {', '.join(bad)}")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise CheckpointError(f"vision hidden_size {self.hidden_size} / num_heads {self.num_heads} must give a "
                                  "head_dim divisible by 4 (2-D rotary)")
        if self.position_side ** 2 != self.num_position_embeddings:
            raise CheckpointError(f"vision num_position_embeddings {self.num_position_embeddings} is not a square")
        idx = self.deepstack_visual_indexes
        if len(set(idx)) != len(idx) or any(not 0 <= i < self.depth for i in idx):
            raise CheckpointError(f"vision deepstack_visual_indexes {list(idx)} must be distinct blocks of "
                                  f"0..{self.depth - 1}")

    @classmethod
    def from_dict(cls, d: dict) -> QwenVisionConfig:
        """Parse a checkpoint's ``config.json`` ``vision_config``; defaults are transformers' for optional keys."""
        d = {**{k: d[a] for k, a in _ALIASES.items() if a in d}, **d}
        if missing := [k for k in _REQUIRED if k not in d]:
            raise CheckpointError(f"vision config is missing {', '.join(map(repr, missing))}")
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise UnsupportedModelError(f"unsupported vision rope_type {rope['rope_type']!r} (only 'axial')")
        try:
            ints = {k: _as_int(d.get(k, _DEFAULTS.get(k)), k) for k in _INT_KEYS}
            deepstack = tuple(_as_int(i, "deepstack_visual_indexes") for i in d["deepstack_visual_indexes"])
            theta = float(rope.get("rope_theta", 10000.0))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"bad vision config value: {e}") from None
        act = str(d.get("hidden_act", "gelu_pytorch_tanh"))
        return cls(**ints, deepstack_visual_indexes=deepstack, hidden_act=act, rope_theta=theta)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def position_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def tokens_for_grid(self, t: int, h: int, w: int) -> int:
        """Merged features (= LLM placeholder tokens) for one ``grid_thw`` entry."""
        return t * h * w // self.spatial_merge_size ** 2


def _as_int(x: object, key: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int | float) or int(x) != x:
        raise ValueError(f"{key} must be an integer, got {x!r}")
    return int(x)
