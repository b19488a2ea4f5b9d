"""Threads that grow and shrink (:mod:`node_common.core_share`): a worker sharing its cores gets every thread while
the rest of the machine is idle and fewer while others keep cores busy; never fewer than one."""

from __future__ import annotations

import pytest

from node_common import core_share
from node_common.core_share import CoreShare


class FakeProc:
    """Stands in for /proc: the machine's busy / total ticks and this process's own, advanced by hand."""

    def __init__(self, monkeypatch, cores: int) -> None:
        self.busy = self.total = self.own = 0
        self.now = 100.0
        monkeypatch.setattr(core_share, "_machine_busy_ticks", lambda: (self.busy, self.total))
        monkeypatch.setattr(core_share, "_own_ticks", lambda: self.own)
        monkeypatch.setattr(core_share.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(core_share.os, "cpu_count", lambda: cores)
        self.cores = cores

    def advance(self, seconds: float, *, others: float, own: float) -> None:
        """``seconds`` pass with ``others`` cores kept busy by other processes and ``own`` by this one."""
        ticks = seconds * 100
        self.now += seconds
        self.total += int(ticks * self.cores)
        self.busy += int(ticks * (others + own))
        self.own += int(ticks * own)


@pytest.mark.parametrize("cores, threads, others, want", [
    (2, 2, 0.0, 2),   # idle machine: every thread
    (2, 2, 0.2, 2),   # a little background work: still both
    (2, 2, 0.9, 1),   # a decode worker stepping: one
    (2, 2, 2.0, 1),   # both cores taken: still one
    (8, 4, 5.0, 3),   # 5 of 8 cores taken: the 3 left
    (8, 4, 1.0, 4),   # plenty left: all 4 asked for
])
def test_threads_follow_what_the_others_leave(monkeypatch, cores, threads, others, want):
    proc = FakeProc(monkeypatch, cores)
    share = CoreShare(threads)
    proc.advance(0.1, others=others, own=min(threads, cores - others) if cores > others else 0.5)
    assert share.threads() == want
    assert share.last_others == pytest.approx(others, abs=0.05)


def test_its_own_threads_do_not_count_against_it(monkeypatch):
    proc = FakeProc(monkeypatch, 2)
    share = CoreShare(2)
    proc.advance(0.1, others=0.0, own=2.0)  # this worker kept both cores busy itself
    assert share.threads() == 2


def test_it_grows_back_and_readings_too_close_reuse_the_answer(monkeypatch):
    proc = FakeProc(monkeypatch, 2)
    share = CoreShare(2)
    proc.advance(0.1, others=1.0, own=1.0)
    assert share.threads() == 1
    proc.advance(0.005, others=0.0, own=0.0)  # under MIN_WINDOW_S: the last answer
    assert share.threads() == 1
    proc.advance(0.1, others=0.0, own=1.0)  # decode went idle
    assert share.threads() == 2


def test_one_thread_or_no_proc_answers_what_was_asked(monkeypatch):
    assert CoreShare(1).threads() == 1
    monkeypatch.setattr(core_share, "_machine_busy_ticks", lambda: None)
    assert CoreShare(4).threads() == 4


def test_the_real_proc_reads():
    share = CoreShare(2)
    assert 1 <= share.threads() <= 2
    assert core_share._machine_busy_ticks() is not None and core_share._own_ticks() >= 0



def test_after_idle_the_next_step_gets_every_thread(monkeypatch):
    """A window spanning the worker's idle time (others busy then: a front-end preparing the request that ends the
    wait) does not hold the next step to fewer threads; the window after it is judged again."""
    proc = FakeProc(monkeypatch, 2)
    share = CoreShare(2)
    proc.advance(0.1, others=0.0, own=2.0)
    assert share.threads() == 2
    share.idle()
    proc.advance(0.5, others=1.0, own=0.0)  # the front-end's burst while this worker waited
    assert share.threads() == 2
    proc.advance(0.1, others=1.0, own=1.0)  # a decode worker stepping beside the step
    assert share.threads() == 1
