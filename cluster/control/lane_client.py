"""The front-end's end of a decode worker's loopback lane (:mod:`node_common.lane`), on the front-end loop.

:meth:`Lane.open` connects and says hello; one reader task then takes every frame: ``events`` frames (poll replies
pushed by the worker) go to :meth:`Lane.next_events`, ``reply`` frames to the :meth:`Lane.call` waiting for their id.
When the connection ends -- the worker died, or closed the lane -- every waiter gets :class:`LaneClosed` at once.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time

from cluster.control.bounded import bounded
from node_common import messages
from node_common.lane import LaneClosed, frame, frame_length, parse

OPEN_TIMEOUT_S = 5.0

__all__ = ["Lane", "LaneClosed"]


class Lane:
    """A connected lane (make it with :meth:`open`)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._events: asyncio.Queue[bytes | BaseException] = asyncio.Queue()
        self._replies: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self.closed: str | None = None  # why it ended (None while open)
        self._task = asyncio.ensure_future(self._read())

    @classmethod
    async def open(cls, info: dict, *, epoch: int, poll_s: float, coalesce_s: float) -> Lane:
        """Connect to the lane ``info`` describes (:meth:`DecodeActor.lane <decode_node.actor.DecodeActor.lane>`'s
        reply) and say hello; raises ``OSError`` / ``asyncio.TimeoutError`` when it cannot."""
        reader, writer = await bounded(asyncio.open_connection(info["host"], info["port"]), OPEN_TIMEOUT_S)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(frame("hello", messages.pack(token=info["token"], epoch=epoch, poll_s=poll_s,
                                                  coalesce_s=coalesce_s)))
        await bounded(writer.drain(), OPEN_TIMEOUT_S)
        return cls(reader, writer)

    async def next_events(self, timeout: float) -> bytes:
        """The next poll reply the worker pushed; :class:`LaneClosed` once the lane ended, ``asyncio.TimeoutError``
        when nothing came for ``timeout`` seconds (the worker sends one at least every ``poll_s``)."""
        item = await bounded(self._events.get(), timeout)
        if isinstance(item, BaseException):
            self._events.put_nowait(item)  # every later wait sees it too
            raise item
        return item

    async def call(self, method: str, msg: bytes, deadline: float) -> bytes:
        """``method(msg)`` on the worker, bounded by ``deadline`` (``time.monotonic()``; at least 0.1 s)."""
        if self.closed is not None:
            raise LaneClosed(self.closed)
        id_ = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._replies[id_] = fut
        try:
            self._writer.write(frame("call", messages.pack(method=method, msg=msg), id_))
            return await bounded(fut, max(0.1, deadline - time.monotonic()))
        finally:
            self._replies.pop(id_, None)

    def close(self) -> None:
        self._task.cancel()
        self._end("closed by the front-end")

    async def _read(self) -> None:
        try:
            while True:
                header = await self._reader.readexactly(4)
                kind, id_, body = parse(await self._reader.readexactly(frame_length(header)))
                if kind == "events":
                    self._events.put_nowait(body)
                elif kind == "reply":
                    fut = self._replies.get(id_)
                    if fut is not None and not fut.done():
                        fut.set_result(body)
                else:
                    raise LaneClosed(f"unexpected lane frame {kind!r}")
        except asyncio.CancelledError:
            raise
        except (OSError, asyncio.IncompleteReadError, LaneClosed) as e:
            self._end(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)

    def _end(self, why: str) -> None:
        if self.closed is not None:
            return
        self.closed = why
        err = LaneClosed(f"the decode worker's lane ended ({why})")
        self._events.put_nowait(err)
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(err)
        self._writer.close()
