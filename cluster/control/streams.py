"""The decode side's way back to the front-end: one poller per decode worker fans its events out to per-request
inboxes.

* :meth:`DecodeStreams.inbox` -- a request's inbox (an ``asyncio.Queue`` of
  :data:`~node_common.events.DecodeEvent`), open from its decode allocation to the attempt's end; it records which
  decode worker owns the request.
* :meth:`DecodeStreams.poll` -- the poller of one decode worker (a task on the front-end loop, started by
  :class:`~cluster.control.worker_pool.WorkerPool`): a long :meth:`DecodeActor.poll <decode_node.actor.DecodeActor.poll>`
  returns every event since the last one for all its requests (``{"events": [wire map, ...], "free_blocks": n}``);
  each is parsed with :func:`~node_common.events.event_from_wire` and put in its request's inbox. With ``lane`` (a
  worker on this node), the same replies come pushed over the worker's loopback lane (:mod:`node_common.lane`,
  :mod:`cluster.control.lane_client`), which the attempts then also use to admit local prompts; a lane that ends
  counts as a failed poll. A poll that fails
  (the worker died, stopped answering, or sent something undecodable) marks the worker dead, fails each of its
  requests with a :class:`~node_common.events.RequestFailed` at once, and reports the death; the poller then ends.
* :meth:`DecodeStreams.fail` -- ends one attempt's wait from elsewhere (its prefill worker gave it up).
* :meth:`DecodeStreams.next` -- the attempt's wait for its next event, bounded by the request's deadline; a request
  whose prefill worker died before its first token ends there (its lease waits for the prefill to start, so the
  decode side alone would not notice before the request's deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from cluster.control.bounded import bounded
from cluster.control.errors import RequestTimeoutError
from cluster.control.lane_client import OPEN_TIMEOUT_S, Lane
from cluster.control.worker import Worker, await_ref
from node_common import messages
from node_common.events import DecodeEvent, RequestFailed, event_from_wire

logger = logging.getLogger(__name__)

# a decode worker's long poll: it returns as soon as there are tokens, so this only bounds how often an idle worker
# is asked (was 50 ms: 20 RPCs a second per idle worker)
POLL_S = 1.0
POLL_TIMEOUT_S = 30.0  # a poll not answered by then is a dead worker
CHECK_S = 0.5  # how often a request waiting for its next event asks whether its prefill worker is still there


class DecodeStreams:
    """Per-request inboxes and the decode pollers that fill them (see the module docstring). Front-end loop only."""

    def __init__(self, *, poll_s: float = POLL_S, coalesce_s: float = 0.0, lane: bool = False) -> None:
        """``coalesce_s``: a poll carrying only further tokens of running requests is answered at most that often
        (``ClusterSpec.stream_interval_s``; :meth:`DecodeActor.poll <decode_node.actor.DecodeActor.poll>`).
        ``lane``: take a decode worker's replies from its loopback lane where it is on this node
        (``ClusterSpec.fast_lane``; :mod:`node_common.lane`), pushed as they are made."""
        self.poll_s, self.coalesce_s, self.lane = poll_s, coalesce_s, lane
        self._inboxes: dict[str, asyncio.Queue[DecodeEvent]] = {}
        self._owner: dict[str, str] = {}  # request id -> the decode worker that holds it

    @contextlib.contextmanager
    def inbox(self, rid: str, decode_worker: str) -> Iterator[asyncio.Queue[DecodeEvent]]:
        """The inbox of attempt ``rid``, placed on ``decode_worker``; closed on exit."""
        queue: asyncio.Queue[DecodeEvent] = asyncio.Queue()
        self._inboxes[rid], self._owner[rid] = queue, decode_worker
        try:
            yield queue
        finally:
            self._inboxes.pop(rid, None)
            self._owner.pop(rid, None)

    def owners(self) -> dict[str, str]:
        """``{request id: decode worker id}`` of the open inboxes (a copy)."""
        return dict(self._owner)

    @staticmethod
    async def next(queue: asyncio.Queue[DecodeEvent], rid: str, deadline: float,
                   gone: Callable[[], str | None] = lambda: None) -> DecodeEvent:
        """The next event of ``rid``; :class:`RequestTimeoutError` once ``deadline`` (``time.monotonic()``) passed.
        ``gone()`` is asked every ``CHECK_S`` while nothing arrives: a reason (another worker of the attempt died)
        ends the wait with a :class:`~node_common.events.RequestFailed` of that reason."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeoutError(f"request {rid} timed out")
            try:
                return await bounded(queue.get(), timeout=min(left, CHECK_S))
            except asyncio.TimeoutError:
                if (why := gone()) is not None:
                    return RequestFailed(rid, why)

    async def poll(self, w: Worker, on_death: Callable[[Worker, str], None]) -> None:
        """Poll decode worker ``w`` until it is dead: marked by a failed poll (its requests fail and ``on_death(w,
        why)`` runs) or elsewhere (its requests fail)."""
        lane = await self._open_lane(w) if self.lane else None
        try:
            await self._poll(w, on_death, lane)
        finally:
            if lane is not None:
                w.lane = None
                lane.close()

    async def _open_lane(self, w: Worker) -> Lane | None:
        """``w``'s loopback lane, connected and greeted; None (its replies come over Ray) where it is on another
        node or the lane cannot be opened."""
        try:
            info = messages.unpack(await bounded(await_ref(w.actor.lane.remote()), timeout=OPEN_TIMEOUT_S))
            import ray

            if info["node_ip"] != ray.util.get_node_ip_address():
                return None
            w.lane = await Lane.open(info, epoch=w.epoch, poll_s=self.poll_s, coalesce_s=self.coalesce_s)
        except Exception as e:  # noqa: BLE001 - Ray serves it as before
            logger.warning("decode worker %s: no loopback lane (%s: %s); polling over Ray", w.worker_id,
                           type(e).__name__, e)
            return None
        return w.lane

    async def _poll(self, w: Worker, on_death: Callable[[Worker, str], None], lane: Lane | None) -> None:
        while w.alive:
            try:
                if lane is not None:
                    reply = await lane.next_events(POLL_TIMEOUT_S)
                else:
                    reply = await bounded(await_ref(w.actor.poll.remote(self.poll_s, w.epoch, self.coalesce_s)),
                                          timeout=POLL_TIMEOUT_S)
                msg = messages.unpack(reply)
                events = [event_from_wire(ev) for ev in msg["events"]]
            except Exception as e:  # noqa: BLE001 - dead, silent, or a poll that raises: its requests must not wait
                if not w.alive:  # marked dead meanwhile (shut down, or found dead elsewhere): said once, below
                    break
                w.mark_dead(f"poll failed: {type(e).__name__}")  # for their deadline on a poller that stopped, nor
                logger.error("decode worker %s is gone: %s", w.worker_id, e)  # new ones be placed there
                self._fail_requests_of(w.worker_id, f"decode worker {w.worker_id} died")
                on_death(w, f"poll failed: {type(e).__name__}")
                return
            w.load.free_blocks = msg["free_blocks"]
            for ev in events:
                queue = self._inboxes.get(ev.request_id)
                if queue is not None:
                    queue.put_nowait(ev)
            if events:  # the requests just woken go on before the next poll is sent: sending it holds this loop
                await asyncio.sleep(0)  # ~1 ms, which a first token waited (1.8 ms median, 2 cores)
        # marked dead elsewhere (a failed call, a health-ping timeout, its group re-formed): its requests end now
        self._fail_requests_of(w.worker_id, f"decode worker {w.worker_id} is gone ({w.dead_reason or 'unresponsive'})")

    def fail(self, rid: str, reason: str) -> None:
        """End attempt ``rid``'s wait with a :class:`~node_common.events.RequestFailed` (no-op once it ended)."""
        if (queue := self._inboxes.get(rid)) is not None:
            queue.put_nowait(RequestFailed(rid, reason))

    def _fail_requests_of(self, worker_id: str, reason: str) -> None:
        for rid, owner in list(self._owner.items()):
            if owner == worker_id and rid in self._inboxes:
                self._inboxes[rid].put_nowait(RequestFailed(rid, reason))
