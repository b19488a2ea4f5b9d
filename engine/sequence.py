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
from typing import Any

import numpy as np
import torch

from engine.outputs import RequestMetrics, TokenLogprobs
from engine.penalties import PenaltyState
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
    it recompute the prompt), so it never pays for resizing and normalising the images. ``pixel_values`` is None
    where the process holds no image data at all (a decode worker given a processed prompt): such a prompt cannot
    be recomputed there (:attr:`can_encode`), and the engine drops it on preemption (``LLMEngine.cannot_recompute``).

    Qwen3-VL images (``grid_thw`` set) each have their own token count (``token_counts``); ``pixel_values`` are then
    every image's patches concatenated ``[sum t*h*w, C*T*p*p]``, ``mrope`` holds the prompt's 3-D M-RoPE positions
    and ``mrope_delta`` the offset of generated positions (:mod:`engine.mrope`); ``deepstack`` the DeepStack
    features of the image tokens ``[levels, N tokens, hidden]``, computed with ``features``."""

    pixel_values: torch.Tensor | Callable[[], torch.Tensor] | None  # [N, C, H, W] / [patches, dim], what computes
    # them, or None (no image data in this process)
    image_hashes: list[bytes]
    positions: np.ndarray  # [sum token_counts] int64, sorted
    tokens_per_image: int  # LLaVA: every image's count; Qwen3-VL: 0 (see token_counts)
    features: torch.Tensor | None = None  # [sum token_counts, hidden]
    token_counts: list[int] | None = None  # placeholder tokens per image (default: tokens_per_image each)
    grid_thw: np.ndarray | None = None  # [N, 3] int64 patch grid per image (Qwen3-VL)
    mrope: np.ndarray | None = None  # [3, prompt length] int64 M-RoPE positions (Qwen3-VL)
    mrope_delta: int = 0
    deepstack: torch.Tensor | None = None  # [levels, sum token_counts, hidden]

    def __post_init__(self) -> None:
        counts = self.token_counts or [self.tokens_per_image] * len(self.image_hashes)
        self.token_counts = list(counts)
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # image i: rows [s_i, s_i+1)

    @property
    def can_encode(self) -> bool:
        """Whether this process can (re)compute the prompt: features already computed, or pixels to compute them."""
        return self.features is not None or self.pixel_values is not None

    def pixels(self) -> torch.Tensor:
        if self.pixel_values is None:
            raise RuntimeError("this prompt's images carry no pixels here (a decode worker's processed prompt)")
        if callable(self.pixel_values):
            self.pixel_values = self.pixel_values()
        return self.pixel_values

    def image_rows(self, i: int) -> slice:
        """Rows of ``positions`` / ``features`` that belong to image ``i``."""
        return slice(int(self._starts[i]), int(self._starts[i + 1]))

    def patch_rows(self, i: int) -> slice:
        """Qwen3-VL: rows of the concatenated patches that belong to image ``i``."""
        assert self.grid_thw is not None
        per = self.grid_thw.prod(axis=1)
        start = int(per[:i].sum())
        return slice(start, start + int(per[i]))

    def block_extra_key(self, start: int, end: int) -> bytes:
        """Hash material for image tokens within prompt positions [start, end)."""
        lo, hi = np.searchsorted(self.positions, [start, end])
        if lo == hi:
            return b""
        first = int(np.searchsorted(self._starts, lo, side="right")) - 1
        last = int(np.searchsorted(self._starts, hi - 1, side="right")) - 1
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
    coded: Any = None  # engine.coded_kv.CodedKV: its image blocks kept coded in pages (decode side), else None
    state_slot: int | None = None  # hybrid models: the GDN state slot it holds (engine.state_cache), with its blocks
    # hybrid prefix caching (engine.state_cache.Snapshots): the snapshot its prefix hit restores before its next
    # chunk runs, and the snapshots its next chunk writes, as (prompt position, snapshot slot)
    state_restore: int | None = None
    snapshot_writes: list[tuple[int, int]] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))
    logprobs: list[TokenLogprobs] | None = None  # per output token, when params.logprobs is set
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token (None for the first), when asked
    penalty: PenaltyState | None = None  # penalties' token counts (engine.penalties), made on first use
    logits_processor: Any = None  # engine.sampler.LogitsProcessor of this sequence, or None
    # n > 1: this sequence is choice ``choice`` of its request; ``group`` (one list shared by every choice, choice 0
    # first) holds them all. ``choice_generators``: choice 0's sampler state for each choice's first token.
    choice: int = 0
    group: list[Sequence] = field(default_factory=list, compare=False, repr=False)
    choice_generators: list[torch.Generator | None] | None = None
    # a prefill worker's n > 1 request (EngineHooks.fork_choices False): choices 1..n-1's first (token, logprobs,
    # generator), for the hand-off
    pending_choices: list[tuple[int, TokenLogprobs | None, torch.Generator | None]] | None = None
    _block_hashes: list[bytes] = field(default_factory=list)
    _prompt_ids: list[int] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.group:
            self.group.append(self)

    @property
    def group_finished(self) -> bool:
        """Every choice of the request is finished (and all ``n`` exist)."""
        return len(self.group) >= self.params.n and all(q.finish_reason is not None for q in self.group)

    @property
    def needs_choices(self) -> bool:
        """Choice 0 of an ``n > 1`` request about to sample its first token: it samples one per choice."""
        return self.params.n > 1 and self.choice == 0 and len(self.group) == 1 and self.num_output_tokens == 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's ids, copied once (every output of the request shares the list: readers must not edit it)."""
        if self._prompt_ids is None or len(self._prompt_ids) != self.num_prompt_tokens:
            self._prompt_ids = self.token_ids[: self.num_prompt_tokens]
        return self._prompt_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def sample_generators(self, k: int) -> list[torch.Generator | None]:
        """The generators of this row's ``k`` samples: its own, or (first token of n > 1) each choice's."""
        if k == 1:
            return [self.generator]
        return list(self.choice_generators) if self.choice_generators is not None else [None] * k

    def new_choice(self, seq_id: int, generator: torch.Generator | None) -> Sequence:
        """The next choice of this (choice 0, first token appended) request: the same prompt and params, no blocks,
        no output yet; joined to :attr:`group`."""
        n = self.num_prompt_tokens
        child = Sequence(seq_id=seq_id, request_id=self.request_id, token_ids=self.token_ids[:n], num_prompt_tokens=n,
                         params=self.params, block_size=self.block_size, prompt=self.prompt, mm=self.mm,
                         metrics=RequestMetrics(self.metrics.arrival_time, self.metrics.first_scheduled_time),
                         logits=[] if self.logits is not None else None,
                         logprobs=[] if self.logprobs is not None else None, choice=len(self.group),
                         group=self.group, generator=generator, kv_lossy=self.kv_lossy, kv_dropped=self.kv_dropped,
                         _block_hashes=self._block_hashes[: n // self.block_size])
        self.group.append(child)
        return child

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
