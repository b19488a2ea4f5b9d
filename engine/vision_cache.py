"""Encoded images kept for reuse, by content hash, bounded in bytes and entries (least recently used first out).

An entry is what the vision tower made of one image: its features ``[rows, hidden]`` and, for Qwen3-VL towers, its
DeepStack levels ``[levels, rows, hidden]``. Its size grows with the image (a native-resolution tower gives a 1024^2
image 1,024 rows), so the cache is bounded by bytes, not only by count: ``capacity_bytes`` (``vision_cache_mb``)
and ``max_entries`` (``vision_cache_size``). Entries own their memory: a slice of one tower call's output is copied
out, so a cached image never keeps the whole batch's output alive. An image larger than the whole capacity is used
by the request that brought it and not cached.

Worked example: Qwen3-VL-30B-A3B features are 2,048 wide with 3 DeepStack levels, float16: 16 KiB a row, so a
1024^2 image (1,024 rows) is 16 MiB and the default 102.4 MiB (a tenth of ``kv_cache_memory_gb`` = 1 GiB) holds 6.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisionEntry:
    features: torch.Tensor  # [rows, hidden]
    deepstack: torch.Tensor | None  # [levels, rows, hidden] (Qwen3-VL) or None

    @property
    def nbytes(self) -> int:
        extra = 0 if self.deepstack is None else self.deepstack.numel() * self.deepstack.element_size()
        return self.features.numel() * self.features.element_size() + extra


class VisionCache:
    def __init__(self, capacity_bytes: int, max_entries: int) -> None:
        if capacity_bytes < 0 or max_entries < 0:
            raise ValueError(f"vision cache bounds must be >= 0, got {capacity_bytes} bytes, {max_entries} entries")
        self.capacity_bytes, self.max_entries = capacity_bytes, max_entries
        self._entries: OrderedDict[bytes, VisionEntry] = OrderedDict()
        self.nbytes = 0  # bytes held now
        self.evictions = 0  # entries pushed out to make room (not counting clear())

    def __contains__(self, h: bytes) -> bool:
        return h in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, h: bytes) -> VisionEntry | None:
        """The entry for image hash ``h`` (now the most recently used), or None."""
        entry = self._entries.get(h)
        if entry is not None:
            self._entries.move_to_end(h)
        return entry

    def put(self, h: bytes, features: torch.Tensor, deepstack: torch.Tensor | None = None) -> VisionEntry:
        """Keep a copy of one image's encoding (evicting the least recently used entries to make room) and return
        it; an entry over the whole capacity is returned uncached."""
        entry = VisionEntry(features.clone(), None if deepstack is None else deepstack.clone())
        old = self._entries.pop(h, None)
        if old is not None:
            self.nbytes -= old.nbytes
        if entry.nbytes > self.capacity_bytes or self.max_entries == 0:
            return entry
        while self._entries and (self.nbytes + entry.nbytes > self.capacity_bytes
                                 or len(self._entries) >= self.max_entries):
            _, gone = self._entries.popitem(last=False)
            self.nbytes -= gone.nbytes
            self.evictions += 1
        self._entries[h] = entry
        self.nbytes += entry.nbytes
        return entry

    def clear(self) -> int:
        """Drop every entry; returns how many there were."""
        n = len(self._entries)
        self._entries.clear()
        self.nbytes = 0
        return n
