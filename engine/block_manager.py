"""The KV block pool's bookkeeping: allocation, reference counts, prefix caching, eviction.

Every block is in exactly one of three states:

* **in use** — ``ref_count > 0``; listed in the block tables of that many running sequences;
* **cached** — ``ref_count == 0`` with a hash; its KV is valid and a later prompt with the same prefix reuses it;
* **free** — ``ref_count == 0`` without a hash.

Blocks with ``ref_count == 0`` sit in one LRU queue: free blocks at the front, cached ones appended when released, so
allocation takes never-cached blocks first and then evicts the least recently used cached block. A block's hash is
registered only once its KV has been computed, so a prefix hit never reads a block still being written.
An ``n > 1`` request's choices share its prompt's full blocks (:meth:`fork`: one reference per choice) and each
copies the partial last block, the first one they write differently (copy-on-write, done when the choice is made,
since every choice writes it in its very next step).
Check-then-act: the scheduler asks :meth:`can_allocate` before :meth:`allocate_prefix` / :meth:`append_slots`.

Hybrid models (GDN layers) also need a per-sequence state slot (:class:`engine.state_cache.StateSlots`, given with
``num_state_slots``): :meth:`can_allocate` and :meth:`append_slots` grant a sequence's first blocks only together
with a slot, and :meth:`free` releases both, so one admission rule covers both kinds of cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine.sequence import Sequence
from engine.state_cache import StateSlots


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0, on_evict: Callable[[bytes], None] | None = None) -> None:
        assert num_blocks > 0 and block_size > 0
        self.state_slots = StateSlots(num_state_slots) if num_state_slots else None
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.unreferenced: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        # called with the hash of each cached block evicted (reused for new KV): a prefix cache's owner may tell
        # others what it no longer holds (the prefill worker tells the front-end's router; engine.hooks.EngineHooks)
        self.on_evict = on_evict

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or evictable cached)."""
        return len(self.unreferenced)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq`` (at least one token is always left to compute)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        hits: list[int] = []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for i in range(max_blocks):
            bid = self.hash_to_block.get(seq.block_hash(i))
            if bid is None:
                break
            hits.append(bid)
        return hits

    def can_allocate(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        """Whether ``seq`` (no blocks yet) can take ``hits`` and blocks for ``num_new_tokens`` more tokens."""
        hits_unreferenced = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        total = -(-(len(hits) * self.block_size + num_new_tokens) // self.block_size)
        return self.num_free_blocks - hits_unreferenced >= total - len(hits) and self._has_state_slot(seq)

    def _has_state_slot(self, seq: Sequence) -> bool:
        """Whether ``seq`` holds or can take a state slot (always, for models without state)."""
        return self.state_slots is None or seq.state_slot is not None or self.state_slots.num_free > 0

    def allocate_prefix(self, seq: Sequence, hits: list[int]) -> None:
        assert not seq.block_table and seq.num_computed_tokens == 0
        for bid in hits:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.unreferenced[bid]
            block.ref_count += 1
            seq.block_table.append(bid)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow ``seq``'s block table to hold ``num_new_tokens`` more tokens; False (nothing changed) if the pool
        is short."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.num_free_blocks or not self._has_state_slot(seq):
            return False
        if self.state_slots is not None and seq.state_slot is None:
            seq.state_slot = self.state_slots.take()
        for _ in range(need):
            self._take_one(seq)
        return True

    def can_fork(self, parent: Sequence, num_tokens: int) -> bool:
        """Whether :meth:`fork` of ``parent``'s first ``num_tokens`` has the block it may need (and, hybrid models,
        a state slot for the child)."""
        slot = self.state_slots is None or self.state_slots.num_free > 0
        return slot and (num_tokens % self.block_size == 0 or self.num_free_blocks >= 1)

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> tuple[int, int] | None:
        """Give ``child`` (no blocks yet) ``parent``'s KV for its first ``num_tokens`` tokens (computed): the full
        blocks are shared (one more reference each; nobody writes a full block again), the partial last block --
        the first one the two write differently -- is copied into a new block of the child's. Returns ``(src,
        dst)`` for the caller to copy the KV of (the pool's contents are the runner's), or None when
        ``num_tokens`` fills whole blocks. Ask :meth:`can_fork` first."""
        assert not child.block_table and num_tokens <= len(parent.block_table) * self.block_size
        full = num_tokens // self.block_size
        for bid in parent.block_table[:full]:
            self.blocks[bid].ref_count += 1
            child.block_table.append(bid)
        child.num_computed_tokens = num_tokens
        child.num_registered_blocks = min(parent.num_registered_blocks, full)
        if self.state_slots is not None:  # the caller copies the parent's state into it (ModelRunner.copy_state)
            child.state_slot = self.state_slots.take()
        if num_tokens == full * self.block_size:
            return None
        ok = self._take_one(child)
        assert ok, "can_fork promised the block"
        return parent.block_table[full], child.block_table[-1]

    def _take_one(self, seq: Sequence) -> bool:
        """Append one block to ``seq``'s table (False, nothing changed, when none is free)."""
        if not self.unreferenced:
            return False
        bid, _ = self.unreferenced.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == bid:
                del self.hash_to_block[block.hash]
                if self.on_evict is not None:
                    self.on_evict(block.hash)
            block.hash = None
        block.ref_count = 1
        seq.block_table.append(bid)
        return True

    def register_computed(self, seq: Sequence) -> None:
        """Publish the hashes of ``seq``'s blocks whose KV is now fully computed (never for approximate KV)."""
        if not self.enable_prefix_caching or seq.kv_lossy:
            return
        full = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_registered_blocks, full):
            h = seq.block_hash(i)
            bid = seq.block_table[i]
            if h not in self.hash_to_block and self.blocks[bid].hash is None:
                self.hash_to_block[h] = bid
                self.blocks[bid].hash = h
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (tail first, so a prefix's head stays cached longest)."""
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            assert block.ref_count > 0, f"double free of block {bid}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.unreferenced[bid] = None
                if block.hash is None:
                    self.unreferenced.move_to_end(bid, last=False)
        seq.block_table = []
        if seq.state_slot is not None:
            assert self.state_slots is not None
            self.state_slots.release(seq.state_slot)
            seq.state_slot = None
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def check_no_leaks(self) -> None:
        """Assert every block is free or cached with zero references (call when no request is live)."""
        held = [b.block_id for b in self.blocks if b.ref_count != 0]
        assert not held, f"{len(held)} KV block(s) still referenced: {held[:8]}"
        assert len(self.unreferenced) == len(self.blocks), "unreferenced queue out of sync"
        if self.state_slots is not None:
            self.state_slots.check_no_leaks()
