"""The chaos soak's Ray head, in one of two forms with the same surface (``address``, ``env``, ``worker_roots()``,
``stop()``):

* :class:`LocalHead`: this process's own head (``ray.init`` here, or the caller's, e.g. the tests' ``ray_cluster``
  fixture); the soak is a driver of it, so it cannot be killed under the soak;
* :class:`ExternalHead`: a head in its own processes (``ray start --head``, daemonized, a temp dir of its own), for
  the ``kill_head`` fault. The soak never connects to it (no ``ray.init``): only ``duet serve`` is a driver, so the
  GCS dying cannot take the soak down. Its processes are found through ``/proc``: the ones whose command line names
  its temp dir (gcs_server, raylet, monitor, dashboard, log monitor), its client server (by port), and the raylet's
  descendants (agents, workers). It is stopped by SIGKILLing those, never by ``ray stop`` (which kills every Ray
  process on the host).

Ray starts the head with token authentication; the head and every driver of it run with ``RAY_AUTH_MODE=token``
and a token of this head's own (a file in its temp dir, ``RAY_AUTH_TOKEN_PATH``): a fresh host has no
``~/.ray/auth_token``, and the soak never writes to the user's. Ray resolves a loopback node address to the host's, so
the head binds as Ray decides; ``duet serve`` dials it at ``127.0.0.1``.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

AUTH_ENV = {"RAY_AUTH_MODE": "token"}
AGENT_TITLES = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # the raylet's own services, not workers


class LocalHead:
    """The head of this process's Ray (started here unless one is already initialised; shut down by :meth:`stop`
    only if started here). Its workers descend from this process (the raylet is its child)."""

    env: dict[str, str] = {}

    def __init__(self, num_cpus: int = 8) -> None:
        self._num_cpus = num_cpus
        self._started = False
        self.address = ""

    def start(self) -> float:
        import ray

        t0 = time.monotonic()
        self._started = not ray.is_initialized()
        if self._started:
            ray.init(num_cpus=self._num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
        self.address = ray.get_runtime_context().gcs_address
        return time.monotonic() - t0

    def worker_roots(self) -> list[int]:
        return [os.getpid()]

    def describe(self) -> dict:
        return {"kind": "local", "address": self.address}

    def stop(self) -> None:
        if self._started:
            import ray

            ray.shutdown()


class ExternalHead:
    """``ray start --head`` on a free port with a temp dir of its own; :meth:`kill` and :meth:`start` again keep the
    port and flags, so drivers find it at the same address. Every call has a deadline."""

    def __init__(self, log: Path, num_cpus: int = 8) -> None:
        # a short path of its own: Ray's socket paths under it must stay within the 107-byte limit of AF_UNIX
        self.temp_dir = Path(tempfile.mkdtemp(prefix="duet-chaos-ray-"))
        token = self.temp_dir / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        self.env = AUTH_ENV | {"RAY_AUTH_TOKEN_PATH": str(token)}
        self._log = log
        self._num_cpus = num_cpus
        self._pick_ports()
        self.starts = 0
        self.left: list[int] = []  # processes of this head still alive after stop()

    def _pick_ports(self) -> None:
        self.port, self._client_port, self._dashboard_port, self._agent_port = _free_ports(4)
        self.address = f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0, attempts: int = 2) -> float:
        """Start the head (``ray start`` daemonizes and returns once it is up); seconds taken. A failed ``ray start``
        (its processes SIGKILLed) is tried again, ``attempts`` in all: on fresh ports for the first head, on the
        same port for a head again (its drivers know only that address)."""
        t0 = time.monotonic()
        for _ in range(attempts):
            if self._ray_start(timeout_s):
                self.starts += 1
                return time.monotonic() - t0
            left = self._kill_all([])
            if left:
                raise RuntimeError(f"processes of a failed head start would not die: {left}")
            if not self.starts:
                self._pick_ports()
        raise RuntimeError(f"ray start failed {attempts} times (see {self._log})")

    def _ray_start(self, timeout_s: float) -> bool:
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--port", str(self.port),
               "--num-cpus", str(self._num_cpus), "--include-dashboard", "false", "--disable-usage-stats",
               "--temp-dir", str(self.temp_dir), "--ray-client-server-port", str(self._client_port),
               "--dashboard-port", str(self._dashboard_port), "--dashboard-agent-listen-port", str(self._agent_port)]
        with open(self._log, "a") as out:
            out.write(f"-- {' '.join(cmd)}\n")
            out.flush()
            try:
                r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=os.environ | self.env, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                out.write(f"-- ray start took over {timeout_s:g} s\n")
                return False
            if r.returncode:
                out.write(f"-- ray start failed (exit {r.returncode})\n")
        return r.returncode == 0

    def worker_roots(self) -> list[int]:
        """The head's raylet(s): its workers are their descendants."""
        return [pid for pid, argv in cmdlines().items() if argv[0].endswith("/raylet") and self._names_me(argv)]

    def services(self) -> list[int]:
        """The head's own processes (not the raylet's descendants)."""
        return sorted(pid for pid, argv in cmdlines().items() if self._names_me(argv))

    def processes(self) -> list[int]:
        """Every live process of this head: its services and the raylet's descendants."""
        return sorted(set(self.services()) | set(descendants(self.worker_roots())))

    def kill(self) -> list[int]:
        """SIGKILL the head's gcs_server and raylet (the head failure itself); returns the raylet's descendants at
        that moment (its agents and workers: no longer found through the raylet once it is gone)."""
        roots = self.worker_roots()
        below = descendants(roots)
        for pid, argv in cmdlines().items():
            if pid in roots or (argv[0].endswith("/gcs_server") and self._names_me(argv)):
                _sigkill(pid)
        return below

    async def lose(self, hold_s: float, workers_bound_s: float = 15.0) -> dict:
        """The ``kill_head`` fault: :meth:`kill`, keep the head away ``hold_s`` (the raylet's workers given up to
        ``workers_bound_s`` to die with it), SIGKILL what is left of the head (its services, and any worker that
        outlived the raylet: reported in ``orphans``), start a head again on the same port.
        Returns ``{"killed_at", "orphans", "down_s", "start_s"}``."""
        killed_at = time.monotonic()
        below = self.kill()
        workers = [p for p in below if title(p) not in AGENT_TITLES]
        await asyncio.sleep(hold_s)
        t0 = time.monotonic()
        while any(alive(p) for p in workers) and time.monotonic() - t0 < workers_bound_s:
            await asyncio.sleep(0.2)
        orphans = [p for p in workers if alive(p)]
        left = await asyncio.to_thread(self._kill_all, below)
        if left:
            raise RuntimeError(f"processes of the lost head would not die: {left}")
        start_s = await asyncio.to_thread(self.start)
        return {"killed_at": killed_at, "orphans": orphans, "down_s": time.monotonic() - killed_at - start_s,
                "start_s": start_s}

    def describe(self) -> dict:
        return {"kind": "external", "address": self.address, "temp_dir": str(self.temp_dir), "starts": self.starts,
                "left": self.left}

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGKILL every process of this head; what is still alive after ``timeout_s`` is kept in ``left``."""
        self.left = self._kill_all([], timeout_s)

    def _kill_all(self, extra: list[int], timeout_s: float = 15.0) -> list[int]:
        """SIGKILL ``extra`` and every process of this head; those still alive after ``timeout_s``."""
        pids: set[int] = set()
        found = {p for p in extra if alive(p)} | set(self.processes())
        t0 = time.monotonic()
        while True:  # sweep again until one finds nothing new (a process started while the last was killing)
            for pid in found:
                _sigkill(pid)
            pids |= found
            living = [p for p in sorted(pids) if alive(p)]
            if (not living and not found) or time.monotonic() - t0 > timeout_s:
                return living
            time.sleep(0.1)
            found = set(self.processes()) - pids

    def _names_me(self, argv: list[str]) -> bool:
        prefix = f"{self.temp_dir}/"
        if any(a == str(self.temp_dir) or prefix in a for a in argv):
            return True
        return "ray.util.client.server" in argv and f"--port={self._client_port}" in argv


# -------------------------------------------------------------------------------------------------------- /proc
def descendants(roots: list[int]) -> list[int]:
    """Live descendants of ``roots`` (not the roots)."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(pid)
    todo, out = list(roots), []
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return [p for p in out if alive(p)]


def _pids() -> list[int]:
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()]


def cmdlines() -> dict[int, list[str]]:
    out = {}
    for pid in _pids():
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if raw:  # a zombie's or a kernel thread's is empty
            out[pid] = raw.rstrip(b"\0").decode(errors="replace").split("\0")
    return out


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (all bound at once, so none is handed out twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
