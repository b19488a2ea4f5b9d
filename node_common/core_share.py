"""Threads that grow and shrink: how many of this worker's cores the rest of the machine is using right now.

A prefill worker that shares a small host with decode workers runs at a lower priority (``nice``) so decode steps go
first. With all its OpenMP threads it then loses twice whenever a decode step holds a core: the thread on that core
waits, and every parallel region waits for that thread (measured on 2 cores, a 256-token prefill beside a decoding
worker: 78 ms with two threads, 67 ms with one; 40 ms with two on an idle host). :class:`CoreShare` reads how busy the
machine's cores were since its last reading, less this process's own use (Linux ``/proc/stat`` and
``/proc/self/stat``), and :meth:`CoreShare.threads` gives the worker ``num_threads`` less the cores others kept
busy, at least one. Where ``/proc`` is not readable it always answers ``num_threads``.
"""

from __future__ import annotations

import os
import time

MIN_WINDOW_S = 0.02  # readings closer together than this reuse the last answer (the clock ticks are 10 ms)
BUSY_SHARE = 0.5  # a core counts as taken when others kept it busy for at least this share of the window


def _machine_busy_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all cores since boot, or None where ``/proc/stat`` is not readable."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
    if len(ticks) < 5:
        return None
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def _own_ticks() -> int | None:
    """This process's user + system clock ticks (all its threads)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # after the command name, which may hold spaces
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of the whole line)


class CoreShare:
    """``CoreShare(num_threads)``: :meth:`threads` before each step; ``last_others`` is the last reading (cores
    others kept busy, a float)."""

    def __init__(self, num_threads: int) -> None:
        self.num_threads = max(1, num_threads)
        self.cores = os.cpu_count() or 1
        self.last_others = 0.0
        self._answer = self.num_threads
        self._last = self._read()  # (monotonic, busy, total, own) at the last reading, None without /proc

    def _read(self) -> tuple[float, int, int, int] | None:
        machine, own = _machine_busy_ticks(), _own_ticks()
        if machine is None or own is None:
            return None
        return time.monotonic(), machine[0], machine[1], own

    def threads(self) -> int:
        """Threads for the next step: ``num_threads`` less the cores the rest of the machine kept busy (each at
        least :data:`BUSY_SHARE` of the window since the last reading), at least one."""
        if self.num_threads == 1:
            return 1
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < MIN_WINDOW_S:
            return self._answer
        reading = self._read()
        if reading is None:
            return self.num_threads
        if self._last is not None:
            _, busy0, total0, own0 = self._last
            _, busy1, total1, own1 = reading
            if total1 > total0:
                cores_in_window = (total1 - total0) / self.cores  # ticks of one core over the window
                others = max(0.0, (busy1 - busy0) - (own1 - own0)) / cores_in_window
                self.last_others = others
                taken = int(others + 1.0 - BUSY_SHARE)  # cores others kept busy for BUSY_SHARE of the window or more
                self._answer = max(1, min(self.num_threads, self.cores - taken))
        self._last = reading
        return self._answer
