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

from collections import OrderedDict
from collections.abc import Callable
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
    order) and one per decode row (in decode-row order). ``prefill_snapshots``: per prefill span, ``(offset,
    snapshot slot)`` pairs in offset order: the state after the span's first ``offset`` tokens is also written to
    that slot (:class:`Snapshots`); None: no span writes one."""

    prefill_slots: list[int]
    decode_slots: torch.Tensor | None  # [B] long
    prefill_snapshots: list[list[tuple[int, int]]] | None = None


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


class Snapshots:
    """GDN state snapshots for a hybrid model's prefix cache: state slots ``first .. first + num - 1`` of the
    :class:`StateCache` (beside the sequences' own), each holding every GDN layer's conv window and recurrent state
    as they stood after some prompt block, filed under that block's hash (which chains the whole prefix before it).

    A prefix hit of a hybrid model ends on a block that has a snapshot: the hit's KV blocks are shared as usual and the
    snapshot is copied into the sequence's own slot before its remaining tokens run. A slot is **reserved** when a
    step is planned to write it (:meth:`reserve`), **filed** once that step computed the block (:meth:`file`) and
    **dropped** with its block (:meth:`drop`, when the block is evicted) or, least recently used first, when a new
    snapshot needs room. A slot a planned restore or write refers to is pinned and never taken.
    """

    def __init__(self, first: int, num: int, on_drop: Callable[[bytes], None] | None = None) -> None:
        """``on_drop(hash)``: told of each snapshot dropped (a hit no longer ends after that block)."""
        assert num > 0
        self.on_drop = on_drop
        self.first, self.num = first, num
        self._free = list(range(first + num - 1, first - 1, -1))
        self._filed: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, least recently used first
        self._pins: dict[int, int] = {}  # slot -> planned restores / writes that refer to it

    @property
    def num_filed(self) -> int:
        return len(self._filed)

    def find(self, block_hash: bytes) -> int | None:
        """The slot of the snapshot after block ``block_hash`` (marked recently used), or None."""
        slot = self._filed.get(block_hash)
        if slot is not None:
            self._filed.move_to_end(block_hash)
        return slot

    def holds(self, block_hash: bytes) -> bool:
        """Whether a snapshot after block ``block_hash`` is kept (not marked used)."""
        return block_hash in self._filed

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        n = self._pins[slot] - 1
        if n:
            self._pins[slot] = n
        else:
            del self._pins[slot]

    def reserve(self) -> int | None:
        """A slot for a snapshot a step will write (pinned): a free one, else the least recently used unpinned filed
        one (dropped). None when every slot is pinned."""
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._filed.items() if s not in self._pins), None)
            if victim is None:
                return None
            slot = self._filed.pop(victim)
            if self.on_drop is not None:
                self.on_drop(victim)
        self.pin(slot)
        return slot

    def file(self, slot: int, block_hash: bytes) -> None:
        """The reserved ``slot`` now holds the state after block ``block_hash``: file it (unpinned). When that block
        already has a snapshot, the slot goes back to the free list."""
        self.unpin(slot)
        if block_hash in self._filed:
            self._free.append(slot)
        else:
            self._filed[block_hash] = slot

    def cancel(self, slot: int) -> None:
        """A reserved slot that was not written (its sequence was freed, its block not registered)."""
        self.unpin(slot)
        self._free.append(slot)

    def drop(self, block_hash: bytes) -> None:
        """Its block was evicted: the snapshot after it can no longer be a hit (never a pinned one: a planned restore
        holds references on its blocks)."""
        slot = self._filed.pop(block_hash, None)
        if slot is not None:
            assert slot not in self._pins, "a pinned snapshot's block was evicted"
            self._free.append(slot)
            if self.on_drop is not None:
                self.on_drop(block_hash)

    def check_no_leaks(self) -> None:
        assert not self._pins, f"{len(self._pins)} snapshot slot(s) still pinned"
        assert len(self._free) + len(self._filed) == self.num, "snapshot slots out of sync"
