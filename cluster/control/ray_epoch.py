"""This process's Ray driver across a re-initialisation (``duet serve`` after its head restarted as a new cluster,
:mod:`cluster.serve.head_watch`).

``ray.shutdown()`` destroys the driver's core worker under any thread still inside a Ray call (a metrics refresh, an
expert router's round, a replacement worker's start-up wait), and a handle of the old driver used on the new one
reaches freed memory: either ends the process with a SIGSEGV. So every Ray call made off the main thread runs inside
:meth:`DriverEpoch.use` with the epoch its object was built in: :meth:`DriverEpoch.end` refuses new calls of the
current epoch and waits (bounded) for those under way, and only then may the driver be shut down. A call of an ended
epoch raises :class:`~cluster.control.errors.ClusterUnavailableError` (retryable) instead of touching Ray.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from cluster.control.errors import ClusterUnavailableError

T = TypeVar("T")


class DriverEpoch:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._epoch = 0
        self._open = True
        self._calls = 0  # Ray calls of the current epoch under way

    @property
    def current(self) -> int:
        with self._cond:
            return self._epoch

    @contextmanager
    def use(self, epoch: int) -> Iterator[None]:
        """Run the body as a Ray call of ``epoch``; raises ClusterUnavailableError when that epoch has ended."""
        with self._cond:
            if not self._open or epoch != self._epoch:
                raise ClusterUnavailableError("this cluster's Ray driver was shut down (the head restarted)")
            self._calls += 1
        try:
            yield
        finally:
            with self._cond:
                self._calls -= 1
                self._cond.notify_all()

    def end(self, timeout_s: float) -> bool:
        """Refuse new calls of the current epoch and wait up to ``timeout_s`` for those under way; True when none
        is left (the driver may then be shut down). Calling it again on an ended epoch waits again."""
        with self._cond:
            self._open = False
            return self._cond.wait_for(lambda: self._calls == 0, timeout=timeout_s)

    def begin(self) -> int:
        """A new epoch, after the driver was initialised again; returns it."""
        with self._cond:
            assert not self._open and self._calls == 0, "begin() follows a drained end()"
            self._epoch += 1
            self._open = True
            return self._epoch


EPOCH = DriverEpoch()


def ray_call(fn: Callable[..., T]) -> Callable[..., T]:
    """Run a method (or a function of an object) as a Ray call of its first argument's ``epoch``."""
    @functools.wraps(fn)
    def wrapper(owner: Any, *args: Any, **kwargs: Any) -> T:
        with EPOCH.use(owner.epoch):
            return fn(owner, *args, **kwargs)

    return wrapper
