"""Tiered expert memory for a decode worker: a bounded set of experts on the device, the rest in host memory, with
pre-warming from routing hints, the load forecast and a one-layer look-ahead.

Installed as every MoE layer's :attr:`engine.moe.SparseMoe.executor` (the module's own expert tensors are moved to
the host tier and dropped from the module). Results are bit-identical to the all-resident engine: the same (token,
expert) rows form the same groups of the same grouped GEMM, with the same weights, and are combined in the
engine's order.

Memory: host tier ``[E, 2I, H]`` / ``[E, H, I]`` per MoE layer (pinned when the device is CUDA; on a CPU device a
separate buffer, so every load is a real ``copy_``); device tier one slot buffer of ``capacity x pools + E`` experts
(the pools, see :class:`TierConfig`, plus ``E`` scratch slots for one layer's stalled loads; see
:mod:`decode_node.expert_residency`).

Per MoE layer (the executor, on the decode loop's thread):

1. Experts the layer needs that are resident are hits; ones a background copy is still writing are waited for
   (stalled, "late"); the rest are copied on demand into scratch slots (stalled). Both count as stalled loads and
   their wait is timed.
2. Look-ahead: layer ``l+1``'s router is applied to this layer's MoE input (one ``[T, H] x [H, E]`` matmul; an
   approximation of the input layer ``l+1`` will see) and the policy's :meth:`lookahead` copies start now, protected
   until layer ``l+1`` ran. During the last MoE layer the policy's pre-warm list for the next step is queued.
3. The layer runs from the slots; the policy observes its counts; stalled loads are kept if admitted.

Requests' routing hints arrive through :meth:`ExpertTiers.on_requests` when their KV transfer commits (and departures
when they finish); the policy's pre-warm list is queued at once, due at the next step. Background copies run on one
copier thread (on CUDA: on a copy stream, after the evicted slot's last reader finished), earliest deadline first.

The policy call contract, the time model (layer-times ``step x L + layer`` over MoE layers) and the counting are
those of :mod:`cluster.expert_cache`, with one addition: a stalled load that waited for an in-flight pre-warm copy
("late") is a stalled load whose bytes were counted once, as a prefetch.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from cluster.expert_cache import capacity_for, make_policy
from cluster.expert_policies import CachePolicy
from decode_node.expert_residency import Key, Residency, SlotState
from engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.moe import SparseMoe, grouped_mm

TIER_POLICIES = ("lru", "duet")
TIER_SCOPES = ("global", "layer")


@dataclass(frozen=True)
class TierConfig:
    """``resident``: a fraction in (0, 1] (float) or a count >= 1 (int) of each MoE layer's experts kept on the
    device. ``scope="global"`` (the default, as :func:`cluster.expert_cache.simulate`'s): one pool of that many
    experts x MoE layers, shared by all layers; ``"layer"``: that many per layer. ``policy``: ``"lru"`` (on demand,
    least recently used out) or ``"duet"`` (pre-warm and look-ahead, lowest forecast out)."""

    resident: float | int
    policy: str = "duet"
    scope: str = "global"

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
    """Install with ``ExpertTiers(engine, config)`` (before serving); :meth:`close` stops the copier thread.
    ``policy`` overrides the one ``config.policy`` names (tests)."""

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
        self._move_weights()
        self.cond = threading.Condition()
        self._step, self._last_li = -1, self.L
        self._copier: threading.Thread | None = None
        self._stopped = False
        self._copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._last_use: dict[int, torch.cuda.Event] = {}  # slot -> event after its last reading layer (CUDA)
        for li, moe in enumerate(self.moes):
            moe.executor = self._executor(li)

    @torch.no_grad()
    def _move_weights(self) -> None:
        m = self.moes[0]
        self.act = m.act
        self.host_gu, self.host_down = [], []
        for moe in self.moes:
            gu, down = moe.gate_up_proj.detach().to("cpu"), moe.down_proj.detach().to("cpu")
            if self.cuda:
                gu, down = gu.pin_memory(), down.pin_memory()
            self.host_gu.append(gu)
            self.host_down.append(down)
            # the device keeps only the slots: drop the all-resident [E, ...] tensors the loader filled
            moe.gate_up_proj = nn.Parameter(moe.gate_up_proj.new_empty(0, *moe.gate_up_proj.shape[1:]), False)
            moe.down_proj = nn.Parameter(moe.down_proj.new_empty(0, *moe.down_proj.shape[1:]), False)
        n = self.res.num_slots
        self.dev_gu = torch.empty(n, *self.host_gu[0].shape[1:], dtype=self.host_gu[0].dtype, device=self.device)
        self.dev_down = torch.empty(n, *self.host_down[0].shape[1:], dtype=self.host_down[0].dtype, device=self.device)
        self.bytes_per_expert = (self.host_gu[0][0].numel() + self.host_down[0][0].numel()) * self.dev_gu.element_size()

    @property
    def capacity(self) -> int:
        return self.res.capacity

    # --------------------------------------------------------------------------------------- hints and pre-warm
    def on_requests(self, arrivals: list[tuple[str, np.ndarray | list]], departures: list[str]) -> None:
        """Requests joining the next step, each with its prefill routing histogram ``[decoder layers, E]`` (the
        worker calls this when a transfer commits), and ids that left. Queues the policy's pre-warm list."""
        hints = [(rid, np.asarray(h, dtype=np.int64)[self.moe_layers]) for rid, h in arrivals]
        with self.cond:
            self.policy.on_requests(hints, departures)
            self._queue_prewarm()

    def prefetch(self, keys: list[Key], *, certain: bool = True) -> None:
        """Queue copies of ``(moe layer, expert)`` keys for the next step (a pre-warm list sent from outside)."""
        with self.cond:
            start = self._next_step_start()
            for layer, e in keys:
                self.res.enqueue([(layer, e)], start + layer, certain=certain)
            self._wake()

    def _next_step_start(self) -> int:
        now = self.policy.now
        return now if now % self.L == 0 else (now // self.L + 1) * self.L

    def _queue_prewarm(self) -> None:
        start = self._next_step_start()
        for layer, e in self.policy.prefetch_list():
            self.res.enqueue([(layer, e)], start + layer, certain=False)
        self._wake()

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Tests and tools: wait until no copy is queued or running."""
        end = time.monotonic() + timeout_s
        with self.cond:
            while self.res.queue or self._loading():
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
        return True

    def close(self) -> None:
        with self.cond:
            self._stopped = True
            self.cond.notify_all()
        if self._copier is not None:
            self._copier.join(timeout=5)

    def summary(self) -> dict:
        """msgpack-able stats: the counters, ``hit_rate``, capacity, policy and scope, resident experts now."""
        with self.cond:
            return {**self.stats.to_dict(), "capacity": self.capacity, "policy": self.config.policy,
                    "scope": self.config.scope, "resident_now": len(self.res.resident()),
                    "bytes_per_expert": self.bytes_per_expert}

    # ------------------------------------------------------------------------------------------------- copier
    def _wake(self) -> None:
        if self.res.queue and self._copier is None:
            self._copier = threading.Thread(target=self._copy_loop, name="expert-copier", daemon=True)
            self._copier.start()
        self.cond.notify_all()

    def _loading(self) -> bool:
        return SlotState.LOADING in self.res.state

    def _copy_loop(self) -> None:
        with torch.no_grad():
            while True:
                with self.cond:
                    job = None
                    while not self._stopped and (job := self.res.next_copy()) is None:
                        self.cond.wait()
                    if self._stopped:
                        return
                    wait = self._last_use.get(job[1])
                self._copy(*job, stream=self._copy_stream, after=wait)
                with self.cond:
                    self.res.loaded(job[0])
                    self.stats.prefetches += 1
                    self.stats.bytes_copied += self.bytes_per_expert
                    self.cond.notify_all()

    def _copy(self, key: Key, slot: int, *, stream: torch.cuda.Stream | None = None,
              after: torch.cuda.Event | None = None) -> None:
        layer, e = key
        if stream is None:
            self.dev_gu[slot].copy_(self.host_gu[layer][e], non_blocking=self.cuda)
            self.dev_down[slot].copy_(self.host_down[layer][e], non_blocking=self.cuda)
            return
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)  # the evicted expert's last reader has finished
            self.dev_gu[slot].copy_(self.host_gu[layer][e], non_blocking=True)
            self.dev_down[slot].copy_(self.host_down[layer][e], non_blocking=True)
        stream.synchronize()

    # ------------------------------------------------------------------------------------------------ executor
    def _executor(self, li: int):
        def run(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
            return self._run(li, x, weights, experts)
        return run

    def _run(self, li: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        flat = experts.reshape(-1)
        counts = torch.bincount(flat, minlength=self.E)
        counts_np = counts.cpu().numpy()
        ahead = self._lookahead_experts(li, x)
        t0 = time.perf_counter()
        with self.cond:
            if li <= self._last_li:
                self._step += 1
            self._last_li = li
            tau = self._step * self.L + li
            self.policy.at(tau)
            got = self.res.acquire(li, np.flatnonzero(counts_np), tau)
            if ahead is not None:
                keys = [(li + 1, e) for e in self.policy.lookahead(li + 1, ahead)]
                self.res.enqueue(keys, tau + 1, certain=True)
                self.res.protect_next(keys)
            if li == self.L - 1:
                self._queue_prewarm()
            self._wake()
        for key, slot in got.missing:
            self._copy(key, slot)
        with self.cond:
            while any(not self.res.is_resident(k) for k in got.late):
                self.cond.wait()
            slots = {k[1]: self.res.slot(k) for k in got.hits + got.late}
        slots.update({k[1]: s for k, s in got.missing})
        stall = time.perf_counter() - t0 if got.late or got.missing else 0.0
        out = self._compute(x, weights, flat, slots)
        with self.cond:
            self._count(counts_np, got, stall)
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record()
                self._last_use.update((s, ev) for s in slots.values())
            self.policy.observe(li, counts_np)
            self.policy.at(tau + 1)
            self.res.release()
            self.res.keep(got.missing)
            self._wake()
        return out

    def _lookahead_experts(self, li: int, x: torch.Tensor) -> np.ndarray | None:
        """Layer ``li + 1``'s router on this layer's input: the experts it would choose (softmax keeps the order,
        so the top-k of the logits)."""
        if li + 1 >= self.L or x.shape[0] == 0:
            return None
        nxt = torch.topk(self.moes[li + 1].gate(x), self.top_k, dim=-1).indices
        return torch.unique(nxt).cpu().numpy()

    def _count(self, counts: np.ndarray, got, stall: float) -> None:
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

    def _compute(self, x: torch.Tensor, weights: torch.Tensor, flat: torch.Tensor, slots: dict[int, int]
                 ) -> torch.Tensor:
        """:meth:`SparseMoe.forward`'s maths from the slot buffer: pairs sorted by expert as the engine sorts them,
        regrouped by slot for the GEMMs (a group = one expert's rows in the same order), back in expert order for
        the activation and the combine."""
        t, h = x.shape
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        slot_map = torch.zeros(self.E, dtype=torch.int64)
        slot_map[list(slots)] = torch.tensor(list(slots.values()), dtype=torch.int64)
        slot_of_pair = slot_map.to(x.device)[flat[order]]
        perm = torch.argsort(slot_of_pair, stable=True)
        offsets = torch.cumsum(torch.bincount(slot_of_pair, minlength=self.res.num_slots), 0, dtype=torch.int32)
        xs = x[token[perm]]
        gu = torch.empty(xs.shape[0], self.dev_gu.shape[1], dtype=x.dtype, device=x.device)
        gu[perm] = grouped_mm(xs, self.dev_gu.transpose(1, 2), offsets)
        gate, up = gu.chunk(2, dim=-1)
        hidden = self.act(gate) * up
        y = torch.empty(xs.shape[0], h, dtype=x.dtype, device=x.device)
        y[perm] = grouped_mm(hidden[perm], self.dev_down.transpose(1, 2), offsets)
        y = y * weights.view(-1)[order].unsqueeze(1)
        return torch.zeros(t, h, dtype=y.dtype, device=y.device).index_add_(0, token, y).to(x.dtype)
