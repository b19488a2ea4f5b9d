"""Threads that grow and shrink: how many of this worker's cores the rest of the machine is using right now.

A prefill worker that shares a small host with decode workers runs at a lower priority (``nice``) so decode steps go
first. With all its OpenMP threads it then loses twice whenever a decode step holds a core: the thread on that core
waits, and every parallel region waits for that thread (measured on 2 cores, a 256-token prefill beside a decoding
worker: 78 ms with two threads, 67 ms with one; 40 ms with two on an idle host). :class:`CoreShare` reads how busy the
machine's cores were since its last reading, less this process's own use (Linux ``/proc/stat`` and
``/proc/self/stat``), and :meth:`CoreShare.threads` gives the worker ``num_threads`` less the cores others kept
busy, at least one. Where ``/proc`` is not readable it always answers ``num_threads``.

Usage says what others did, not what they want: a prefill worker at a lower priority, starved by a decode worker
on every core, would look idle. So decode workers learn whether the prefill workers beside them have work from
:class:`BusyBoard` and take the node's idle cores only while they have none.
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

    def idle(self) -> None:
        """The worker has no work: its next step starts a new window with every thread. A window that spans the
        idle time says what the machine did while nothing was waiting here -- often the front-end preparing the very
        request that ends the wait (a 1024² image: 0.3 s of decoding and resizing) -- not what it does now. (Its
        effect on served figures was not measured apart: the slow vision steps that prompted it turned out to be the
        attention kernel's choice, engine.attention.choose_prefill_kernel.)"""
        self._last = None
        self._answer = self.num_threads

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
        if self._last is None:  # the first reading after idle() (or construction): a window starts here
            self._last = reading
            return self._answer
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


class BusyBoard:
    """Whether the prefill workers that share this node have work, for the decode workers beside them: each prefill
    worker keeps one small file under ``directory`` (its process id and a busy byte), written only when the answer
    changes; a decode worker reads them all (at most every :data:`MIN_WINDOW_S`) before a step. A file whose process
    is gone counts as idle, so a killed prefill worker never holds decode to fewer threads. Same-node only (the
    files live in ``/dev/shm`` where it exists)."""

    def __init__(self, directory: str | os.PathLike, name: str | None = None) -> None:
        """``name``: this prefill worker's file (a writer); None: a reader."""
        self.directory = os.fspath(directory)
        self._path = None if name is None else os.path.join(self.directory, f"{name}.busy")
        self._busy: bool | None = None
        self._read_at, self._answer = -1.0, False
        if self._path is not None:
            try:
                os.makedirs(self.directory, exist_ok=True)
            except OSError:  # not writable here: this worker never says it is busy (decode keeps its own threads)
                self._path = None
            else:
                self.set(False)

    def set(self, busy: bool) -> None:
        """The writer's state (a file write only when it changed; best effort: an unwritable board reads idle)."""
        if busy == self._busy or self._path is None:
            return
        self._busy = busy
        tmp = f"{self._path}.{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(b"%d %d" % (os.getpid(), busy))
            os.replace(tmp, self._path)  # readers see the old file or the new one, never half of one
        except OSError:
            pass

    def any_busy(self) -> bool:
        """Does any live prefill worker on the board have work (the answer reused for :data:`MIN_WINDOW_S`)?"""
        now = time.monotonic()
        if now - self._read_at < MIN_WINDOW_S:
            return self._answer
        self._read_at, self._answer = now, False
        try:
            names = [n for n in os.listdir(self.directory) if n.endswith(".busy")]
        except OSError:
            return False
        for n in names:
            try:
                with open(os.path.join(self.directory, n), "rb") as f:
                    pid, busy = (int(x) for x in f.read().split())
            except (OSError, ValueError):
                continue
            if busy and _alive(pid):
                self._answer = True
                break
        return self._answer

    def close(self) -> None:
        """The writer leaves the board."""
        if self._path is not None:
            try:
                os.unlink(self._path)
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def board_directory(key: str) -> str:
    """The board's directory for cluster ``key`` (a name in ``/dev/shm`` where it exists, else the temp dir)."""
    import tempfile

    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(root, f"duet-board-{key}")
