"""The pool healer: the pure respawn policy (worked examples) and the monitor over fake workers (no Ray)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from cluster.control.pool_healer import HealAction, HealPolicy, PoolHealer, decide
from engine.errors import InvalidRequestError

P = HealPolicy()  # 3 deaths in 60 s give up; backoff 0.5 s doubling, at most 8 s


def test_first_death_waits_one_backoff_then_respawns():
    assert decide([0.0], P, now=0.0).action is HealAction.WAIT
    assert decide([0.0], P, now=0.0).at == pytest.approx(0.5)
    assert decide([0.0], P, now=0.5).action is HealAction.RESPAWN


def test_backoff_doubles_with_recent_deaths_and_is_capped():
    v = decide([0.0, 10.0], P, now=10.0)
    assert v.action is HealAction.WAIT and v.at == pytest.approx(11.0)
    capped = HealPolicy(max_deaths=10, backoff_s=1.0, backoff_max_s=3.0)
    assert decide([0.0, 1.0, 2.0, 3.0, 4.0], capped, now=4.0).at == pytest.approx(7.0)  # 1 x 2**4 -> 3


def test_third_death_in_a_minute_gives_up():
    v = decide([0.0, 10.0, 20.0], P, now=20.0)
    assert v.action is HealAction.GIVE_UP and "3 times in 60 s" in v.reason


def test_old_deaths_are_forgotten():
    v = decide([0.0, 10.0, 100.0], P, now=100.0)  # only one death in the last minute
    assert v.action is HealAction.WAIT and v.at == pytest.approx(100.5)


def test_zero_max_deaths_never_respawns():
    assert decide([5.0], HealPolicy(max_deaths=0), now=5.0).action is HealAction.GIVE_UP


@pytest.mark.parametrize("kwargs", [dict(max_deaths=-1), dict(window_s=0), dict(backoff_s=2, backoff_max_s=1),
                                    dict(ping_timeout_s=0)], ids=["deaths", "window", "backoff", "ping"])
def test_bad_policy_is_a_config_error(kwargs):
    with pytest.raises(InvalidRequestError):
        HealPolicy(**kwargs)


def test_cluster_spec_carries_the_knobs(tiny_model_dir):
    from cluster.control.spec import ClusterSpec

    spec = ClusterSpec(model_dir=str(tiny_model_dir), respawn_max_deaths=5, respawn_window_s=30)
    assert spec.heal_policy().max_deaths == 5 and spec.heal_policy().window_s == 30
    with pytest.raises(InvalidRequestError):
        ClusterSpec(model_dir=str(tiny_model_dir), respawn_window_s=0)


# --------------------------------------------------------------------------------------- the monitor, fake pools
@dataclass
class _Load:
    worker_id: str
    alive: bool = True


class _Actor:
    def __init__(self, answers: bool = True) -> None:
        self.answers = answers
        self.ping = self

    def remote(self):
        async def pong():
            if not self.answers:
                await asyncio.sleep(3600)  # hung: only the ping deadline ends this
            return b""

        return pong()


@dataclass
class _W:
    load: _Load
    actor: _Actor = field(default_factory=_Actor)


class _Pools:
    """Heal hooks over a list of fake workers; ``fail_starts`` replacements fail to start."""

    def __init__(self, n: int, fail_starts: int = 0) -> None:
        self.pool = [("prefill", _W(_Load(f"prefill-{i}"))) for i in range(n)]
        self.fail_starts, self.next = fail_starts, n

    def heal_members(self):
        return list(self.pool)

    def group_of(self, worker_id):
        return None

    async def replace_dead(self, slot, role, dead):
        if self.fail_starts:
            self.fail_starts -= 1
            raise RuntimeError("replacement died at start")
        new = _W(_Load(f"prefill-{self.next}"))
        self.next += 1
        i = [w for _, w in self.pool].index(dead)
        self.pool[i] = (role, new)
        return [(dead.load.worker_id, new.load.worker_id)]


FAST = HealPolicy(backoff_s=0.01, backoff_max_s=0.05, ping_interval_s=0.05, ping_timeout_s=0.2, scan_s=0.01,
                  start_timeout_s=1.0)


async def _until(pred, timeout_s: float = 5.0) -> None:
    async def wait():
        while not pred():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(wait(), timeout_s)


def test_monitor_replaces_a_worker_marked_dead_and_a_hung_one():
    async def main():
        pools = _Pools(2)
        healer = PoolHealer(FAST, pools)
        task = asyncio.create_task(healer.run())
        pools.pool[0][1].load.alive = False  # e.g. a request's submit saw RayActorError
        pools.pool[1][1].actor.answers = False  # never answers its health ping
        await _until(lambda: healer.respawns["prefill"] == 2)
        assert [w.load.worker_id for _, w in pools.pool] == ["prefill-2", "prefill-3"]
        assert healer.slot_of("prefill-2") == "prefill-0" and healer.summary()["given_up"]["prefill"] == []
        task.cancel()

    asyncio.run(main())


def test_monitor_gives_up_on_a_crash_loop_and_counts_pending():
    async def main():
        pools = _Pools(1, fail_starts=5)  # every replacement dies at start
        healer = PoolHealer(FAST, pools)
        task = asyncio.create_task(healer.run())
        dead = pools.pool[0][1]
        healer.report_death("prefill", dead, "killed")
        assert healer.pending("prefill") == 1 and healer.state_of("prefill-0") == "respawning"
        await _until(lambda: healer.given_up)
        assert healer.state_of("prefill-0") == "given_up" and healer.pending("prefill") == 0
        assert healer.summary() == {"respawns": {"prefill": 0, "decode": 0}, "given_up": {"prefill": ["prefill-0"],
                                    "decode": []}, "respawning": []}
        assert len(healer.deaths["prefill-0"]) == 3  # the death, then two failed starts
        healer.report_death("prefill", dead, "reported again")  # a late report changes nothing
        assert len(healer.deaths["prefill-0"]) == 3
        task.cancel()

    asyncio.run(main())
