"""The driver epoch (:mod:`cluster.control.ray_epoch`): the Ray driver is shut down only once no Ray call of its
epoch is under way, and an object of an ended epoch never reaches the new driver."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.control.errors import ClusterUnavailableError
from cluster.control.ray_epoch import DriverEpoch, ray_call


def test_end_waits_for_calls_under_way_and_refuses_new_ones():
    epoch = DriverEpoch()
    e0 = epoch.current
    inside, release = threading.Event(), threading.Event()

    def call() -> None:
        with epoch.use(e0):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=call)
    t.start()
    assert inside.wait(10)
    assert epoch.end(timeout_s=0.2) is False  # one call still inside: not safe to shut the driver down
    with pytest.raises(ClusterUnavailableError):  # and no new call of the epoch starts meanwhile
        with epoch.use(e0):
            pass
    release.set()
    t.join(10)
    assert epoch.end(timeout_s=5) is True
    e1 = epoch.begin()
    assert e1 == e0 + 1 and epoch.current == e1
    with epoch.use(e1):  # the new epoch's calls run
        pass
    with pytest.raises(ClusterUnavailableError, match="shut down"):  # the old epoch's objects stay refused
        with epoch.use(e0):
            pass


def test_end_returns_once_the_last_call_leaves():
    epoch = DriverEpoch()
    e0 = epoch.current
    started = threading.Barrier(3)

    def call(hold_s: float) -> None:
        with epoch.use(e0):
            started.wait(10)
            time.sleep(hold_s)

    threads = [threading.Thread(target=call, args=(s,)) for s in (0.05, 0.3)]
    for t in threads:
        t.start()
    started.wait(10)
    t0 = time.monotonic()
    assert epoch.end(timeout_s=10) is True
    assert time.monotonic() - t0 >= 0.1  # it waited for the longer call, not only the first to leave
    for t in threads:
        t.join(10)


def test_ray_call_uses_its_owners_epoch():
    from cluster.control import ray_epoch

    class Owner:
        def __init__(self) -> None:
            self.epoch = ray_epoch.EPOCH.current
            self.calls = 0

        @ray_call
        def touch(self, n: int) -> int:
            self.calls += n
            return self.calls

    o = Owner()
    assert o.touch(2) == 2
    o.epoch -= 1  # an object built under an earlier driver
    with pytest.raises(ClusterUnavailableError):
        o.touch(1)
    assert o.calls == 2
