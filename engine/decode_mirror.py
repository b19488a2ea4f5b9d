"""Contiguous staging copies of the KV of decoding sequences (CPU/GPU, pure torch).

The paged pool stays the source of truth (prefix caching and KV transfer read it). Gathering every decoding
sequence's blocks into a dense batch on every step and layer would copy the whole context each time; instead each
decoding sequence owns a *slot* — a row of per-layer tensors ``[slots, kv_heads, capacity, head_dim]`` (the layout
attention reads, so a batch needs no transpose copy) — filled from
the pool once when it starts decoding and then appended to one token per step. Slots are kept dense (a released slot
takes the last slot's row), so when every decoding sequence is scheduled the batch is the view ``[:B, :max_len]``.

Sequences whose received KV had tokens dropped on the wire (:mod:`kv_transfer.compression`) also get a per-layer
additive bias row ``[slots, capacity]`` (``-inf`` at the dropped positions), allocated on first use; the runner adds
it to the decode mask of the layers it belongs to, so the dropped keys get no attention while positions (and RoPE)
of every other token stay where they were.

All methods run under ``torch.inference_mode`` (tensors grown during a step are inference tensors).
Call contract (model runner): ``assign`` before the step for each decoding sequence (fills new slots from the pool),
``release`` when a sequence finishes, is aborted or preempted. Memory: ``slots x capacity x kv_bytes_per_token``
(:attr:`DecodeKVMirror.nbytes`, plus the bias rows once used), grown by doubling. The engine takes the starting
allocation (:func:`reserved_bytes`) out of ``kv_cache_memory_gb`` before it sizes the pool; growth past it is not
budgeted but reported (``kv_mirror_bytes`` in worker stats, ``ClusterStatus`` and ``/metrics``).
"""

from __future__ import annotations

import torch

INITIAL_CAPACITY = 256  # tokens per slot at start when nothing is reserved
INITIAL_SLOTS = 8


def reserved_bytes(max_slots: int, kv_bytes_per_token: int, reserve_tokens: int | None = None) -> int:
    """Bytes of the mirror's starting allocation: ``max_slots`` slots of ``reserve_tokens`` when reserved (the
    engine's ``decode_mirror_tokens``), else :data:`INITIAL_SLOTS` of :data:`INITIAL_CAPACITY`.

    >>> reserved_bytes(64, 1000), reserved_bytes(64, 1000, reserve_tokens=512)
    (2048000, 32768000)
    """
    if reserve_tokens is None:
        return min(INITIAL_SLOTS, max_slots) * INITIAL_CAPACITY * kv_bytes_per_token
    return max_slots * reserve_tokens * kv_bytes_per_token


class DecodeKVMirror:
    def __init__(self, num_layers: int, max_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, initial_capacity: int = INITIAL_CAPACITY,
                 initial_slots: int = INITIAL_SLOTS) -> None:
        self.num_layers, self.max_slots = num_layers, max_slots
        self.shape_tail = (kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.slot_of: dict[int, int] = {}
        self.seq_in_slot: list[int] = []
        self.bias: list[torch.Tensor] | None = None  # per layer [slots, capacity], only once a slot had drops
        self.with_drops: set[int] = set()  # seq ids whose slot has a non-zero bias row
        self._alloc(min(initial_slots, max_slots), initial_capacity)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @torch.inference_mode()
    def _alloc(self, slots: int, capacity: int) -> None:
        shape = (slots, self.shape_tail[0], capacity, self.shape_tail[1])
        new_k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        new_v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        if self.k:
            s, c = self.k[0].shape[0], self.k[0].shape[2]
            for old, new in zip(self.k + self.v, new_k + new_v, strict=True):
                new[:s, :, :c] = old
        self.k, self.v = new_k, new_v
        if self.bias is not None:
            self._alloc_bias()

    @torch.inference_mode()
    def _alloc_bias(self) -> None:
        slots, cap = self.k[0].shape[0], self.k[0].shape[2]
        new = [torch.zeros((slots, cap), dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        if self.bias is not None:
            s, c = self.bias[0].shape
            for old, n in zip(self.bias, new, strict=True):
                n[:s, :c] = old
        self.bias = new

    def _ensure(self, slots: int, length: int) -> None:
        cur_slots, cap = self.k[0].shape[0], self.k[0].shape[2]
        if slots <= cur_slots and length <= cap:
            return
        new_slots, new_cap = cur_slots, cap
        while new_slots < slots:
            new_slots = min(self.max_slots, 2 * new_slots)
        while new_cap < length:
            new_cap *= 2
        self._alloc(new_slots, new_cap)

    @torch.inference_mode()
    def assign(self, seq_id: int, num_cached: int, pool: list[tuple[torch.Tensor, torch.Tensor]],
               block_table: list[int], next_len: int, dropped: dict[int, torch.Tensor] | None = None) -> int:
        """Slot of ``seq_id``; a new slot is filled with its first ``num_cached`` tokens from the pool.
        ``next_len`` is the length after this step (so the capacity can hold it). ``dropped``: layer -> token
        positions whose keys must get no attention (only read for a new slot)."""
        slot = self.slot_of.get(seq_id)
        if slot is None:
            slot = len(self.seq_in_slot)
            assert slot < self.max_slots, "more decoding sequences than max_num_seqs"
            self._ensure(slot + 1, next_len)
            self.slot_of[seq_id] = slot
            self.seq_in_slot.append(seq_id)
            if num_cached:
                nb = -(-num_cached // pool[0][0].shape[1])
                table = torch.tensor(block_table[:nb], device=self.device)
                for layer, (kc, vc) in enumerate(pool):
                    self.k[layer][slot, :, :num_cached] = kc[table].flatten(0, 1)[:num_cached].transpose(0, 1)
                    self.v[layer][slot, :, :num_cached] = vc[table].flatten(0, 1)[:num_cached].transpose(0, 1)
            if dropped:
                if self.bias is None:
                    self._alloc_bias()
                for layer in range(self.num_layers):
                    self.bias[layer][slot].zero_()
                for layer, positions in dropped.items():
                    self.bias[layer][slot, positions.to(self.device)] = float("-inf")
                self.with_drops.add(seq_id)
            elif self.bias is not None:
                for b in self.bias:
                    b[slot].zero_()
        else:
            self._ensure(len(self.seq_in_slot), next_len)
        return slot

    @torch.inference_mode()
    def ensure_length(self, next_len: int) -> None:
        """Room for ``next_len`` tokens in every slot held (what :meth:`assign` does for a sequence it already
        placed, once for a whole step's batch)."""
        self._ensure(len(self.seq_in_slot), next_len)

    @torch.inference_mode()
    def release(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is None:
            return
        self.with_drops.discard(seq_id)
        last = len(self.seq_in_slot) - 1
        moved = self.seq_in_slot.pop()
        if slot != last:
            for t in self.k + self.v + (self.bias or []):
                t[slot] = t[last]
            self.seq_in_slot[slot] = moved
            self.slot_of[moved] = slot

    def has_drops(self, seq_ids: list[int]) -> bool:
        """Did any of these sequences have tokens dropped (so :meth:`layer_masks` has masks to give)?"""
        return self.bias is not None and not self.with_drops.isdisjoint(seq_ids)

    def layer_masks(self, seq_ids: list[int], slots: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor] | None:
        """Per-layer decode masks (``mask`` [B, 1, 1, L] plus each slot's bias row) when a sequence of the batch
        had tokens dropped; None otherwise (every layer uses ``mask``)."""
        if not self.has_drops(seq_ids):
            return None
        b, n = mask.shape[0], mask.shape[-1]
        return [mask + bias[slots, :n].view(b, 1, 1, n) for bias in self.bias]

    @property
    def nbytes(self) -> int:
        """Bytes allocated now: every layer's key and value rows, and the bias rows once a slot had drops."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v + (self.bias or []))

    @property
    def num_active(self) -> int:
        return len(self.seq_in_slot)
