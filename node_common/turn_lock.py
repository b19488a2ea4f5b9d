"""The lock between a worker actor's loop thread and its method calls, with turns.

A worker actor's loop holds its lock for a whole engine step (a decode step: tens of ms; a prefill step: up to
seconds) and takes it again at once for the next one. A plain ``threading.Lock`` is not fair: a method call
(``allocate``, ``submit``, ``abort``) blocked on it is woken when the step ends, but the loop thread usually takes the
lock back first, so the call can wait several steps -- time a request's first token pays. :class:`TurnLock` counts
the threads waiting to acquire it; the loop calls :meth:`TurnLock.give_way` between steps (not holding the lock),
which returns once every thread that was waiting has had the lock (or after ``timeout_s``), so a call waits for at
most the step in progress.

Example: a decode step of 25 ms runs when ``allocate`` arrives 5 ms into it; with a plain lock it returned after 45
ms (the loop won the race once); with turns, after the step's remaining 20 ms.
"""

from __future__ import annotations

import threading


class TurnLock:
    """A mutex (``with lock:``) whose loop thread gives way to waiting callers (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cv = threading.Condition(threading.Lock())
        self._waiting = 0  # threads inside acquire()

    def acquire(self) -> bool:
        with self._cv:
            self._waiting += 1
        try:
            return self._lock.acquire()
        finally:
            with self._cv:
                self._waiting -= 1
                self._cv.notify_all()

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> TurnLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @property
    def waiting(self) -> int:
        """Threads blocked in :meth:`acquire` now."""
        return self._waiting

    def give_way(self, timeout_s: float = 0.1) -> bool:
        """Wait (not holding the lock) until no thread is waiting to acquire it, at most ``timeout_s``; returns
        whether none is. Returns at once when none was waiting."""
        with self._cv:
            return self._cv.wait_for(lambda: self._waiting == 0, timeout=timeout_s)
