"""What moves: the shape of one layer's KV per block (:class:`KVLayout`) and of the per-request state frames of
hybrid models (:class:`StateLayout` of :class:`TensorSpec`), with the dtype names the wire uses (:data:`DTYPES`).

Plain frozen values, validated on construction; imports torch only for dtypes (re-exported by
:mod:`kv_transfer.base`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVLayout:
    """Shape of one layer's KV for one block: K and V are each ``[block_size, num_kv_heads, head_dim]``."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def block_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """Shape of K (and of V) for ``num_blocks`` blocks of one layer."""
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def layer_nbytes(self, num_blocks: int) -> int:
        """Bytes of K plus V for ``num_blocks`` blocks of one layer, uncompressed."""
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * math.prod(self.block_shape(num_blocks)) * itemsize

    def transfer_nbytes(self, num_blocks: int) -> int:
        """Bytes of every layer's K and V for ``num_blocks`` blocks, uncompressed."""
        return self.num_layers * self.layer_nbytes(num_blocks)


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of a state frame: its shape and dtype name (a key of :data:`DTYPES`)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(x) for x in self.shape))
        if not self.name or not isinstance(self.name, str) or any(x <= 0 for x in self.shape):
            raise ValueError(f"TensorSpec needs a name and a positive shape, got {self.name!r} {self.shape}")
        if self.dtype not in DTYPES:
            raise ValueError(f"TensorSpec.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=DTYPES[self.dtype]).element_size()


@dataclass(frozen=True)
class StateLayout:
    """Per-request state that travels beside the KV (hybrid models): ``num_frames`` state frames, each holding one
    tensor per spec (:mod:`kv_transfer.state_frames`)."""

    num_frames: int
    tensors: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        specs = tuple(s if isinstance(s, TensorSpec) else TensorSpec(**s) for s in self.tensors)
        object.__setattr__(self, "tensors", specs)
        if not isinstance(self.num_frames, int) or self.num_frames <= 0 or not specs:
            raise ValueError(f"StateLayout needs num_frames > 0 and tensors, got {self.num_frames!r}, {specs}")
        if len({s.name for s in specs}) != len(specs):
            raise ValueError("StateLayout tensor names must be distinct")

    @property
    def frame_nbytes(self) -> int:
        return sum(s.nbytes for s in self.tensors)

    @property
    def transfer_nbytes(self) -> int:
        return self.num_frames * self.frame_nbytes
