"""Request placement: pure functions over worker load snapshots.

Prefill: fewest outstanding prefill tokens, ties broken toward the worker that last saw the same prompt prefix
(prefix-cache affinity). Decode: most free KV blocks among those that can hold the request.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkerLoad:
    worker_id: str
    outstanding_tokens: int = 0  # prefill: prompt tokens queued or running
    free_blocks: int = 0  # decode: KV blocks free or evictable
    alive: bool = True


def pick_prefill(loads: list[WorkerLoad], *, affinity: str | None = None, exclude: frozenset[str] = frozenset()
                 ) -> WorkerLoad | None:
    """The live prefill worker with the fewest outstanding tokens (``affinity`` wins ties)."""
    live = [w for w in loads if w.alive and w.worker_id not in exclude]
    if not live:
        return None
    return min(live, key=lambda w: (w.outstanding_tokens, w.worker_id != affinity, w.worker_id))


def pick_decode(loads: list[WorkerLoad], blocks_needed: int, *, exclude: frozenset[str] = frozenset()
                ) -> WorkerLoad | None:
    """The live decode worker with the most free blocks, if any can hold ``blocks_needed``."""
    live = [w for w in loads if w.alive and w.worker_id not in exclude and w.free_blocks >= blocks_needed]
    if not live:
        return None
    return max(live, key=lambda w: (w.free_blocks, w.worker_id))
