"""The worker actors' lock with turns (:mod:`node_common.turn_lock`): a call waiting while the loop steps gets the
lock before the loop's next step."""

from __future__ import annotations

import threading
import time

from node_common.turn_lock import TurnLock


def _run(lock: TurnLock, give_way: bool) -> tuple[int, int]:
    """A loop of 5 ms 'steps' holding the lock; a caller arrives during one of the first. Returns (steps that ended
    between the caller's arrival and its getting the lock, steps in all). The arrival is counted where the caller
    asks, not where it meant to: on a busy host its thread can wake a step or two late."""
    steps, got_at = 0, []
    stop = threading.Event()

    def loop() -> None:
        nonlocal steps
        while not stop.is_set():
            with lock:
                time.sleep(0.005)
                steps += 1
            if give_way:
                lock.give_way(1.0)

    t = threading.Thread(target=loop)
    t.start()
    time.sleep(0.002)
    arrived = steps
    with lock:
        got_at.append(steps - arrived)
    time.sleep(0.03)
    stop.set()
    t.join(5)
    return got_at[0], steps


def test_a_waiting_call_goes_before_the_next_step():
    lock = TurnLock()
    for _ in range(5):  # each time: the call waits for the step in progress only
        got, total = _run(lock, give_way=True)
        assert got <= 1 and total > 2, (got, total)
    assert lock.waiting == 0 and lock.give_way(0.0)


def test_give_way_returns_at_once_with_no_one_waiting_and_times_out_otherwise():
    lock = TurnLock()
    t0 = time.monotonic()
    assert lock.give_way(5.0) and time.monotonic() - t0 < 1.0
    lock.acquire()
    waiter = threading.Thread(target=lambda: (lock.acquire(), lock.release()))
    waiter.start()
    while lock.waiting == 0:
        time.sleep(0.001)
    assert not lock.give_way(0.05)  # the waiter cannot get it while this thread holds it
    lock.release()
    waiter.join(5)
    assert lock.waiting == 0
