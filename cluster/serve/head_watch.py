"""The front-end's watch on its Ray head: a lost head is a refusal, not a hang, and a head that comes back is served
again without restarting ``duet serve``.

The workers are Ray actors; the Ray head (its GCS) is where they are created, named and looked up. Calls between the
front-end and live workers go straight to the workers, but when the head dies its raylet and the workers die with it
(a raylet gives up on a GCS it cannot reach), and no worker can be replaced until a head answers again. Without a GCS
fault-tolerance store (Redis) a head that restarts is a new, empty Ray cluster: every actor of the old one is gone.

:class:`HeadWatch` asks the head every ``check_s`` (one internal-KV read, bounded by ``probe_timeout_s``):

* **no answer** -> *lost*: the server refuses new requests at once with
  :class:`~cluster.control.errors.ClusterUnavailableError` (gRPC UNAVAILABLE / HTTP 503 + a retry hint), its
  readiness check fails and ``ClusterStatus`` answers UNAVAILABLE; requests in flight end typed when their workers
  go (the decode pollers mark them dead). The front-end's own Ray driver is kept alive meanwhile
  (:func:`keep_driver_alive`: by default Ray ends a driver whose GCS is gone for 60 s).
* **answers again, same cluster** (a GCS with a fault-tolerance store) -> served again; workers that died in between
  are respawned by the pool healer as after any worker death.
* **answers as another cluster** (Ray's ``WrongClusterID``: the head restarted empty) -> *replaced*: ``rebuild()``
  (run off the event loop) abandons the old cluster object, re-initialises this process's Ray driver against the
  same address and starts fresh workers; the server then serves on the new cluster (:meth:`Server.swap_cluster
  <cluster.serve.server.Server.swap_cluster>`). A rebuild that fails is tried again ``retry_s`` later, whatever the
  head answers meanwhile (the old cluster may already be dropped), until one succeeds.
* with ``restart_after_s`` (the embedded cluster, whose head is this process's own child): a head lost that long is
  restarted by ``rebuild()`` itself -- nobody else would.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

UP, LOST, REPLACED = "up", "lost", "replaced"
PROBE_KEY, PROBE_NAMESPACE = b"duet/head-probe", b"duet"
DRIVER_RECONNECT_S = 10 * 365 * 86400  # what keep_driver_alive sets: Ray's GCS reconnect deadline for this driver


def keep_driver_alive() -> None:
    """Before ``ray.init``: this process's Ray driver waits for its GCS as long as it takes instead of exiting after
    Ray's default 60 s (``RAY_gcs_rpc_server_reconnect_timeout_s``; a value the user set is kept). Only the driver
    reads it: raylets and workers of a joined cluster keep their own settings."""
    os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", str(DRIVER_RECONNECT_S))


def probe_head(timeout_s: float = 1.0) -> str:
    """:data:`UP`, :data:`LOST` (no answer within ``timeout_s``) or :data:`REPLACED` (the address answers as another
    Ray cluster) for this process's Ray driver."""
    import ray

    try:
        client = ray._private.worker.global_worker.gcs_client
        client.internal_kv_get(PROBE_KEY, PROBE_NAMESPACE, timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - every failure is one of the two answers below
        return REPLACED if "WrongClusterID" in str(e) else LOST
    return UP


class HeadWatch:
    """See the module docstring. ``server``: a :class:`~cluster.serve.server.Server`; ``rebuild()`` returns the new
    cluster (blocking; called on an executor thread); ``probe(timeout_s)`` is :func:`probe_head` unless a test
    replaces it."""

    def __init__(self, server: Any, rebuild: Callable[[], Any], *, check_s: float = 1.0, probe_timeout_s: float = 1.0,
                 retry_s: float = 5.0, restart_after_s: float | None = None,
                 probe: Callable[[float], str] = probe_head) -> None:
        self.server, self.rebuild, self.probe = server, rebuild, probe
        self.check_s, self.probe_timeout_s, self.retry_s = check_s, probe_timeout_s, retry_s
        self.restart_after_s = restart_after_s
        self.state = UP
        self.lost_at: float | None = None
        self.losses = self.rebuilds = self.failed_rebuilds = 0
        self._rebuilding = False  # set from a rebuild's start until one succeeds
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="duet-head-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._rebuilding:  # a rebuild began: the old cluster is gone whatever the head says now
                await self._rebuild(loop, "restarted as a new cluster")
                continue
            answer = await loop.run_in_executor(None, self.probe, self.probe_timeout_s)
            if answer == UP:
                if self.state != UP:
                    logger.warning("the Ray head answers again (same cluster): serving")
                    await self._serve()
            else:
                await self._lose(answer)
                overdue = self.restart_after_s is not None and time.monotonic() - self.lost_at >= self.restart_after_s
                if answer == REPLACED or overdue:
                    await self._rebuild(loop, "restarted as a new cluster" if answer == REPLACED else
                                        f"unreachable for {self.restart_after_s:.0f} s; restarting it")
                    continue
            await asyncio.sleep(self.check_s)

    async def _lose(self, answer: str) -> None:
        if self.state == UP:
            self.losses += 1
            self._count("lost")
            self.lost_at = time.monotonic()
            logger.error("the Ray head does not answer: refusing new requests until it does")
        self.state = answer
        why = "is being replaced" if answer == REPLACED else "does not answer"
        await self.server.mark_unavailable(f"the cluster is unavailable: its Ray head {why} (for "
                                           f"{time.monotonic() - self.lost_at:.0f} s); retry shortly")

    def _count(self, event: str) -> None:
        self.server.service.metrics.head_events.labels(event).inc()

    async def _serve(self) -> None:
        self.state, self.lost_at = UP, None
        await self.server.mark_unavailable(None)

    async def _rebuild(self, loop: asyncio.AbstractEventLoop, why: str) -> None:
        if not self._rebuilding:
            logger.error("the Ray head %s: starting new workers", why)
        self._rebuilding = True
        await self.server.mark_unavailable(f"the cluster is unavailable: its Ray head {why}; new workers are starting")
        t0 = time.monotonic()
        try:
            cluster = await loop.run_in_executor(None, self.rebuild)
        except Exception as e:  # noqa: BLE001 - stay unavailable and try again
            self.failed_rebuilds += 1
            self._count("rebuild_failed")
            logger.error("starting new workers failed (%s: %s); trying again in %.0f s", type(e).__name__, e,
                         self.retry_s)
            await asyncio.sleep(self.retry_s)
            return
        await self.server.swap_cluster(cluster)
        self.rebuilds += 1
        self._count("rebuilt")
        self._rebuilding = False
        logger.warning("serving again on new workers (%.1f s to start them; %.1f s since the head was lost)",
                       time.monotonic() - t0, time.monotonic() - self.lost_at)
        await self._serve()
