"""The chaos soak's faults: what each one does to a running ``duet serve`` and how it is undone.

Every fault is a :class:`Fault` kind; :func:`inject` runs one against a :class:`Target` (the serve process, its
Ray worker processes found by process title under this process's raylet, the fault proxy, a client factory) and
returns when the fault is over (a kill at once, a stall or a freeze after ``hold_s``). Recovery is measured by the
soak, not here.

* ``kill_prefill`` / ``kill_decode``: SIGKILL of one worker process of that role (a decode worker of an
  expert-parallel group when the spec has one: the group is re-formed);
* ``stall_link``: the proxy between the prefill and decode data planes stops forwarding, closing nothing, for
  ``hold_s`` (longer than a lease: transfers in flight end with ``TransferTimeout`` and are retried);
* ``corrupt_frames``: the proxy flips one bit in every chunk it forwards to the decode side for ``hold_s``;
* ``lease_expiry``: SIGSTOP of a prefill worker for ``hold_s`` (past its leases' deadlines), then SIGCONT: the decode
  side expires the leases and frees their blocks, and what the frozen worker sends afterwards must be refused;
* ``abort_storm``: ``storm`` streaming requests started at once and cancelled after 0-300 ms each;
* ``restart_serve``: SIGKILL of the ``duet serve`` process, then a new one on the same ports (its workers die with
  it: no worker process of the old one may outlive it).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

FAULTS = ("kill_prefill", "kill_decode", "stall_link", "corrupt_frames", "lease_expiry", "abort_storm",
          "restart_serve")
ROLE_TITLES = {"prefill": "ray::PrefillActor", "decode": "ray::DecodeActor"}


def worker_pids(role: str, root: int | None = None) -> list[int]:
    """PIDs of live Ray worker processes running a ``role`` actor, among the descendants of ``root`` (default this
    process: the raylet it started, and so only this soak's workers, not another Ray cluster's on the host)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                parents[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    todo, seen = [root or os.getpid()], []
    while todo:
        pid = todo.pop()
        for c in children.get(pid, []):
            seen.append(c)
            todo.append(c)
    out = []
    for pid in seen:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if title.startswith(ROLE_TITLES[role]) and state != "Z":
            out.append(pid)
    return sorted(out)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class Target:
    """What the faults act on; ``restart`` kills and restarts the serve process (returns the old workers' PIDs),
    ``storm_request(cancel_after_s)`` runs one request that the client cancels."""

    proxy: object
    restart: Callable[[], Awaitable[list[int]]]
    storm_request: Callable[[float], Awaitable[None]]
    hold_s: float
    storm: int
    rng: random.Random = field(default_factory=random.Random)


async def inject(kind: str, t: Target) -> dict:
    """Run fault ``kind``; returns ``{"kind", "detail", "over_at"}`` (``time.monotonic()`` when it ended)."""
    if kind in ("kill_prefill", "kill_decode"):
        pids = worker_pids(kind.split("_")[1])
        if not pids:
            return {"kind": kind, "detail": "no such worker alive", "over_at": time.monotonic()}
        pid = t.rng.choice(pids)
        os.kill(pid, signal.SIGKILL)
        return {"kind": kind, "detail": f"SIGKILL pid {pid}", "over_at": time.monotonic()}
    if kind in ("stall_link", "corrupt_frames"):
        t.proxy.set_mode("stall" if kind == "stall_link" else "corrupt")
        try:
            await asyncio.sleep(t.hold_s)
        finally:
            t.proxy.set_mode("forward")
        return {"kind": kind, "detail": f"{t.hold_s:.1f} s", "over_at": time.monotonic()}
    if kind == "lease_expiry":
        pids = worker_pids("prefill")
        if not pids:
            return {"kind": kind, "detail": "no prefill worker alive", "over_at": time.monotonic()}
        pid = t.rng.choice(pids)
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(t.hold_s)
        finally:
            os.kill(pid, signal.SIGCONT)
        return {"kind": kind, "detail": f"SIGSTOP pid {pid} for {t.hold_s:.1f} s", "over_at": time.monotonic()}
    if kind == "abort_storm":
        await asyncio.gather(*(t.storm_request(t.rng.uniform(0.0, 0.3)) for _ in range(t.storm)))
        return {"kind": kind, "detail": f"{t.storm} requests cancelled", "over_at": time.monotonic()}
    if kind == "restart_serve":
        old = await t.restart()
        return {"kind": kind, "detail": f"serve restarted ({len(old)} old workers)", "over_at": time.monotonic(),
                "old_workers": old}
    raise ValueError(f"unknown fault {kind!r} (known: {', '.join(FAULTS)})")
