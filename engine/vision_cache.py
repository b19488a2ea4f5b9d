"""Encoded images kept for reuse, by content hash, bounded in bytes and entries (least recently used first out).

An entry is what the vision tower made of one image: its features ``[rows, hidden]`` and, for Qwen3-VL towers, its
DeepStack levels ``[levels, rows, hidden]``. Its size grows with the image (a native-resolution tower gives a 1024^2
image 1,024 rows), so the cache is bounded by bytes, not only by count: ``capacity_bytes`` (``vision_cache_mb``)
and ``max_entries`` (``vision_cache_size``). An image larger than the whole capacity is used by the request that
brought it and not kept.

With a :class:`BlockStore` (an engine's: its KV pool) the entries live in KV blocks lent by the block manager
(:meth:`engine.block_manager.BlockManager.lend`), so cached features and KV share one budget: the cache grows into
blocks KV is not using, up to ``capacity_bytes`` (the floor KV always keeps is the rest of the pool), and gives its
least recently used entries back as soon as KV needs the blocks (:meth:`VisionCache.reclaim`). Without one (a bare
cache) entries are tensors of their own. Either way an entry owns its memory: a slice of one tower call's output is
copied out, so a cached image never keeps the whole batch's output alive.

Worked example: Qwen3-VL-30B-A3B features are 2,048 wide with 3 DeepStack levels, bfloat16: 16 KiB a row, so a
1024^2 image (1,024 rows) is 16 MiB; its KV is 96 KiB a token (48 layers x 2 x 4 heads x 128 x 2 bytes), so with
16-token blocks (1.5 MiB) the image's features take 11 blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import torch


class BlockStore(Protocol):
    block_bytes: int  # bytes one block holds

    def lend(self, n: int) -> list[int] | None: ...

    def give_back(self, blocks: list[int]) -> None: ...

    def write(self, blocks: list[int], data: torch.Tensor) -> None:
        """Store ``data`` (uint8, flat, at most ``len(blocks) * block_bytes``) across ``blocks`` in order."""

    def read(self, blocks: list[int], nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` stored across ``blocks`` (uint8, flat, a copy)."""


@dataclass(frozen=True)
class VisionEntry:
    features: torch.Tensor  # [rows, hidden]
    deepstack: torch.Tensor | None  # [levels, rows, hidden] (Qwen3-VL) or None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return [self.features] if self.deepstack is None else [self.features, self.deepstack]


@dataclass
class _Stored:
    """An entry kept in lent blocks: where, and how to rebuild its tensors from the bytes."""

    blocks: list[int]
    nbytes: int
    shapes: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)


class VisionCache:
    def __init__(self, capacity_bytes: int, max_entries: int, store: BlockStore | None = None) -> None:
        if capacity_bytes < 0 or max_entries < 0:
            raise ValueError(f"vision cache bounds must be >= 0, got {capacity_bytes} bytes, {max_entries} entries")
        self.capacity_bytes, self.max_entries = capacity_bytes, max_entries
        self.store = store
        self._entries: OrderedDict[bytes, VisionEntry | _Stored] = OrderedDict()
        self.nbytes = 0  # bytes held now (whole blocks, with a store)
        self.evictions = 0  # entries pushed out to make room or given back to KV (not counting clear())

    def __contains__(self, h: bytes) -> bool:
        return h in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, h: bytes) -> VisionEntry | None:
        """The entry for image hash ``h`` (now the most recently used), or None."""
        entry = self._entries.get(h)
        if entry is None:
            return None
        self._entries.move_to_end(h)
        if isinstance(entry, VisionEntry):
            return entry
        data, at, out = self.store.read(entry.blocks, entry.nbytes), 0, []
        for shape, dtype in entry.shapes:
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            out.append(data[at:at + n].view(dtype).view(shape))
            at += n
        return VisionEntry(out[0], out[1] if len(out) > 1 else None)

    def put(self, h: bytes, features: torch.Tensor, deepstack: torch.Tensor | None = None) -> VisionEntry:
        """Keep a copy of one image's encoding (evicting the least recently used entries to make room) and return
        it; an entry over the whole capacity, or one the pool has no blocks for, is returned uncached."""
        entry = VisionEntry(features.clone(), None if deepstack is None else deepstack.clone())
        self._drop(h)
        held = self._held_bytes(entry.nbytes)
        if held > self.capacity_bytes or self.max_entries == 0:
            return entry
        while self._entries and (self.nbytes + held > self.capacity_bytes or len(self._entries) >= self.max_entries):
            self._evict_oldest()
        if self.store is None:
            self._entries[h] = entry
        else:
            n = held // self.store.block_bytes
            blocks = self.store.lend(n)
            while blocks is None and self._entries:  # the pool is full: our own oldest entries make room
                self._evict_oldest()
                blocks = self.store.lend(n)
            if blocks is None:
                return entry
            self.store.write(blocks, torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in entry.tensors()]))
            self._entries[h] = _Stored(blocks, entry.nbytes, [(tuple(t.shape), t.dtype) for t in entry.tensors()])
        self.nbytes += held
        return entry

    def reclaim(self) -> bool:
        """Give the least recently used entry's blocks back to the pool (KV needs them); False when none is held."""
        if not self._entries:
            return False
        self._evict_oldest()
        return True

    def clear(self) -> int:
        """Drop every entry; returns how many there were."""
        n = len(self._entries)
        for h in list(self._entries):
            self._drop(h)
        return n

    def _held_bytes(self, nbytes: int) -> int:
        if self.store is None:
            return nbytes
        return -(-nbytes // self.store.block_bytes) * self.store.block_bytes

    def _evict_oldest(self) -> None:
        self._drop(next(iter(self._entries)))
        self.evictions += 1

    def _drop(self, h: bytes) -> None:
        entry = self._entries.pop(h, None)
        if entry is None:
            return
        self.nbytes -= self._held_bytes(entry.nbytes)
        if isinstance(entry, _Stored):
            self.store.give_back(entry.blocks)


class PoolStore:
    """:class:`BlockStore` over an engine's KV pool (per KV layer, ``k`` and ``v`` of ``[num_blocks, block_size,
    kv_heads, head_dim]``): a block's bytes are its slices of every layer's K and V, in layer order, and its blocks
    come from the block manager (``lend`` / ``give_back``)."""

    def __init__(self, pool: list[tuple[torch.Tensor, torch.Tensor]], lender) -> None:
        self.pool, self.lender = pool, lender
        k = pool[0][0]
        self.block_bytes = 2 * len(pool) * k[0].numel() * k.element_size()

    def lend(self, n: int) -> list[int] | None:
        return self.lender.lend(n)

    def give_back(self, blocks: list[int]) -> None:
        self.lender.give_back(blocks)

    def _slices(self, blocks: list[int]):
        for b in blocks:
            for k, v in self.pool:
                yield k[b].view(-1).view(torch.uint8)
                yield v[b].view(-1).view(torch.uint8)

    def write(self, blocks: list[int], data: torch.Tensor) -> None:
        at = 0
        for dst in self._slices(blocks):
            n = min(dst.numel(), data.numel() - at)
            if n <= 0:
                return
            dst[:n].copy_(data[at:at + n])
            at += n

    def read(self, blocks: list[int], nbytes: int) -> torch.Tensor:
        parts, left = [], nbytes
        for src in self._slices(blocks):
            if left <= 0:
                break
            parts.append(src[:left])
            left -= parts[-1].numel()
        return torch.cat(parts)
