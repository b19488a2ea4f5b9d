"""Which expert each device slot of a tiered decode worker holds, the copy queue, and who may be evicted.

Pure bookkeeping (no tensors; not thread-safe: the decode loop's thread owns it, see
:class:`decode_node.expert_tiers.ExpertTiers`). It follows :mod:`cluster.experts.expert_cache`'s model, so the worker and
the simulation count alike:

* **Pools**: ``per_layer=False`` (the simulation's ``scope="global"``): one pool of ``capacity`` slots shared by all
  MoE layers; ``per_layer=True`` (``scope="layer"``): ``capacity`` slots per layer. Keys are ``(moe layer, expert)``.
* **Scratch**: ``num_experts`` more slots where a layer's stalled loads land; after the layer ran, :meth:`keep` moves
  each into its pool (a slot-id swap, no copy) when there is room or the policy admits it over its lowest-scored
  resident expert -- the simulation's "kept afterwards if there is room or the policy admits it".
* **Copy queue**: ``key -> (deadline, certain)``; the deadline is the layer-time the key's layer runs.
  :meth:`take_copies` starts copies earliest deadline first (certain before speculative) and picks each one's slot
  only then (the simulation's link decides at copy time too):
  a free one, or the policy's lowest-scored resident expert that is not protected; a speculative copy evicts only
  when :meth:`~node_common.expert_policies.CachePolicy.admit` agrees, and a copy whose layer already ran is dropped.
* **Protected** from eviction: the experts the running layer uses (``busy``); experts *pinned* until their layer
  ran -- the look-ahead's experts for the next layer (resident or copied), and every certain copy (look-ahead, or a
  pre-warm list sent from outside); and slots being loaded.

Slot states: FREE (in a pool, empty) -> LOADING (the copier writes it) -> RESIDENT; eviction returns a slot to
LOADING for its new key directly. Scratch slots are always FREE between layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum

from node_common.expert_policies import CachePolicy

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
    """Per layer run: :meth:`acquire` -> (copies, compute) -> :meth:`release` -> :meth:`keep`; between them
    :meth:`enqueue` / :meth:`pin` / :meth:`take_copies` / :meth:`loaded` as copies are asked for, start and finish.
    :meth:`invalidate_scores` after every change to the policy's state (scores are memoised)."""

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
        self.pinned: dict[Key, int] = {}  # key -> the layer-time until which it stays (its layer's)
        self.busy: set[Key] = set()
        self.ran = -1  # the last layer-time that started running
        self._scores: dict[Key, float] = {}  # policy.score memo, until invalidate_scores()

    def pool_of(self, layer: int) -> set[int]:
        return self.pools[layer if self.per_layer else 0]

    def is_resident(self, key: Key) -> bool:
        slot = self.slot_of.get(key)
        return slot is not None and self.state[slot] == SlotState.RESIDENT

    def resident(self) -> list[Key]:
        return [k for k, s in self.slot_of.items() if self.state[s] == SlotState.RESIDENT]

    # ---------------------------------------------------------------------------------------------- copy queue
    def enqueue(self, keys: Iterable[Key], deadline: int, *, certain: bool) -> int:
        """Queue copies of ``keys`` due at layer-time ``deadline``; returns how many were queued or updated. Keys
        resident, loading, or used by the running layer (:meth:`keep` decides about those) are skipped; a key already
        queued keeps the earlier deadline and becomes certain if either is."""
        n = 0
        for key in keys:
            if key in self.slot_of or key in self.busy:
                continue
            old = self.queue.get(key)
            self.queue[key] = (min(deadline, old[0]) if old else deadline, certain or bool(old and old[1]))
            n += 1
        return n

    def pin(self, keys: Iterable[Key], until: int) -> None:
        """Keep ``keys`` (resident, loading or to be copied) until layer-time ``until`` ran."""
        for key in keys:
            self.pinned[key] = max(until, self.pinned.get(key, until))

    def take_copies(self, limit: int) -> list[tuple[Key, int]]:
        """Up to ``limit`` copies to start now, earliest deadline first, each ``(key, slot)`` with its slot now
        LOADING (the slot's old expert evicted); the rest stay queued. A copy whose layer already ran, or that finds
        no slot it may take, is dropped."""
        jobs = []
        for key, (deadline, certain) in sorted(self.queue.items(), key=lambda kv: (kv[1][0], not kv[1][1], kv[0])):
            if len(jobs) >= limit:
                break
            del self.queue[key]
            if deadline <= self.ran or key in self.slot_of:
                continue  # its layer already ran (it ran without it), or it is already here
            slot = self._slot_for(key, demand=False, certain=certain)
            if slot is not None:
                self._assign(slot, key, SlotState.LOADING)
                jobs.append((key, slot))
                if certain:
                    self.pin([key], deadline)
        return jobs

    def loaded(self, key: Key) -> None:
        self.state[self.slot_of[key]] = SlotState.RESIDENT

    # ------------------------------------------------------------------------------------------ running a layer
    def acquire(self, layer: int, experts: Iterable[int], now: int) -> Acquired:
        """Layer ``layer`` starts at layer-time ``now`` and needs ``experts``: classify them (a queued copy not yet
        taken is done on demand instead), drop queued copies and pins whose layer ran, and protect the experts
        until :meth:`release`."""
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
        self.pinned = {k: until for k, until in self.pinned.items() if until > now}
        return Acquired(hits, late, missing)

    def invalidate_scores(self) -> None:
        """Call after anything the policy's scores depend on changed (``at``, ``observe``, ``on_requests``)."""
        self._scores.clear()

    def score(self, key: Key) -> float:
        s = self._scores.get(key)
        if s is None:
            s = self._scores[key] = self.policy.score(*key)
        return s

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

    def check(self) -> None:
        """Tests, between layers: every slot is in one pool or the scratch list, pools hold ``capacity`` slots,
        scratch slots are FREE, and the slot <-> key maps agree."""
        slots = sorted([s for p in self.pools for s in p] + self.scratch)
        assert slots == list(range(self.num_slots)), "a slot is lost or in two places"
        assert all(len(p) == self.capacity for p in self.pools) and len(self.scratch) == self.num_experts
        assert all(self.state[s] == SlotState.FREE for s in self.scratch), "a scratch slot holds an expert"
        for s in range(self.num_slots):
            key = self.key_of[s]
            assert (key is None) == (self.state[s] == SlotState.FREE), f"slot {s}: {key} {self.state[s]!r}"
            assert key is None or self.slot_of[key] == s, f"slot {s}: {key} maps to {self.slot_of.get(key)}"
        assert len(self.slot_of) == sum(k is not None for k in self.key_of)

    # --------------------------------------------------------------------------------------------------- helpers
    def _slot_for(self, key: Key, *, demand: bool, certain: bool) -> int | None:
        """A FREE slot of ``key``'s pool, else the lowest-scored unprotected RESIDENT one whose expert the policy
        lets ``key`` evict (a certain copy always may); the victim is unmapped. None: nothing may go."""
        pool = self.pool_of(key[0])
        free = [s for s in pool if self.state[s] == SlotState.FREE]
        if free:
            return min(free)
        cands = [s for s in pool if self.state[s] == SlotState.RESIDENT and self.key_of[s] not in self.busy
                 and self.key_of[s] not in self.pinned]
        if not cands:
            return None
        victim = min(cands, key=lambda s: (self.score(self.key_of[s]), self.key_of[s]))
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
