"""Self-healing worker pools: a dead worker is replaced by a fresh actor of the same role and config, with backoff,
until it keeps dying.

Two parts:

* :func:`decide` -- pure: (the death times of one *slot*, :class:`HealPolicy`, now) -> :class:`Verdict`
  (respawn now / wait until ``at`` / give up). A slot is what a replacement inherits: a plain worker's lineage (the
  worker id it started as), or a whole expert-parallel decode group (``ep-<g>``: its members are re-formed
  together). A failed start of the replacement counts as one more death.
* :class:`PoolHealer` -- the monitor on the front-end's event loop. Deaths reach it three ways: a decode worker's
  failed poll (:meth:`PoolHealer.report_death`), any code path that marked a worker dead (``load.alive`` False: a
  request's failed ``allocate`` / ``submit``; seen by a scan every ``scan_s``), and a health ``ping`` that raises or
  does not answer within ``ping_timeout_s`` (every ``ping_interval_s``). Each slot heals in its own task; every
  await has a deadline (``ping_timeout_s``, ``start_timeout_s``).

Worked example (defaults: ``max_deaths=3``, ``window_s=60``, ``backoff_s=0.5``, ``backoff_max_s=8``): a worker dies
at t=0 -> ``decide([0], now=0)`` = WAIT until 0.5 (backoff 0.5 x 2**0); at t=0.5 RESPAWN. The replacement dies at
t=10 -> ``decide([0, 10], now=10)`` = WAIT until 11 (0.5 x 2**1). It dies again at t=20 -> three deaths inside 60 s:
GIVE_UP; the slot stays dead, ``ClusterStatus`` shows the worker ``alive=False`` (``given_up``), the metrics count
the two respawns and flag the role, and the log says why. A death at t=100 after deaths at 0 and 10 sees only one
recent death: WAIT until 100.5.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

from cluster.control.bounded import bounded
from engine.errors import InvalidRequestError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealPolicy:
    """When a dead worker is replaced. ``max_deaths`` deaths of one slot inside ``window_s`` give it up (0: never
    respawn); the n-th recent death waits ``backoff_s * 2**(n-1)`` (at most ``backoff_max_s``) before the respawn."""

    max_deaths: int = 3
    window_s: float = 60.0
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    ping_interval_s: float = 2.0  # health pings of every live worker
    ping_timeout_s: float = 10.0  # a ping not answered by then is a death
    start_timeout_s: float = 300.0  # a replacement (or re-formed group) that is not serving by then is a death
    scan_s: float = 0.25  # how often workers marked dead elsewhere are picked up

    def __post_init__(self) -> None:
        if self.max_deaths < 0:
            raise InvalidRequestError(f"respawn max_deaths must be >= 0, got {self.max_deaths}")
        for name in ("window_s", "ping_interval_s", "ping_timeout_s", "start_timeout_s", "scan_s"):
            if getattr(self, name) <= 0:
                raise InvalidRequestError(f"respawn {name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.backoff_s <= self.backoff_max_s:
            raise InvalidRequestError(f"respawn backoff: need 0 <= backoff_s <= backoff_max_s, got "
                                      f"{self.backoff_s}/{self.backoff_max_s}")


class HealAction(IntEnum):
    RESPAWN = 0
    WAIT = 1  # until Verdict.at
    GIVE_UP = 2


@dataclass(frozen=True)
class Verdict:
    action: HealAction
    at: float  # when to respawn (WAIT / RESPAWN); the time of the decision for GIVE_UP
    reason: str


def decide(deaths: Sequence[float], policy: HealPolicy, now: float) -> Verdict:
    """What to do for a slot whose worker died at ``deaths`` (times in order, the latest last, at least one).
    Pure. Deaths older than ``policy.window_s`` are forgotten."""
    assert deaths and all(deaths[i] <= deaths[i + 1] for i in range(len(deaths) - 1)), deaths
    recent = [t for t in deaths if now - t < policy.window_s]
    if len(recent) >= policy.max_deaths:
        return Verdict(HealAction.GIVE_UP, now, f"died {len(recent)} times in {policy.window_s:.0f} s")
    n = max(1, len(recent))
    at = deaths[-1] + min(policy.backoff_max_s, policy.backoff_s * 2 ** (n - 1))
    if now >= at:
        return Verdict(HealAction.RESPAWN, at, f"death {n} in {policy.window_s:.0f} s")
    return Verdict(HealAction.WAIT, at, f"death {n} in {policy.window_s:.0f} s: backoff {at - now:.1f} s")


class HealHooks(Protocol):
    """What :class:`PoolHealer` needs from a cluster (all called on the front-end loop)."""

    def heal_members(self) -> list[tuple[str, Any]]:
        """``(role, worker)`` for every worker that should be serving (live or dead; not draining, not closing)."""
        ...

    def group_of(self, worker_id: str) -> str | None:
        """The expert-parallel group (``ep-<g>``) the worker belongs to, or None."""
        ...

    async def replace_dead(self, slot: str, role: str, dead: Any) -> list[tuple[str, str]]:
        """Start the replacement(s) of ``dead`` (its group's members for a group slot), wait until serving, route to
        them; returns ``(old worker id, new worker id)`` pairs. Raises when they could not start."""
        ...


class PoolHealer:
    """Watches the pools and replaces dead workers (see the module docstring). :meth:`run` on the front-end loop."""

    def __init__(self, policy: HealPolicy, hooks: HealHooks, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy, self.hooks, self.clock = policy, hooks, clock
        self.deaths: dict[str, list[float]] = {}  # slot -> death times
        self.respawns: dict[str, int] = {"prefill": 0, "decode": 0}  # replacements started, per role
        self.given_up: dict[str, tuple[str, str]] = {}  # worker id -> (role, why)
        self._slot: dict[str, str] = {}  # worker id -> its lineage slot (absent: the worker id itself)
        self._known_dead: set[str] = set()  # worker ids already reported (or retired by a group re-form)
        self._healing: dict[str, asyncio.Task] = {}  # slot -> its heal task

    # ------------------------------------------------------------------------------------------------- inputs
    def slot_of(self, worker_id: str) -> str:
        return self.hooks.group_of(worker_id) or self._slot.get(worker_id, worker_id)

    def retire(self, worker_id: str) -> None:
        """``worker_id`` is being shut down on purpose (a group re-form): its death is not a death."""
        self._known_dead.add(worker_id)

    def report_death(self, role: str, worker: Any, why: str) -> None:
        """``worker`` is dead (or unresponsive): mark it, count the death, and heal its slot unless already."""
        wid = worker.load.worker_id
        worker.load.alive = False
        if wid in self._known_dead:
            return
        self._known_dead.add(wid)
        slot = self.slot_of(wid)
        logger.error("%s worker %s died (%s)", role, wid, why)
        if slot in self._healing:  # one event: another member of a group being re-formed
            return
        self.deaths.setdefault(slot, []).append(self.clock())
        self._healing[slot] = asyncio.get_running_loop().create_task(self._heal(slot, role, worker))

    # ------------------------------------------------------------------------------------------------- report
    def state_of(self, worker_id: str) -> str | None:
        """``"respawning"`` or ``"given_up"`` for a dead worker the healer knows, else None."""
        if worker_id in self.given_up:
            return "given_up"
        if worker_id in self._known_dead and self.slot_of(worker_id) in self._healing:
            return "respawning"
        return None

    def pending(self, role: str) -> int:
        """Workers of ``role`` dead and about to be replaced (the autoscaler counts them as members)."""
        return sum(1 for _, w in self._dead_members(role) if self.state_of(w.load.worker_id) == "respawning")

    def summary(self) -> dict:
        """``{"respawns": {role: n}, "given_up": {role: [worker ids]}, "respawning": [worker ids]}``."""
        given = {"prefill": [], "decode": []}
        for wid, (role, _) in self.given_up.items():
            given[role].append(wid)
        respawning = [w.load.worker_id for role in given for _, w in self._dead_members(role)
                      if self.state_of(w.load.worker_id) == "respawning"]
        return {"respawns": dict(self.respawns), "given_up": given, "respawning": respawning}

    def _dead_members(self, role: str) -> list[tuple[str, Any]]:
        return [(r, w) for r, w in self.hooks.heal_members() if r == role and not w.load.alive]

    # ------------------------------------------------------------------------------------------------- the loop
    async def run(self) -> None:
        """Scan for workers marked dead every ``scan_s``; ping every live worker every ``ping_interval_s``."""
        next_ping = self.clock() + self.policy.ping_interval_s
        while True:
            for role, w in self.hooks.heal_members():
                if not w.load.alive and w.load.worker_id not in self._known_dead:
                    self.report_death(role, w, "marked dead by a request")
            if self.clock() >= next_ping:
                await self._ping_all()
                next_ping = self.clock() + self.policy.ping_interval_s
            await asyncio.sleep(self.policy.scan_s)

    async def stop(self) -> None:
        for t in list(self._healing.values()):
            t.cancel()
        await asyncio.gather(*self._healing.values(), return_exceptions=True)

    async def _ping_all(self) -> None:
        live = [(role, w) for role, w in self.hooks.heal_members() if w.load.alive]
        results = await asyncio.gather(*(self._ping(w) for _, w in live), return_exceptions=True)
        for (role, w), r in zip(live, results, strict=True):
            if isinstance(r, BaseException) and w.load.alive:  # alive: not retired while the ping was out
                why = "no answer to a health ping" if isinstance(r, asyncio.TimeoutError) else f"ping failed: {r}"
                self.report_death(role, w, why)

    async def _ping(self, w: Any) -> None:
        async def call():
            return await w.actor.ping.remote()

        await bounded(call(), timeout=self.policy.ping_timeout_s)

    async def _heal(self, slot: str, role: str, dead: Any) -> None:
        try:
            while True:
                v = decide(self.deaths[slot], self.policy, self.clock())
                if v.action is HealAction.GIVE_UP:
                    self._give_up(slot, role, dead, v.reason)
                    return
                if v.action is HealAction.WAIT:
                    await asyncio.sleep(v.at - self.clock())
                    continue
                try:
                    pairs = await bounded(self.hooks.replace_dead(slot, role, dead),
                                          timeout=self.policy.start_timeout_s)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - a replacement that cannot start is one more death
                    logger.error("replacement for %s (%s) did not start: %s", dead.load.worker_id, slot, e)
                    self.deaths[slot].append(self.clock())
                    continue
                for old, new in pairs:
                    self._slot[new] = self._slot.get(old, old)
                self.respawns[role] += len(pairs)
                logger.warning("respawned %s: %s", slot, ", ".join(f"{o} -> {n}" for o, n in pairs))
                return
        finally:
            self._healing.pop(slot, None)

    def _give_up(self, slot: str, role: str, dead: Any, why: str) -> None:
        dead_ids = [w.load.worker_id for r, w in self.hooks.heal_members()
                    if r == role and not w.load.alive and self.slot_of(w.load.worker_id) == slot]
        for wid in dead_ids or [dead.load.worker_id]:
            self.given_up[wid] = (role, why)
        logger.error("giving up on %s worker slot %s (%s): not respawned again; the %s pool stays %d short",
                     role, slot, why, role, len(dead_ids) or 1)
