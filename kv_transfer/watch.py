"""Deadline enforcement: one thread per manager fails transfers whose lease deadline passed.

``poll()`` and ``wait()`` also apply the deadline themselves; the watch makes it happen when nobody is polling
(so the peer is told and the transfer leaves its manager's tables on time).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
import weakref
from typing import Protocol


class Expirable(Protocol):
    @property
    def next_check_s(self) -> float: ...

    @property
    def terminal(self) -> bool: ...

    def poll(self) -> object: ...


class DeadlineWatch:
    """``add(transfer)``: at ``transfer.next_check_s`` (wall clock; its deadline, or sooner while its deadline may
    still move) the watch calls ``transfer.poll()``, which fails it with TransferTimeout once its deadline passed;
    a transfer neither terminal nor expired is looked at again at its next check. Holds only weak references.
    ``close()`` stops the thread."""

    def __init__(self, name: str = "kv-deadline") -> None:
        self._heap: list[tuple[float, int, weakref.ref]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, transfer: Expirable) -> None:
        with self._cond:
            heapq.heappush(self._heap, (transfer.next_check_s, next(self._seq), weakref.ref(transfer)))
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    now = time.time()
                    if self._heap and self._heap[0][0] <= now:
                        break
                    self._cond.wait(min(1.0, self._heap[0][0] - now) if self._heap else 1.0)
                if self._closed:
                    return
                due = []
                while self._heap and self._heap[0][0] <= time.time():
                    due.append(heapq.heappop(self._heap)[2])
            for ref in due:
                transfer = ref()
                if transfer is not None:
                    transfer.poll()
                    if not transfer.terminal:  # a start-counted lease: its deadline moved when it started
                        self.add(transfer)
