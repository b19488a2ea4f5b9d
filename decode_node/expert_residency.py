"""Which expert each device slot of a tiered decode worker holds, the copy queue, and who may be evicted.

Pure bookkeeping (no tensors, not thread-safe: :class:`decode_node.expert_tiers.ExpertTiers` holds one lock around
every call). It follows :mod:`cluster.expert_cache`'s model, so the worker and the simulation count alike:

* **Pools**: ``per_layer=False`` (the simulation's ``scope="global"``): one pool of ``capacity`` slots shared by all
  MoE layers; ``per_layer=True`` (``scope="layer"``): ``capacity`` slots per layer. Keys are ``(moe layer, expert)``.
* **Scratch**: ``num_experts`` more slots where a layer's stalled loads land; after the layer ran, :meth:`keep` moves
  each into its pool (a slot-id swap, no copy) when there is room or the policy admits it over its lowest-scored
  resident expert -- the simulation's "kept afterwards if there is room or the policy admits it".
* **Copy queue**: ``key -> (deadline, certain)``; the deadline is the layer-time the key's layer runs. The copier
  takes the earliest deadline first (certain before speculative) in :meth:`next_copy`, which also picks the slot:
  a free one, or the policy's lowest-scored resident expert that is not protected; a speculative copy evicts only
  when :meth:`~cluster.expert_policies.CachePolicy.admit` agrees. A queued copy whose layer already ran is dropped.
* **Protected** from eviction: the experts the running layer uses (``busy``), the look-ahead's experts for the next
  layer (``need``, until that layer ran), and slots being loaded.

Slot states: FREE (in a pool, empty) -> LOADING (the copier writes it) -> RESIDENT; eviction returns a slot to
LOADING for its new key directly. Scratch slots are always FREE between layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum

from cluster.expert_policies import CachePolicy

Key = tuple[int, int]  # (MoE layer, expert)


class SlotState(IntEnum):
    FREE = 0
    LOADING = 1
    RESIDENT = 2


@dataclass
class Acquired:
    """What a layer found when it started: ``hits`` resident, ``late`` still being copied (wait for them), ``missing``
    (copy on demand into the given scratch slot)."""

    hits: list[Key]
    late: list[Key]
    missing: list[tuple[Key, int]]


class Residency:
    def __init__(self, policy: CachePolicy, *, num_layers: int, num_experts: int, capacity: int,
                 per_layer: bool) -> None:
        assert capacity >= 1 and num_layers >= 1 and num_experts >= 1
        self.policy, self.num_layers, self.num_experts, self.capacity = policy, num_layers, num_experts, capacity
        self.per_layer = per_layer
        npools = num_layers if per_layer else 1
        self.num_slots = capacity * npools + num_experts
        self.pools: list[set[int]] = [set(range(p * capacity, (p + 1) * capacity)) for p in range(npools)]
        self.scratch: list[int] = list(range(capacity * npools, self.num_slots))
        self.key_of: list[Key | None] = [None] * self.num_slots
        self.state: list[SlotState] = [SlotState.FREE] * self.num_slots
        self.slot_of: dict[Key, int] = {}  # LOADING or RESIDENT keys
        self.queue: dict[Key, tuple[int, bool]] = {}
        self.need: set[Key] = set()
        self.busy: set[Key] = set()
        self.ran = -1  # the last layer-time that started running

    def pool_of(self, layer: int) -> set[int]:
        return self.pools[layer if self.per_layer else 0]

    def is_resident(self, key: Key) -> bool:
        slot = self.slot_of.get(key)
        return slot is not None and self.state[slot] == SlotState.RESIDENT

    def resident(self) -> list[Key]:
        return [k for k, s in self.slot_of.items() if self.state[s] == SlotState.RESIDENT]

    # ---------------------------------------------------------------------------------------------- copy queue
    def enqueue(self, keys: Iterable[Key], deadline: int, *, certain: bool) -> int:
        """Queue copies of ``keys`` (not yet resident or loading) due at layer-time ``deadline``; returns how many
        were queued or updated. A key already queued keeps the earlier deadline and becomes certain if either is."""
        n = 0
        for key in keys:
            if key in self.slot_of:
                continue
            old = self.queue.get(key)
            self.queue[key] = (min(deadline, old[0]) if old else deadline, certain or bool(old and old[1]))
            n += 1
        return n

    def protect_next(self, keys: Iterable[Key]) -> None:
        """The look-ahead's experts for the next layer: not evicted until that layer ran."""
        self.need = set(keys)

    def next_copy(self) -> tuple[Key, int] | None:
        """The copier's next job ``(key, slot)`` with the slot now LOADING (its old expert evicted), or None when
        nothing queued can be placed."""
        while self.queue:
            key, (deadline, certain) = min(self.queue.items(), key=lambda kv: (kv[1][0], not kv[1][1], kv[0]))
            del self.queue[key]
            if deadline <= self.ran or key in self.slot_of:
                continue  # its layer already ran (it ran without it), or it is already here
            slot = self._slot_for(key, demand=False, certain=certain)
            if slot is None:
                continue
            self._assign(slot, key, SlotState.LOADING)
            return key, slot
        return None

    def loaded(self, key: Key) -> None:
        self.state[self.slot_of[key]] = SlotState.RESIDENT

    # ------------------------------------------------------------------------------------------ running a layer
    def acquire(self, layer: int, experts: Iterable[int], now: int) -> Acquired:
        """Layer ``layer`` starts at layer-time ``now`` and needs ``experts``: classify them, take their queued
        copies off the queue (a queued copy that has not started is done on demand instead), drop copies whose
        layer ran, and protect them until :meth:`release`."""
        hits, late, missing = [], [], []
        for e in experts:
            key = (layer, int(e))
            self.queue.pop(key, None)
            slot = self.slot_of.get(key)
            if slot is None:
                missing.append((key, self.scratch.pop()))
            elif self.state[slot] == SlotState.RESIDENT:
                hits.append(key)
            else:
                late.append(key)
            self.busy.add(key)
        self.ran = now
        for key in [k for k, (d, _) in self.queue.items() if d <= now]:
            del self.queue[key]
        self.need = {k for k in self.need if k[0] != layer}
        return Acquired(hits, late, missing)

    def slot(self, key: Key) -> int:
        return self.slot_of[key]

    def keep(self, missing: list[tuple[Key, int]]) -> int:
        """After the layer ran and the policy observed it: keep each expert copied on demand (its scratch slot joins
        the pool, the evicted expert's slot becomes scratch) when there is room or the policy admits it. Returns
        how many were kept."""
        kept = 0
        for key, scratch in missing:
            slot = self._slot_for(key, demand=True, certain=False)
            if slot is None:
                self.scratch.append(scratch)
                continue
            pool = self.pool_of(key[0])
            pool.discard(slot)
            pool.add(scratch)
            self._assign(slot, None, SlotState.FREE)
            self.scratch.append(slot)
            self._assign(scratch, key, SlotState.RESIDENT)
            kept += 1
        return kept

    def release(self) -> None:
        self.busy.clear()

    # --------------------------------------------------------------------------------------------------- helpers
    def _slot_for(self, key: Key, *, demand: bool, certain: bool) -> int | None:
        """A FREE slot of ``key``'s pool, else the lowest-scored unprotected RESIDENT one whose expert the policy
        lets ``key`` evict (a certain copy always may); the victim is unmapped. None: nothing may go."""
        pool = self.pool_of(key[0])
        free = [s for s in pool if self.state[s] == SlotState.FREE]
        if free:
            return min(free)
        protected = self.busy | self.need
        cands = [s for s in pool if self.state[s] == SlotState.RESIDENT and self.key_of[s] not in protected]
        if not cands:
            return None
        victim = min(cands, key=lambda s: (self.policy.score(*self.key_of[s]), self.key_of[s]))
        if not certain and not self.policy.admit(key, self.key_of[victim], demand=demand):
            return None
        self._assign(victim, None, SlotState.FREE)
        return victim

    def _assign(self, slot: int, key: Key | None, state: SlotState) -> None:
        old = self.key_of[slot]
        if old is not None and self.slot_of.get(old) == slot:
            del self.slot_of[old]
        self.key_of[slot], self.state[slot] = key, state
        if key is not None:
            self.slot_of[key] = slot
