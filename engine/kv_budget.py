"""How big an engine's paged KV pool is, and what its caches hold now.

:func:`plan_pool` turns the serving knobs and the model's per-token KV size into ``(max_model_len, num_kv_blocks)``.
With ``kv_cache_memory_gb`` (no ``num_kv_blocks``) the budget covers everything attention reads: the decode
mirror's starting allocation (:func:`engine.decode_mirror.reserved_bytes`, all of it when ``decode_mirror_tokens``
reserves it) and hybrid models' GDN state slots come off first, the pool gets the rest, capped at ``max_num_seqs``
full-length sequences and floored at one (a warning when that floor overruns the budget).

Worked example: 1 GiB, 16-token blocks, 64 KiB of KV per token (1 MiB per block), a 4096-token context, 8
sequences, no mirror reservation (8 slots of 256 tokens: 128 MiB), no state: ``(1024 - 128) // 1 = 896`` blocks by
memory, under the cap of ``8 * 256 = 2048`` -> 896 blocks, ``max_model_len`` 4096.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.decode_mirror import reserved_bytes
from engine.errors import CheckpointError
from engine.text_config import TextConfig

logger = logging.getLogger(__name__)

SNAPSHOT_SHARE = 0.1  # of kv_cache_memory_gb, for hybrid models' state snapshots unless state_snapshots is set


@dataclass(frozen=True)
class KVMemory:
    """Cache bytes held by one engine, per kind. ``budget_bytes``: ``kv_cache_memory_gb`` in bytes (None when
    ``num_kv_blocks`` fixed the pool); the mirror's growth past its starting allocation can take ``total_bytes`` over
    it. ``state_bytes``: hybrid models' GDN state slots (0 otherwise). ``vision_cache_bytes``: encoded images kept
    for reuse (:mod:`engine.vision_cache`), in blocks the pool lends: part of ``pool_bytes``, not more. The pool's
    regions now: ``workspace_bytes`` (the vision tower's reserve, beside the pool), ``text_kv_bytes`` (blocks sequences hold, plain), ``visual_kv_bytes`` (coded visual pages,
    :mod:`engine.coded_kv`); with ``vision_cache_bytes`` the elastic region, which never takes ``floor_bytes``."""

    pool_bytes: int
    mirror_bytes: int
    budget_bytes: int | None
    state_bytes: int = 0
    vision_cache_bytes: int = 0
    text_kv_bytes: int = 0
    visual_kv_bytes: int = 0
    floor_bytes: int = 0
    workspace_bytes: int = 0  # kept for the vision tower (encoder_workspace_mb), off the budget before the pool

    @property
    def total_bytes(self) -> int:
        return self.pool_bytes + self.mirror_bytes + self.state_bytes


@dataclass(frozen=True)
class PoolPlan:
    max_model_len: int  # tokens one sequence may hold (prompt plus output), at most what the pool holds
    num_blocks: int
    budget_bytes: int | None  # kv_cache_memory_gb in bytes; None when num_kv_blocks fixed the pool
    mirror_tokens: int | None  # decode mirror tokens reserved per sequence (decode_mirror_tokens, capped); None: grown


def plan_pool(c: EngineConfig, t: TextConfig, dtype: torch.dtype, num_state_slots: int,
              workspace: int = 0) -> PoolPlan:
    """Size the KV pool of an engine with knobs ``c`` for text model ``t`` in ``dtype`` with ``num_state_slots`` GDN
    state slots (0 unless hybrid) and ``workspace`` bytes kept for the vision tower (engine.workspace).
    Raises :class:`CheckpointError` when ``max_model_len`` exceeds the model's limit."""
    limit = t.max_position_embeddings if t.sliding_window is None else min(t.max_position_embeddings, t.sliding_window)
    if c.max_model_len is not None and c.max_model_len > limit:
        raise CheckpointError(f"max_model_len {c.max_model_len} exceeds the model's limit of {limit} positions")
    max_len = c.max_model_len or min(limit, 4096)
    mirror_tokens = min(c.decode_mirror_tokens, max_len) if c.decode_mirror_tokens else None
    per_token = t.kv_bytes_per_token(dtype)
    state = num_state_slots * t.state_bytes_per_seq(dtype)
    per_block = per_token * c.block_size
    blocks_per_seq = -(-max_len // c.block_size)
    budget: int | None = None
    if c.num_kv_blocks is not None:
        num_blocks = c.num_kv_blocks
    else:
        budget = int(c.kv_cache_memory_gb * 2**30)
        mirror = reserved_bytes(c.max_num_seqs, per_token, mirror_tokens)
        state += workspace  # both off the budget beside the mirror, before the pool
        by_memory = max(0, budget - mirror - state) // per_block
        # coded image KV (visual_kv_cache int8) admits by the bytes a prompt will be stored at: no floor of one
        # full-length plain sequence (which could put the pool far over its budget), one block at least
        floor = blocks_per_seq if c.visual_kv_cache == "plain" else 1
        num_blocks = max(floor, min(by_memory, blocks_per_seq * c.max_num_seqs))
        if num_blocks * per_block + mirror + state > budget:
            logger.warning("kv_cache_memory_gb=%g holds %d KV blocks after the decode mirror's %.1f MiB (and any "
                           "state slots and tower workspace); "
                           "allocating %d (one %d-token sequence): %.1f MiB over budget", c.kv_cache_memory_gb,
                           by_memory, mirror / 2**20, num_blocks, max_len,
                           (num_blocks * per_block + mirror + state - budget) / 2**20)
    # coded image KV (engine.coded_kv) holds more tokens than the plain blocks: admission checks the bytes instead
    held = num_blocks * c.block_size if c.visual_kv_cache == "plain" else max_len
    return PoolPlan(min(max_len, held), num_blocks, budget, mirror_tokens)


def state_snapshots(c: EngineConfig, t: TextConfig, dtype: torch.dtype) -> int:
    """How many GDN state snapshots a hybrid model's prefix cache keeps (``EngineConfig.state_snapshots``; 0 with
    prefix caching off): the configured number, else a tenth of ``kv_cache_memory_gb`` in snapshots (one is a
    sequence's whole state), at least 1 and at most ``2 * max_num_seqs``; ``max_num_seqs`` when ``num_kv_blocks``
    fixes the pool."""
    if not c.enable_prefix_caching:
        return 0
    if c.state_snapshots is not None:
        return c.state_snapshots
    if c.num_kv_blocks is not None:
        return c.max_num_seqs
    fit = int(c.kv_cache_memory_gb * 2**30 * SNAPSHOT_SHARE) // max(1, t.state_bytes_per_seq(dtype))
    return max(1, min(2 * c.max_num_seqs, fit))
