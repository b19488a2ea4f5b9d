"""A request's token sequence as the scheduler and block manager see it.

A sequence knows its tokens, how many of them have KV in the pool (``num_computed_tokens``), its block table, and
the hash of each full block (a chain: block i's hash covers block i-1's hash, its token ids and the content hashes of
any images whose placeholder tokens it holds). It knows nothing about the pool itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import torch

from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams


class SequenceStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    RECEIVING = 3  # decode side of a disaggregated request: blocks reserved, KV arriving from a prefill worker


@dataclass
class MultiModalInput:
    """Images of one prompt. ``positions`` are the prompt positions of the placeholder tokens, in order; row r of
    ``features`` (computed once, on first schedule) replaces the embedding at ``positions[r]``.

    ``pixel_values`` may be given as a function that computes them: :meth:`pixels` calls it once, when the vision
    tower first needs them. A worker that receives a prompt's KV from another never does (unless a preemption makes
    it recompute the prompt), so it never pays for resizing and normalising the images."""

    pixel_values: torch.Tensor | Callable[[], torch.Tensor]  # [N, C, H, W], or what computes them
    image_hashes: list[bytes]
    positions: np.ndarray  # [N * tokens_per_image] int64, sorted
    tokens_per_image: int
    features: torch.Tensor | None = None  # [N * tokens_per_image, hidden]

    def pixels(self) -> torch.Tensor:
        if callable(self.pixel_values):
            self.pixel_values = self.pixel_values()
        return self.pixel_values

    def block_extra_key(self, start: int, end: int) -> bytes:
        """Hash material for image tokens within prompt positions [start, end)."""
        lo, hi = np.searchsorted(self.positions, [start, end])
        if lo == hi:
            return b""
        first, last = int(lo) // self.tokens_per_image, (int(hi) - 1) // self.tokens_per_image
        return b"".join(self.image_hashes[first:last + 1]) + int(lo).to_bytes(8, "little")


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_size: int
    prompt: str | None = None
    mm: MultiModalInput | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_registered_blocks: int = 0
    finish_reason: str | None = None
    stop_reason: int | None = None
    generator: torch.Generator | None = None
    logits: list[torch.Tensor] | None = None
    expert_hist: np.ndarray | None = None  # [num_layers, num_experts] routing choices, when the runner tracks them
    kv_lossy: bool = False  # its prompt KV arrived compressed: approximate, never published to the prefix cache
    kv_dropped: dict[int, torch.Tensor] | None = None  # layer -> prompt positions dropped on the wire (decode side)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))
    _block_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block_hash(self, i: int) -> bytes:
        """Hash of full block ``i`` (requires ``(i + 1) * block_size <= num_tokens``), computed once."""
        while len(self._block_hashes) <= i:
            j = len(self._block_hashes)
            s, e = j * self.block_size, (j + 1) * self.block_size
            assert e <= self.num_tokens, "only full blocks have a hash"
            h = hashlib.blake2b(digest_size=16)
            h.update(self._block_hashes[j - 1] if j else b"root")
            h.update(np.asarray(self.token_ids[s:e], dtype=np.int64).tobytes())
            if self.mm is not None and s < self.num_prompt_tokens:
                h.update(self.mm.block_extra_key(s, e))
            self._block_hashes.append(h.digest())
        return self._block_hashes[i]
