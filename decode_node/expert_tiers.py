"""Tiered expert memory for a decode worker: a bounded set of experts on the device, the rest in host memory, with
pre-warming from routing hints, the load forecast and a one-layer look-ahead.

Installed as every MoE layer's :attr:`engine.moe.SparseMoe.executor` (the module's own expert tensors move to the
host tier and leave the module). Results are bit-identical to the all-resident engine: the (token, expert) pairs are
sorted as the engine sorts them, each expert's rows are one GEMM with the same weights (now read from a slot), and
the combine adds in the engine's order.

Memory: host tier ``[E, 2I, H]`` / ``[E, H, I]`` per MoE layer (pinned when the device is CUDA; on a CPU device a
separate buffer, so every load is a real ``copy_``); device tier one slot buffer of ``capacity x pools + E`` experts:
the pools (:class:`TierConfig`; one pool for all layers by default, the simulation's ``scope="global"``) plus ``E``
scratch slots for one layer's stalled loads (:mod:`decode_node.expert_residency`).

Per MoE layer (the executor, on the decode loop's thread):

1. Experts the layer needs that are resident are hits; ones the copier is still writing are waited for ("late"); the
   rest are copied on demand into scratch slots. Late and on-demand experts are stalled loads; their wait is timed.
2. Look-ahead (``duet``): layer ``l+1``'s router is applied to this layer's MoE input (one ``[T, H] x [H, E]``
   matmul; an approximation of the input layer ``l+1`` will see) and those experts are copied now, pinned until
   layer ``l+1`` ran. During the last MoE layer the policy's pre-warm list for the next step goes out.
3. The layer runs from the slots; the policy observes its counts; stalled loads are kept if admitted.

Requests' routing hints arrive through :meth:`ExpertTiers.on_requests` when their KV transfer commits (departures
when they finish); the policy's pre-warm list for the next step is queued at once. Queued copies go, earliest
deadline first and at most ``max_inflight`` at a time (:meth:`Residency.take_copies` picks their slots then), to
one copier thread that runs them in that order (on CUDA on a copy stream, after the evicted slot's last reader
finished). When a layer starts, its experts still queued are copied on demand; those handed to the copier are
waited for ("late"), not redone.

The policy call contract, the time model (layer-times ``step x L + layer`` over MoE layers) and the counting are
those of :mod:`cluster.experts.expert_cache`, with one difference: a late copy is a stalled load whose bytes count once, as
a prefetch. ``hits`` / ``hit_rate`` count (token, expert) assignments; ``expert_hits + stalled_loads = accesses``,
one access per (layer run, needed expert).

Not supported: expert-parallel workers (their slots live in :mod:`decode_node.expert_shard`); bf16 on CUDA is
correct but not bit-identical to the engine's native grouped GEMM (this executor runs one GEMM per expert).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from decode_node.expert_residency import Acquired, Key, Residency
from engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.moe import SparseMoe
from node_common.expert_policies import CachePolicy, capacity_for, make_policy

LOOKAHEAD = {"lru": False, "duet": True}  # policy -> whether it wants the next layer's router applied early
TIER_POLICIES = tuple(LOOKAHEAD)
TIER_SCOPES = ("global", "layer")


@dataclass(frozen=True)
class TierConfig:
    """``resident``: a fraction in (0, 1] (float) or a count >= 1 (int) of each MoE layer's experts kept on the
    device. ``scope="global"`` (the default, as :func:`cluster.experts.expert_cache.simulate`'s): one pool of that many
    experts x MoE layers, shared by all layers; ``"layer"``: that many per layer. ``policy``: ``"lru"`` (on demand,
    least recently used out) or ``"duet"`` (pre-warm and look-ahead, lowest forecast out). ``max_inflight``: copies
    handed to the copier at once (the rest wait in the queue, where a copy whose layer ran is dropped and a slot is
    picked only when the copy starts); the loop tops it up at each layer's start and end. ``copy_s`` > 0 makes every
    expert copy last at least that long (sleeping, so the copier overlaps the decode loop as a DMA engine would):
    benchmarks on a CPU device use it to emulate a host link as slow, relative to a layer, as a GPU's PCIe is."""

    resident: float | int
    policy: str = "duet"
    scope: str = "global"
    max_inflight: int = 4
    copy_s: float = 0.0

    def __post_init__(self) -> None:
        r = self.resident
        if isinstance(r, bool) or not isinstance(r, int | float):
            raise InvalidRequestError(f"expert_resident must be a fraction or a count, got {r!r}")
        if isinstance(r, float) and not 0 < r <= 1:
            raise InvalidRequestError(f"expert_resident fraction must be in (0, 1], got {r}")
        if isinstance(r, int) and r < 1:
            raise InvalidRequestError(f"expert_resident count must be >= 1, got {r}")
        if self.policy not in TIER_POLICIES:
            raise InvalidRequestError(f"unknown expert cache policy {self.policy!r} (choose from "
                                      f"{', '.join(TIER_POLICIES)})")
        if self.scope not in TIER_SCOPES:
            raise InvalidRequestError(f"expert cache scope must be one of {TIER_SCOPES}, got {self.scope!r}")
        if self.copy_s < 0 or self.max_inflight < 1:
            raise InvalidRequestError(f"copy_s must be >= 0 and max_inflight >= 1, got {self.copy_s}, "
                                      f"{self.max_inflight}")

    def capacity(self, num_layers: int, num_experts: int) -> int:
        """Slots per pool: the simulation's ``capacity_for`` for a fraction; ``count`` (x layers, global) for a
        count. Raises for a count above ``num_experts``."""
        r = self.resident
        if isinstance(r, int):
            if r > num_experts:
                raise InvalidRequestError(f"expert_resident {r} exceeds the model's {num_experts} experts per layer")
            return r if self.scope == "layer" else r * num_layers
        return capacity_for(r, num_experts if self.scope == "layer" else num_layers * num_experts)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TierStats:
    assignments: int = 0  # (token, expert) assignments
    hits: int = 0  # assignments whose expert was resident when its layer started
    accesses: int = 0  # (layer, expert) needed per layer run: expert_hits + stalled_loads
    expert_hits: int = 0
    stalled_loads: int = 0  # needed experts not resident when the layer started (demand copies + late)
    late: int = 0  # of those, waited for an in-flight pre-warm copy
    demand_copies: int = 0
    prefetches: int = 0  # background copies completed (pre-warm lists and look-ahead)
    bytes_copied: int = 0  # (demand_copies + prefetches) x bytes per expert
    stall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.assignments if self.assignments else 1.0

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


class ExpertTiers:
    """Install with ``ExpertTiers(engine, config)`` before serving; :meth:`close` stops the copier thread.
    ``policy`` overrides the one ``config.policy`` names (tests).

    Threading: every method, and the executor, runs on the decode loop's thread (or under the decode actor's lock,
    which the loop holds while it steps), which owns the bookkeeping (:class:`~decode_node.expert_residency.Residency`,
    the policy, the counters); the copier thread only moves the bytes of copies handed to it, and reports each
    finished key back through a queue."""

    def __init__(self, engine: LLMEngine, config: TierConfig, *, policy: CachePolicy | None = None) -> None:
        layers = engine.model.text.layers
        self.moe_layers = [i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoe)]
        if not self.moe_layers:
            raise InvalidRequestError("tiered expert memory needs an MoE model; this checkpoint has no MoE layer")
        self.moes: list[SparseMoe] = [layers[i].mlp for i in self.moe_layers]
        self.config, self.device = config, engine.device
        self.L, self.E, self.top_k = len(self.moes), self.moes[0].num_experts, self.moes[0].top_k
        cap = config.capacity(self.L, self.E)
        self.policy = policy or make_policy(config.policy, None)
        self.policy.reset(self.L, self.E, cap, self.top_k)
        self.res = Residency(self.policy, num_layers=self.L, num_experts=self.E, capacity=cap,
                             per_layer=config.scope == "layer")
        self.stats = TierStats()
        self.cuda = self.device.type == "cuda"
        self.lookahead = LOOKAHEAD[config.policy]
        self._move_weights()
        self._step, self._last_li = -1, self.L
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (key, slot, CUDA event to wait for) or None: stop
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # keys copied
        self._inflight = 0
        self._copier: threading.Thread | None = None
        self._copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._last_use: dict[int, torch.cuda.Event] = {}  # slot -> event after its last reading layer (CUDA)
        for li, moe in enumerate(self.moes):
            moe.executor = self._executor(li)

    @torch.no_grad()
    def _move_weights(self) -> None:
        self.act = self.moes[0].act
        self.host_gu, self.host_down = [], []
        for moe in self.moes:
            gu, down = (w.detach().to("cpu") for w in moe.expert_weights())
            if self.cuda:
                gu, down = gu.pin_memory(), down.pin_memory()
            self.host_gu.append(gu)
            self.host_down.append(down)
            # the device keeps only the slots: drop the all-resident [E, ...] tensors the loader filled
            moe.release_experts()
        n = self.res.num_slots
        self.dev_gu = torch.empty(n, *self.host_gu[0].shape[1:], dtype=self.host_gu[0].dtype, device=self.device)
        self.dev_down = torch.empty(n, *self.host_down[0].shape[1:], dtype=self.host_down[0].dtype, device=self.device)
        self.bytes_per_expert = (self.host_gu[0][0].numel() + self.host_down[0][0].numel()) * self.dev_gu.element_size()
        # per-slot and per-expert views, made once: the copier indexes nothing
        self._dst = [(self.dev_gu[s], self.dev_down[s]) for s in range(n)]
        self._src = [[(gu[e], down[e]) for e in range(self.E)] for gu, down in zip(self.host_gu, self.host_down)]

    @property
    def capacity(self) -> int:
        return self.res.capacity

    # --------------------------------------------------------------------------------------- hints and pre-warm
    def on_requests(self, arrivals: list[tuple[str, np.ndarray | list]], departures: list[str]) -> None:
        """Requests joining the next step, each with its prefill routing histogram ``[decoder layers, E]`` (the
        worker calls this when a transfer commits), and ids that left. Issues the policy's pre-warm list."""
        hints = [(rid, np.asarray(h, dtype=np.int64)[self.moe_layers]) for rid, h in arrivals]
        self.policy.on_requests(hints, departures)
        self.res.invalidate_scores()
        self._queue_prewarm()

    def prefetch(self, keys: list[Key], *, certain: bool = True) -> None:
        """Copy ``(moe layer, expert)`` keys before the next step (a pre-warm list from outside the policy);
        ``certain`` ones, copied or already resident, also stay until their layer ran."""
        start = self._next_step_start()
        for layer, e in keys:
            self.res.enqueue([(layer, e)], start + layer, certain=certain)
            if certain:
                self.res.pin([(layer, e)], start + layer)
        self._issue()

    def _next_step_start(self) -> int:
        now = self.policy.now
        return now if now % self.L == 0 else (now // self.L + 1) * self.L

    def _queue_prewarm(self) -> None:
        start = self._next_step_start()
        for layer, e in self.policy.prefetch_list():
            self.res.enqueue([(layer, e)], start + layer, certain=False)
        self._issue()

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Tests and tools: wait until every queued copy finished (or was dropped)."""
        end = time.monotonic() + timeout_s
        try:
            while self._inflight or self.res.queue:
                self._issue()
                if self._inflight:
                    self._complete(self._done.get(timeout=max(1e-3, end - time.monotonic())))
        except queue.Empty:
            return False
        return True

    def close(self) -> None:
        if self._copier is not None:
            self._jobs.put(None)
            self._copier.join(timeout=5)
            self._copier = None

    def summary(self) -> dict:
        """msgpack-able: the counters, ``hit_rate``, capacity, policy and scope, experts resident now."""
        return {**self.stats.to_dict(), "capacity": self.capacity, "policy": self.config.policy,
                "scope": self.config.scope, "resident_now": len(self.res.resident()),
                "bytes_per_expert": self.bytes_per_expert}

    # ------------------------------------------------------------------------------------------------- copier
    def _issue(self) -> None:
        """Hand every queued copy that can be placed to the copier, earliest deadline first."""
        for job in self.res.take_copies(self.config.max_inflight - self._inflight):
            if self._copier is None:
                self._copier = threading.Thread(target=self._copy_loop, name="expert-copier", daemon=True)
                self._copier.start()
            self._jobs.put((*job, self._last_use.get(job[1])))
            self._inflight += 1

    def _reap(self) -> None:
        while not self._done.empty():
            self._complete(self._done.get_nowait())

    def _complete(self, key: Key) -> None:
        self.res.loaded(key)
        self._inflight -= 1
        self.stats.prefetches += 1
        self.stats.bytes_copied += self.bytes_per_expert

    def _copy_loop(self) -> None:
        with torch.no_grad():
            while (job := self._jobs.get()) is not None:
                key, slot, after = job
                self._copy(key, slot, stream=self._copy_stream, after=after)
                self._done.put(key)

    def _copy(self, key: Key, slot: int, *, stream: torch.cuda.Stream | None = None,
              after: torch.cuda.Event | None = None) -> None:
        (dst_gu, dst_down), (src_gu, src_down) = self._dst[slot], self._src[key[0]][key[1]]
        t0 = time.perf_counter()
        if stream is None:
            dst_gu.copy_(src_gu, non_blocking=self.cuda)
            dst_down.copy_(src_down, non_blocking=self.cuda)
        else:
            with torch.cuda.stream(stream):
                if after is not None:
                    stream.wait_event(after)  # the evicted expert's last reader has finished
                dst_gu.copy_(src_gu, non_blocking=True)
                dst_down.copy_(src_down, non_blocking=True)
            stream.synchronize()
        if (left := self.config.copy_s - (time.perf_counter() - t0)) > 0:
            time.sleep(left)

    # ------------------------------------------------------------------------------------------------ executor
    def _executor(self, li: int):
        def run(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
            return self._run(li, x, weights, experts)
        return run

    def _run(self, li: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        flat = experts.reshape(-1)
        counts = torch.bincount(flat, minlength=self.E).cpu().numpy()
        needed = np.flatnonzero(counts)
        ahead = self._lookahead_experts(li, x) if self.lookahead else None
        t0 = time.perf_counter()
        self._reap()
        if li <= self._last_li:
            self._step += 1
        self._last_li = li
        tau = self._step * self.L + li
        self.policy.at(tau)
        self.res.invalidate_scores()
        got = self.res.acquire(li, needed, tau)
        if ahead is not None:
            keys = [(li + 1, e) for e in self.policy.lookahead(li + 1, ahead)]
            self.res.enqueue(keys, tau + 1, certain=True)
            self.res.pin(keys, tau + 1)
        if li == self.L - 1:
            self._queue_prewarm()  # issues the look-ahead's copies too
        else:
            self._issue()
        for key, slot in got.missing:
            self._copy(key, slot)
        while not all(self.res.is_resident(k) for k in got.late):
            self._complete(self._done.get())
        stall = time.perf_counter() - t0 if got.late or got.missing else 0.0
        slot_of = dict(got.missing)
        slot_of.update((k, self.res.slot(k)) for k in got.hits + got.late)
        out = self._compute(x, weights, flat, [(slot_of[(li, int(e))], int(counts[e])) for e in needed])
        self._count(counts, got, stall)
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
            self._last_use.update((s, ev) for s in slot_of.values())
        self.policy.observe(li, counts)
        self.policy.at(tau + 1)
        self.res.invalidate_scores()
        self.res.release()
        self.res.keep(got.missing)
        self._reap()
        self._issue()
        return out

    def _lookahead_experts(self, li: int, x: torch.Tensor) -> np.ndarray | None:
        """Layer ``li + 1``'s router on this layer's input: the experts it would choose (softmax keeps the order,
        so the top-k of the logits)."""
        if li + 1 >= self.L or x.shape[0] == 0:
            return None
        nxt = torch.topk(self.moes[li + 1].gate(x), self.top_k, dim=-1).indices
        return np.flatnonzero(torch.bincount(nxt.reshape(-1), minlength=self.E).cpu().numpy())

    def _count(self, counts: np.ndarray, got: Acquired, stall: float) -> None:
        s = self.stats
        s.assignments += int(counts.sum())
        s.hits += int(sum(counts[k[1]] for k in got.hits))
        s.accesses += len(got.hits) + len(got.late) + len(got.missing)
        s.expert_hits += len(got.hits)
        s.stalled_loads += len(got.late) + len(got.missing)
        s.late += len(got.late)
        s.demand_copies += len(got.missing)
        s.bytes_copied += len(got.missing) * self.bytes_per_expert
        s.stall_s += stall

    def _compute(self, x: torch.Tensor, weights: torch.Tensor, flat: torch.Tensor, groups: list[tuple[int, int]]
                 ) -> torch.Tensor:
        """:meth:`SparseMoe.forward`'s maths from the slot buffer. ``groups``: ``(slot, rows)`` of each needed
        expert in expert order. The (token, k) pairs are sorted by expert exactly as the engine sorts them, so
        every expert's rows, their order and the combine's order are the engine's; each group is one
        ``torch.mm`` with its slot's weights -- what the engine's grouped GEMM computes per group (bit-equal on
        CPU, and the engine's own path for float32 on CUDA), without paying for the slots no token uses."""
        t, h = x.shape
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        xs = x[token]
        gate, up = _group_mm(xs, self.dev_gu, groups).chunk(2, dim=-1)
        y = _group_mm(self.act(gate) * up, self.dev_down, groups) * weights.view(-1)[order].unsqueeze(1)
        return torch.zeros(t, h, dtype=y.dtype, device=y.device).index_add_(0, token, y).to(x.dtype)


def _group_mm(x: torch.Tensor, w: torch.Tensor, groups: list[tuple[int, int]]) -> torch.Tensor:
    """Consecutive row blocks of x ``[S, K]`` (``rows`` each) times ``w[slot].T`` (``w`` output-major
    ``[slots, N, K]``) -> ``[S, N]``."""
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for slot, rows in groups:
        torch.mm(x[start:start + rows], w[slot].t(), out=out[start:start + rows])
        start += rows
    return out
