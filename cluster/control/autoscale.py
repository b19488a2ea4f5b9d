"""Autoscaling the prefill and decode pools: a validated policy, a pure decision function, and a loop that applies it.

Each pool follows its own signals, so decode scales on TPOT / KV pressure independently of prefill:

* prefill: ``ttft_p90_s`` and ``queued_prefill_tokens`` (pool total; the target is per worker);
* decode: ``tpot_p90_s`` and ``kv_utilization`` (mean fraction of decode KV blocks in use, 0..1).

:func:`decide` is pure: (policy, metrics window, pool sizes, :class:`ScaleState`, now) -> :class:`Decision`.

* **Scale up** when the newest sample breaches any of the pool's targets and the pool's last change is at least
  ``scale_up_cooldown_s`` old. The step is proportional to the worst breach, ``ceil(n * observed / target) - n``,
  at least 1 and at most ``max_step_up``, clamped to ``max_workers``.
* **Scale down** (one ``step_down`` at a time, to ``min_workers``) only when every sample of the last
  ``stabilization_window_s`` is below ``scale_down_ratio * target`` for every target, the window is fully covered by
  samples, the last scale-up is older than the window and the last scale-down older than ``scale_down_cooldown_s``.
  Together with the hysteresis of ``scale_down_ratio`` this keeps a pool from flapping inside one window.
* A scale-down is a **drain**: the worker stops taking new requests, its running requests finish, then it is removed.

Worked example (``deploy/autoscaling/default.yaml``: prefill TTFT p90 target 1.0 s, cooldown 30 s, ``max_step_up``
2): 2 prefill workers, newest sample ``ttft_p90_s=1.6`` -> ``ceil(2 * 1.6) - 2 = 2`` -> ``+2 (ttft_p90_s 1.6 > 1.0)``.
Ten seconds later, still breaching -> ``0 (cooldown: 20 s left)``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import IntEnum
from pathlib import Path
from typing import Any, Protocol

import yaml

from engine.errors import InvalidRequestError

ROLES = ("prefill", "decode")
# the metrics each pool scales on; the queued-token target is per worker, the others are pool-wide
TARGETS = {"prefill": ("ttft_p90_s", "queued_prefill_tokens"), "decode": ("tpot_p90_s", "kv_utilization")}
PER_WORKER = frozenset({"queued_prefill_tokens"})


class PolicyError(InvalidRequestError):
    """The autoscaling policy is unusable (the message names the field)."""


class Action(IntEnum):
    HOLD = 0
    ADD = 1
    DRAIN = 2  # stop routing new requests to the worker; remove it when its running requests finish


@dataclass(frozen=True)
class PoolPolicy:
    min_workers: int = 1
    max_workers: int = 1
    targets: dict[str, float] = field(default_factory=dict)  # names from TARGETS[role]; at least one
    max_step_up: int = 1
    step_down: int = 1
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 120.0
    stabilization_window_s: float = 300.0
    scale_down_ratio: float = 0.5  # scale down only while every metric stays below this fraction of its target

    def check(self, role: str) -> None:
        p = f"{role}."
        if not 1 <= self.min_workers <= self.max_workers:
            raise PolicyError(f"{p}min_workers/max_workers: need 1 <= min_workers <= max_workers, got "
                              f"{self.min_workers}/{self.max_workers}")
        if self.max_step_up < 1 or self.step_down < 1:
            raise PolicyError(f"{p}max_step_up and {p}step_down must be >= 1")
        for name in ("scale_up_cooldown_s", "scale_down_cooldown_s", "stabilization_window_s"):
            if getattr(self, name) < 0:
                raise PolicyError(f"{p}{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.scale_down_ratio < 1:
            raise PolicyError(f"{p}scale_down_ratio must be in (0, 1), got {self.scale_down_ratio}")
        if not self.targets:
            raise PolicyError(f"{p}targets: give at least one of {', '.join(TARGETS[role])}")
        for name, value in self.targets.items():
            if name not in TARGETS[role]:
                raise PolicyError(f"unknown target {p}targets.{name} (known: {', '.join(TARGETS[role])})")
            if not _number(value) or value <= 0:
                raise PolicyError(f"{p}targets.{name} must be a positive number, got {value!r}")
            if name == "kv_utilization" and value > 1:
                raise PolicyError(f"{p}targets.kv_utilization is a fraction of KV blocks (0, 1], got {value}")


@dataclass(frozen=True)
class Policy:
    prefill: PoolPolicy
    decode: PoolPolicy
    interval_s: float = 10.0  # how often the loop decides

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise PolicyError(f"interval_s must be > 0, got {self.interval_s}")
        self.prefill.check("prefill")
        self.decode.check("decode")

    def pool(self, role: str) -> PoolPolicy:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class PoolDecision:
    role: str
    action: Action
    delta: int  # workers to add (> 0) or drain (< 0); 0 with HOLD
    reason: str


@dataclass(frozen=True)
class Decision:
    prefill: PoolDecision
    decode: PoolDecision

    def pools(self) -> tuple[PoolDecision, PoolDecision]:
        return self.prefill, self.decode


@dataclass(frozen=True)
class ScaleState:
    """When each pool last grew or shrank (``None``: never). Update with :meth:`after`."""
    last_up: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(ROLES))
    last_down: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(ROLES))

    def after(self, decision: Decision, now: float) -> ScaleState:
        up, down = dict(self.last_up), dict(self.last_down)
        for d in decision.pools():
            if d.action is Action.ADD:
                up[d.role] = now
            elif d.action is Action.DRAIN:
                down[d.role] = now
        return replace(self, last_up=up, last_down=down)


def decide(policy: Policy, window: Sequence[Mapping[str, Any]], sizes: Mapping[str, int], state: ScaleState,
           now: float) -> Decision:
    """The decision for both pools. ``window``: metric samples ``{"t": seconds, <metric>: value | None, ...}`` in
    time order (a missing or None metric gives no signal); ``sizes``: current workers per role (draining ones
    excluded). Pure: reads its arguments only."""
    assert all(window[i]["t"] <= window[i + 1]["t"] for i in range(len(window) - 1)), "window must be in time order"
    return Decision(*(_decide_pool(role, policy.pool(role), window, sizes[role], state, now) for role in ROLES))


def _decide_pool(role: str, pp: PoolPolicy, window: Sequence[Mapping[str, Any]], n: int, state: ScaleState,
                 now: float) -> PoolDecision:
    def hold(reason: str) -> PoolDecision:
        return PoolDecision(role, Action.HOLD, 0, reason)

    if n < pp.min_workers:
        return PoolDecision(role, Action.ADD, pp.min_workers - n, f"below min_workers {pp.min_workers}")
    if n > pp.max_workers:
        return PoolDecision(role, Action.DRAIN, pp.max_workers - n, f"above max_workers {pp.max_workers}")
    if not window:
        return hold("no metrics")
    ratios = {name: r for name in pp.targets if (r := _ratio(window[-1], name, pp, n)) is not None}
    breach = max(ratios, key=ratios.__getitem__, default=None)
    last_change = max((t for t in (state.last_up[role], state.last_down[role]) if t is not None), default=None)
    if breach is not None and ratios[breach] > 1:
        why = f"{breach} {window[-1][breach]} > {pp.targets[breach]}"
        if n >= pp.max_workers:
            return hold(f"{why} but at max_workers {pp.max_workers}")
        if last_change is not None and now - last_change < pp.scale_up_cooldown_s:
            return hold(f"{why}; cooldown: {pp.scale_up_cooldown_s - (now - last_change):.0f} s left")
        step = min(max(1, math.ceil(n * ratios[breach]) - n), pp.max_step_up, pp.max_workers - n)
        return PoolDecision(role, Action.ADD, step, why)
    return _maybe_drain(role, pp, window, n, state, now, hold)


def _maybe_drain(role: str, pp: PoolPolicy, window: Sequence[Mapping[str, Any]], n: int, state: ScaleState,
                 now: float, hold: Callable[[str], PoolDecision]) -> PoolDecision:
    if n <= pp.min_workers:
        return hold("within targets")
    start = now - pp.stabilization_window_s
    if window[0]["t"] > start:
        return hold("within targets; window shorter than stabilization_window_s")
    last_up, last_down = state.last_up[role], state.last_down[role]
    if last_up is not None and last_up > start:
        return hold("within targets; scaled up inside the stabilization window")
    if last_down is not None and now - last_down < pp.scale_down_cooldown_s:
        return hold("within targets; scale-down cooldown")
    recent = [s for s in window if s["t"] >= start]
    for name in pp.targets:
        seen = [r for s in recent if (r := _ratio(s, name, pp, n)) is not None]
        if not seen or max(seen) >= pp.scale_down_ratio:
            return hold(f"within targets; {name} not below {pp.scale_down_ratio:g} x target for the whole window")
    step = min(pp.step_down, n - pp.min_workers)
    return PoolDecision(role, Action.DRAIN, -step,
                        f"all targets below {pp.scale_down_ratio:g} x for {pp.stabilization_window_s:.0f} s")


def _ratio(sample: Mapping[str, Any], name: str, pp: PoolPolicy, n: int) -> float | None:
    value = sample.get(name)
    if value is None:
        return None
    per = value / max(n, 1) if name in PER_WORKER else value
    return per / pp.targets[name]


# ------------------------------------------------------------------------------------------------------ loading
def load_policy(path: str | Path) -> Policy:
    """The policy in a YAML/JSON file (``interval_s``, ``prefill:`` and ``decode:`` :class:`PoolPolicy` fields);
    raises :class:`PolicyError` naming the file and field."""
    p = Path(path)
    if not p.is_file():
        raise PolicyError(f"autoscaling policy not found: {p}")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise PolicyError(f"{p}: cannot parse: {str(e).splitlines()[0]}") from None
    try:
        return policy_from_dict(data)
    except PolicyError as e:
        raise PolicyError(f"{p}: {e}") from None


def policy_from_dict(data: Any) -> Policy:
    if not isinstance(data, dict):
        raise PolicyError("the top level must be a mapping with prefill: and decode:")
    _known(data, ("interval_s", *ROLES), "")
    pools = {}
    for role in ROLES:
        raw = data.get(role)
        if not isinstance(raw, dict):
            raise PolicyError(f"{role}: must be a mapping of pool settings")
        _known(raw, [f.name for f in fields(PoolPolicy)], f"{role}.")
        for key, value in raw.items():
            want_int = key in ("min_workers", "max_workers", "max_step_up", "step_down")
            if key == "targets":
                if not isinstance(value, dict):
                    raise PolicyError(f"{role}.targets: must be a mapping of metric -> target")
            elif not _number(value) or (want_int and not isinstance(value, int)):
                raise PolicyError(f"{role}.{key}: expected {'an integer' if want_int else 'a number'}, "
                                  f"got {value!r}")
        pools[role] = PoolPolicy(**raw)
    interval = data.get("interval_s", 10.0)
    if not _number(interval):
        raise PolicyError(f"interval_s: expected a number, got {interval!r}")
    return Policy(interval_s=float(interval), **pools)


def _known(d: dict, names: Sequence[str], prefix: str) -> None:
    for key in d:
        if key not in names:
            raise PolicyError(f"unknown setting {prefix}{key} (known: {', '.join(names)})")


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


# ------------------------------------------------------------------------------------------------------ the loop
class PoolHooks(Protocol):
    """What :class:`Autoscaler` needs from a cluster. ``add_worker`` starts one worker of ``role`` (its Ray resource
    request, e.g. ``{"duet_decode": 1}``, makes the Ray autoscaler add a node when none has room) and returns its id;
    ``drain_worker`` stops routing new requests to one worker of ``role`` and removes it once its running requests
    finish (it returns at once with the worker's id). ``pool_sizes`` counts workers not draining, including dead
    ones the pool healer is replacing (:mod:`cluster.control.pool_healer`), so a replacement is never doubled by an ADD."""

    def pool_sizes(self) -> dict[str, int]: ...
    def add_worker(self, role: str) -> str: ...
    def drain_worker(self, role: str) -> str: ...


class Autoscaler:
    """Every ``policy.interval_s``: read a metrics window, :func:`decide`, apply the decision through the hooks."""

    def __init__(self, policy: Policy, hooks: PoolHooks, metrics: Callable[[], Sequence[Mapping[str, Any]]], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy, self.hooks, self.metrics, self.clock = policy, hooks, metrics, clock
        self.state = ScaleState()
        self.history: list[tuple[float, Decision]] = []  # decisions that changed something
        self._stop = threading.Event()

    def step(self) -> Decision:
        now = self.clock()
        decision = decide(self.policy, self.metrics(), self.hooks.pool_sizes(), self.state, now)
        for d in decision.pools():
            for _ in range(abs(d.delta)):
                (self.hooks.add_worker if d.action is Action.ADD else self.hooks.drain_worker)(d.role)
        self.state = self.state.after(decision, now)
        if any(d.action is not Action.HOLD for d in decision.pools()):
            self.history.append((now, decision))
        return decision

    def run(self) -> None:
        """Loop until :meth:`stop` (run it on a thread)."""
        while not self._stop.wait(self.policy.interval_s):
            self.step()

    def stop(self) -> None:
        self._stop.set()
