"""The chaos soak's faults: what each one does to a running ``duet serve`` and how it is undone.

Every fault is a kind in :data:`FAULTS`; :func:`inject` runs one against a :class:`Target` (the serve process, its
Ray worker processes found by process title under the head's raylet, the fault proxy, the Ray head, a client
factory) and returns when the fault is over (a kill at once, a stall or a freeze after ``hold_s``, a lost head once
one is up again). Recovery is measured by the soak, not here.

* ``kill_prefill`` / ``kill_decode``: SIGKILL of one worker process of that role (a decode worker of an
  expert-parallel group when the spec has one: the group is re-formed);
* ``stall_link``: the proxy between the prefill and decode data planes stops forwarding, closing nothing, for
  ``hold_s`` (longer than a lease: transfers in flight end with ``TransferTimeout`` and are retried);
* ``corrupt_frames``: the proxy flips one bit in every chunk it forwards to the decode side for ``hold_s``;
* ``lease_expiry``: SIGSTOP of a prefill worker for ``hold_s`` (past its leases' deadlines), then SIGCONT: the decode
  side expires the leases and frees their blocks, and what the frozen worker sends afterwards must be refused;
* ``abort_storm``: ``storm`` streaming requests started at once and cancelled after 0-300 ms each;
* ``restart_serve``: SIGKILL of the ``duet serve`` process, then a new one on the same ports (its workers die with
  it: no worker process of the old one may outlive it);
* ``kill_head``: SIGKILL of the Ray head's gcs_server and raylet (an external head,
  :class:`~duet_bench.chaos.head.ExternalHead`; its workers die with the raylet: none may outlive it), the rest of
  the head's processes after them; ``hold_s`` later a head again on the same port, which ``duet serve`` (kept up,
  answering UNAVAILABLE meanwhile) re-initialises Ray against, spawning fresh workers.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from duet_bench.chaos.head import descendants, title

FAULTS = ("kill_prefill", "kill_decode", "stall_link", "corrupt_frames", "lease_expiry", "abort_storm",
          "restart_serve", "kill_head")
ROLE_TITLES = {"prefill": "ray::PrefillActor", "decode": "ray::DecodeActor"}


def worker_pids(role: str, roots: Iterable[int] = ()) -> list[int]:
    """PIDs of live Ray worker processes running a ``role`` actor, among the descendants of ``roots`` (the head's
    raylet, or this process when it hosts the head: so only this soak's workers, not another Ray cluster's on the
    host; default this process)."""
    return sorted(p for p in descendants(list(roots) or [os.getpid()]) if title(p).startswith(ROLE_TITLES[role]))


@dataclass
class Target:
    """What the faults act on; ``workers(role)`` lists the live worker PIDs of a role, ``restart`` kills and
    restarts the serve process (returns the old workers' PIDs), ``lose_head`` kills the Ray head and starts one
    again (returns the fault's ``detail``), ``storm_request(cancel_after_s)`` runs one
    request that the client cancels."""

    proxy: object
    workers: Callable[[str], list[int]]
    restart: Callable[[], Awaitable[list[int]]]
    lose_head: Callable[[], Awaitable[dict]]
    storm_request: Callable[[float], Awaitable[None]]
    hold_s: float
    storm: int
    rng: random.Random = field(default_factory=random.Random)


async def inject(kind: str, t: Target) -> dict:
    """Run fault ``kind``; returns ``{"kind", "detail", "over_at"}`` (``time.monotonic()`` when it ended)."""
    if kind in ("kill_prefill", "kill_decode"):
        pids = t.workers(kind.split("_")[1])
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
        pids = t.workers("prefill")
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
    if kind == "kill_head":
        return {"kind": kind, **await t.lose_head(), "over_at": time.monotonic()}
    raise ValueError(f"unknown fault {kind!r} (known: {', '.join(FAULTS)})")
