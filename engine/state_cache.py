"""Per-sequence recurrent state of hybrid models (Qwen3.5's Gated DeltaNet layers): slots and their tensors.

A hybrid model's cache has two kinds: paged KV blocks for the full-attention layers and one **state slot** per
sequence holding every GDN layer's conv window and recurrent matrix. :class:`StateSlots` is the bookkeeping (which
slot each sequence holds); the :class:`engine.block_manager.BlockManager` owns it beside the blocks, so one admission
rule covers both kinds: a sequence gets its blocks and its slot together or waits, and freeing a sequence (finish,
abort, preemption) releases both. :class:`StateCache` is the storage the model runner allocates, one
:class:`LayerState` per GDN layer.

A slot's contents are valid only while its sequence holds it: a fresh prompt (nothing computed yet) starts from zero
state, never from what the slot held before, so slots are not cleared on release.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.qwen3_5.config import GdnConfig


class StateSlots:
    """Free list of ``num_slots`` state slots (lowest id first)."""

    def __init__(self, num_slots: int) -> None:
        assert num_slots > 0
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        assert self._free, "no free state slot (callers check num_free first)"
        return self._free.pop()

    def release(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self._free, f"double release of state slot {slot}"
        self._free.append(slot)

    def check_no_leaks(self) -> None:
        held = self.num_slots - len(self._free)
        assert not held, f"{held} state slot(s) still held"


@dataclass
class LayerState:
    """One GDN layer's state for every slot: conv windows ``[slots, conv_dim, K-1]`` (model dtype) and recurrent
    matrices ``[slots, Hv, Dk, Dv]`` (float32)."""

    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass
class StateStep:
    """Which slot each sequence of a step reads and writes: one per prefill span (in ``AttentionMetadata.prefills``
    order) and one per decode row (in decode-row order)."""

    prefill_slots: list[int]
    decode_slots: torch.Tensor | None  # [B] long


class StateCache:
    """The state tensors of ``num_layers`` GDN layers x ``num_slots`` slots."""

    def __init__(self, gdn: GdnConfig, num_layers: int, num_slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.layers = [LayerState(
            torch.zeros(num_slots, gdn.conv_dim, gdn.conv_kernel - 1, dtype=dtype, device=device),
            torch.zeros(num_slots, gdn.num_v_heads, gdn.k_head_dim, gdn.v_head_dim, dtype=torch.float32,
                        device=device)) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(s.conv.numel() * s.conv.element_size() + s.recurrent.numel() * 4 for s in self.layers)

    def read(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one slot's state in GDN layer ``layer`` (ordinal among GDN layers): (conv, recurrent)."""
        s = self.layers[layer]
        return s.conv[slot].clone(), s.recurrent[slot].clone()

    def write(self, layer: int, slot: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        s = self.layers[layer]
        s.conv[slot].copy_(conv.to(device=s.conv.device, dtype=s.conv.dtype))
        s.recurrent[slot].copy_(recurrent.to(device=s.recurrent.device, dtype=torch.float32))
