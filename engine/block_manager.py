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

Blocks can also be **lent** to the vision cache (:meth:`lend`, :mod:`engine.vision_cache`): an encoded image's
features are stored in the pool's own memory, so KV and cached features share one budget. Lent blocks count as
free: when KV needs a block and none is free, the lender's ``reclaim`` hands back its least recently used entry's
blocks first, before a prefix-cached block is evicted (cached features are cheaper to lose than prefix KV: one
tower call against a prefill).

Blocks can also be lent as **pages** of coded visual KV (:meth:`lend_pages`, :mod:`engine.coded_kv`): a decode
engine keeps a received prompt's image blocks coded in them, and the sequence's block table holds ``-1`` at those
blocks. Pages are not reclaimable (live KV), are shared by an ``n > 1`` request's choices (the
:class:`~engine.coded_kv.CodedKV` counts its holders) and go back when the last holder is freed. Lent blocks and
pages together -- the elastic region -- never take the pool's last ``visual_floor`` blocks (the static text region).

Hybrid models (GDN layers) also need a per-sequence state slot (:class:`engine.state_cache.StateSlots`, given with
``num_state_slots``): :meth:`can_allocate` and :meth:`append_slots` grant a sequence's first blocks only together
with a slot, and :meth:`free` releases both, so one admission rule covers both kinds of cache. Their prefix cache
(``snapshots``, :class:`engine.state_cache.Snapshots`) also needs the GDN state after the hit's last block: a hit is
cut back to the last block that has a snapshot; :meth:`plan_snapshots` reserves the snapshots a prompt chunk writes
(policy: :func:`snapshot_points`), :meth:`register_computed` files them with their blocks, and evicting a block drops
its snapshot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine.coded_kv import CodedKV
from engine.sequence import Sequence
from engine.state_cache import Snapshots, StateSlots


def snapshot_points(seq: Sequence, start: int, end: int, block_size: int, every_blocks: int) -> list[int]:
    """Prompt positions in ``(start, end]`` after which a hybrid model keeps the GDN state (block boundaries): the
    end of the prompt's last block a repeat of it can hit (all full blocks but the one holding the last token), the
    end of the last full block of each image, and every ``every_blocks`` blocks (a shared system prompt or history
    followed by different text)."""
    bs = block_size
    last = (seq.num_prompt_tokens - 1) // bs * bs
    points = {b for b in range(every_blocks * bs, last + 1, every_blocks * bs)} if every_blocks > 0 else set()
    points.add(last)
    if seq.mm is not None and seq.mm.positions is not None and len(seq.mm.image_hashes):
        for i in range(len(seq.mm.image_hashes)):
            rows = seq.mm.positions[seq.mm.image_rows(i)]
            if len(rows):
                points.add(min(last, (int(rows.max()) + 1) // bs * bs))
    return sorted(b for b in points if start < b <= min(end, last) and b > 0)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0, on_evict: Callable[[bytes], None] | None = None,
                 num_snapshots: int = 0, snapshot_every_blocks: int = 0,
                 on_snapshot_drop: Callable[[bytes], None] | None = None, visual_floor: int = 0) -> None:
        """``visual_floor``: blocks lending (cached features, coded pages) leaves to the plain KV. Hybrid models:
        ``num_state_slots`` sequences' slots, and ``num_snapshots`` snapshot slots after them (the
        state cache's rows ``num_state_slots ..``); without snapshots a hybrid model has no prefix cache."""
        assert num_blocks > 0 and block_size > 0
        self.state_slots = StateSlots(num_state_slots) if num_state_slots else None
        self.snapshots = (Snapshots(num_state_slots, num_snapshots, on_snapshot_drop)
                          if num_state_slots and num_snapshots else None)
        self.snapshot_every_blocks = snapshot_every_blocks
        if num_state_slots and self.snapshots is None:
            enable_prefix_caching = False
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.unreferenced: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        # called with the hash of each cached block evicted (reused for new KV): a prefix cache's owner may tell
        # others what it no longer holds (the prefill worker tells the front-end's router; engine.hooks.EngineHooks)
        self.on_evict = on_evict
        self.num_lent = 0  # blocks lent out (lend), not in unreferenced
        self.num_pages = 0  # blocks lent as coded pages (lend_pages), not in unreferenced either
        self.visual_floor = min(visual_floor, num_blocks)
        # the borrower's: give back at least one lent block (its least recently used entry's, via give_back);
        # False when it holds none
        self.reclaim: Callable[[], bool] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, evictable cached, or lent and reclaimable)."""
        return len(self.unreferenced) + (self.num_lent if self.reclaim is not None else 0)

    def lend(self, n: int) -> list[int] | None:
        """Take ``n`` blocks out for a borrower's own data (free ones first, then the least recently used prefix
        blocks, evicted; never other lent blocks): None, nothing taken, when fewer are at hand or the elastic region
        would take the floor."""
        if n > len(self.unreferenced) or not self._elastic_room(n):
            return None
        out = [self._pop_unreferenced() for _ in range(n)]
        self.num_lent += n
        return out

    def _elastic_room(self, n: int) -> bool:
        return self.num_lent + self.num_pages + n <= self.num_blocks - self.visual_floor

    def lend_pages(self, n: int) -> list[int] | None:
        """Take ``n`` blocks as coded-KV pages (free ones, then cached features given back, then evicted prefix
        blocks): None, nothing taken, when the pool cannot give them now."""
        if not self._elastic_room(n) or n > self.num_free_blocks:
            return None
        out = []
        for _ in range(n):
            self._reclaim_for_one()
            if not self.unreferenced:  # the vision cache could not give back what it counted: undo, nothing taken
                self._free_blocks(reversed(out))
                return None
            out.append(self._pop_unreferenced())
        self.num_pages += n
        return out

    def allocate_received(self, seq: Sequence, coded: CodedKV | None, num_tokens: int, num_pages: int,
                          spare_tokens: int = 0) -> bool:
        """Blocks for a received prompt of ``num_tokens`` (``seq`` holds none yet): plain blocks except at
        ``coded.blocks`` (``-1`` in the table), whose tokens go into ``num_pages`` new pages. False, nothing taken,
        when the pool cannot hold it now, with room left for ``spare_tokens`` more (checked, not taken)."""
        total = -(-num_tokens // self.block_size)
        skip = set() if coded is None else set(coded.blocks.tolist())
        plain = -(-(num_tokens + spare_tokens) // self.block_size) - len(skip)
        if plain + num_pages > self.num_free_blocks or not self._has_state_slot(seq) \
                or (num_pages and not self._elastic_room(num_pages)):
            return False
        if coded is not None:
            pages = self.lend_pages(num_pages)
            if pages is None:
                return False
            coded.pages = pages
            seq.coded = coded
        if self.state_slots is not None and seq.state_slot is None:
            seq.state_slot = self.state_slots.take()
        for i in range(total):
            if i in skip:
                seq.block_table.append(-1)
            elif not self._take_one(seq):  # a count the vision cache could not honour: undo all of it
                self.free(seq)
                return False
        return True

    def give_back(self, blocks: list[int]) -> None:
        """Return lent blocks; they are free again."""
        assert all(b not in self.unreferenced and self.blocks[b].ref_count == 0 for b in blocks), "a block not lent"
        self._free_blocks(blocks)
        self.num_lent -= len(blocks)

    def _free_blocks(self, blocks) -> None:
        """Blocks no sequence holds nor hashes, back at the front of the queue (handed out first)."""
        for bid in blocks:
            self.unreferenced[bid] = None
            self.unreferenced.move_to_end(bid, last=False)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq`` (at least one token is always left to compute)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        hits: list[int] = []
        hashes: list[bytes] = []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for i in range(max_blocks):
            h = seq.block_hash(i)
            bid = self.hash_to_block.get(h)
            if bid is None:
                break
            hits.append(bid)
            hashes.append(h)
        if self.snapshots is not None:  # a hybrid model resumes only where the GDN state was kept
            while hits and self.snapshots.find(hashes[len(hits) - 1]) is None:
                hits.pop()
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
        if hits and self.snapshots is not None:  # the runner copies it into the sequence's slot before its chunk
            slot = self.snapshots.find(seq.block_hash(len(hits) - 1))
            assert slot is not None, "lookup_prefix cut the hit back to a snapshot"
            self.snapshots.pin(slot)
            seq.state_restore = slot

    def plan_snapshots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Reserve the snapshots ``seq``'s next chunk (``num_new_tokens`` from its computed tokens) writes: at
        :func:`snapshot_points` whose block has none yet, as many as there are slots to reserve."""
        if self.snapshots is None or not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return
        start = seq.num_computed_tokens
        for b in snapshot_points(seq, start, start + num_new_tokens, self.block_size, self.snapshot_every_blocks):
            if self.snapshots.find(seq.block_hash(b // self.block_size - 1)) is not None:
                continue
            slot = self.snapshots.reserve()
            if slot is None:
                return
            seq.snapshot_writes.append((b, slot))

    def _settle_snapshots(self, seq: Sequence, *, computed: bool) -> None:
        """File ``seq``'s planned snapshots whose block is now registered (``computed``: the step that wrote them
        ran; each lies within it), cancel the rest."""
        for b, slot in seq.snapshot_writes:
            h = seq.block_hash(b // self.block_size - 1) if computed else None
            if h is not None and h in self.hash_to_block:
                self.snapshots.file(slot, h)
            else:
                self.snapshots.cancel(slot)
        seq.snapshot_writes = []

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
            if bid >= 0:  # -1: a coded block (its pages are shared whole, below)
                self.blocks[bid].ref_count += 1
            child.block_table.append(bid)
        if parent.coded is not None:
            parent.coded.refs += 1
            child.coded = parent.coded
        child.num_computed_tokens = num_tokens
        child.num_registered_blocks = min(parent.num_registered_blocks, full)
        if self.state_slots is not None:  # the caller copies the parent's state into it (ModelRunner.copy_state)
            child.state_slot = self.state_slots.take()
        if num_tokens == full * self.block_size:
            return None
        ok = self._take_one(child)
        assert ok, "can_fork promised the block"
        return parent.block_table[full], child.block_table[-1]

    def _reclaim_for_one(self) -> None:
        """Make a free block the next one handed out where the vision cache can give one back (before a prefix
        block is evicted)."""
        while self.num_lent and self.reclaim is not None and (
                not self.unreferenced or self.blocks[next(iter(self.unreferenced))].hash is not None):
            if not self.reclaim():
                break

    def _take_one(self, seq: Sequence) -> bool:
        """Append one block to ``seq``'s table (False, nothing changed, when none is free): a free block, else one
        the vision cache gives back, else the least recently used prefix block."""
        self._reclaim_for_one()
        if not self.unreferenced:
            return False
        bid = self._pop_unreferenced()
        self.blocks[bid].ref_count = 1
        seq.block_table.append(bid)
        return True

    def _pop_unreferenced(self) -> int:
        """The first block of the unreferenced queue, its prefix-cache entry (if any) evicted."""
        bid, _ = self.unreferenced.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == bid:
                del self.hash_to_block[block.hash]
                if self.snapshots is not None:
                    self.snapshots.drop(block.hash)
                if self.on_evict is not None:
                    self.on_evict(block.hash)
            block.hash = None
        return bid

    def register_computed(self, seq: Sequence) -> None:
        """Publish the hashes of ``seq``'s blocks whose KV is now fully computed (never for approximate KV), and
        file the GDN snapshots the step wrote."""
        if seq.state_restore is not None:  # restored by the runner before the step ran
            self.snapshots.unpin(seq.state_restore)
            seq.state_restore = None
        if not self.enable_prefix_caching or seq.kv_lossy:
            if seq.snapshot_writes:
                self._settle_snapshots(seq, computed=False)
            return
        full = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_registered_blocks, full):
            h = seq.block_hash(i)
            bid = seq.block_table[i]
            if h not in self.hash_to_block and self.blocks[bid].hash is None:
                self.hash_to_block[h] = bid
                self.blocks[bid].hash = h
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)
        if seq.snapshot_writes:
            self._settle_snapshots(seq, computed=True)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (tail first, so a prefix's head stays cached longest)."""
        for bid in reversed(seq.block_table):
            if bid < 0:
                continue
            block = self.blocks[bid]
            assert block.ref_count > 0, f"double free of block {bid}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.unreferenced[bid] = None
                if block.hash is None:
                    self.unreferenced.move_to_end(bid, last=False)
        seq.block_table = []
        if seq.coded is not None:  # its last holder gives the pages back
            seq.coded.refs -= 1
            if seq.coded.refs == 0:
                self._free_blocks(seq.coded.pages)
                self.num_pages -= len(seq.coded.pages)
                seq.coded.pages = []
            seq.coded = None
        if seq.state_restore is not None:
            self.snapshots.unpin(seq.state_restore)
            seq.state_restore = None
        if seq.snapshot_writes:
            self._settle_snapshots(seq, computed=False)
        if seq.state_slot is not None:
            assert self.state_slots is not None
            self.state_slots.release(seq.state_slot)
            seq.state_slot = None
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def regions(self, block_bytes: int) -> dict[str, int]:
        """Bytes of the pool's regions now (:class:`engine.kv_budget.KVMemory`'s fields): blocks sequences hold,
        coded visual pages, and the floor the elastic region leaves to the text KV."""
        held = self.num_blocks - len(self.unreferenced) - self.num_lent - self.num_pages
        return {"text_kv_bytes": held * block_bytes, "visual_kv_bytes": self.num_pages * block_bytes,
                "floor_bytes": self.visual_floor * block_bytes}

    def check_no_leaks(self) -> None:
        """Assert every block is free or cached with zero references (call when no request is live)."""
        held = [b.block_id for b in self.blocks if b.ref_count != 0]
        assert not held, f"{len(held)} KV block(s) still referenced: {held[:8]}"
        assert len(self.unreferenced) + self.num_lent + self.num_pages == len(self.blocks), \
            "unreferenced queue out of sync"
        if self.state_slots is not None:
            self.state_slots.check_no_leaks()
        if self.snapshots is not None:
            self.snapshots.check_no_leaks()
