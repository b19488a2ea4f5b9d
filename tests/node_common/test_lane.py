"""The loopback lane between the front-end and a decode worker (:mod:`node_common.lane` and
:mod:`cluster.control.lane_client`): pushed events, calls answered by id, a wrong token or a malformed frame refused
with nothing done, and a closed lane seen at once by every waiter. No Ray."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

import pytest

from cluster.control.lane_client import Lane, LaneClosed
from engine.errors import DuetError, InvalidRequestError
from node_common import messages
from node_common.lane import MAX_FRAME, LaneServer, frame


class _Worker:
    """Stands in for a decode actor: a queue of poll replies, one call."""

    def __init__(self) -> None:
        self.replies: list[bytes] = []
        self.cond = threading.Condition()
        self.calls: list[bytes] = []
        self.hellos: list[dict] = []
        self.stop = False

    def events(self, hello: dict) -> bytes | None:
        self.hellos.append(hello)
        with self.cond:
            self.cond.wait_for(lambda: self.replies or self.stop, timeout=hello["poll_s"])
            if self.stop:
                return None
            return self.replies.pop(0) if self.replies else messages.pack(events=[], free_blocks=0)

    def push(self, n: int) -> None:
        with self.cond:
            self.replies.append(messages.pack(events=[{"n": n}], free_blocks=n))
            self.cond.notify_all()

    def admit(self, msg: bytes) -> bytes:
        self.calls.append(msg)
        m = messages.unpack(msg)
        if m.get("bad"):
            return messages.error_reply(ValueError("bad request"))
        return messages.pack(free_blocks=m["x"] * 2)


@pytest.fixture
def lane_server():
    w = _Worker()
    server = LaneServer(w.events, {"admit_local": w.admit})
    yield w, server
    w.stop = True
    with w.cond:
        w.cond.notify_all()
    server.close()


def _info(server: LaneServer, token: bytes | None = None) -> dict:
    return {"host": server.host, "port": server.port, "token": token or server.token}


def test_events_are_pushed_and_calls_answered(lane_server):
    w, server = lane_server
    assert server.host == "127.0.0.1"

    async def run():
        lane = await Lane.open(_info(server), epoch=3, poll_s=0.05, coalesce_s=0.01)
        try:
            w.push(7)
            got = []
            while not got:
                got = messages.unpack(await lane.next_events(5))["events"]
            replies = await asyncio.gather(*(lane.call("admit_local", messages.pack(x=i), time.monotonic() + 5)
                                             for i in range(5)))
            with pytest.raises(DuetError, match="bad request"):
                messages.unpack(await lane.call("admit_local", messages.pack(bad=True), time.monotonic() + 5))
            with pytest.raises(InvalidRequestError, match="no lane method"):
                messages.unpack(await lane.call("shutdown", b"", time.monotonic() + 5))
            return got, [messages.unpack(r)["free_blocks"] for r in replies]
        finally:
            lane.close()

    got, blocks = asyncio.run(run())
    assert got == [{"n": 7}] and blocks == [0, 2, 4, 6, 8]
    assert w.hellos[0]["epoch"] == 3 and w.hellos[0]["coalesce_s"] == 0.01 and len(w.calls) == 6


def test_a_wrong_token_gets_nothing_and_changes_nothing(lane_server):
    w, server = lane_server

    async def run():
        lane = await Lane.open(_info(server, token=b"x" * 32), epoch=0, poll_s=0.05, coalesce_s=0.0)
        try:
            with pytest.raises(LaneClosed):
                await lane.next_events(5)
            with pytest.raises(LaneClosed):
                await lane.call("admit_local", messages.pack(x=1), time.monotonic() + 5)
        finally:
            lane.close()

    asyncio.run(run())
    assert w.calls == [] and w.hellos == []


@pytest.mark.parametrize("junk", [b"\x00\x00\x00\x00", struct.pack("<I", MAX_FRAME + 1),
                                  struct.pack("<I", 3) + b"abc"])
def test_a_malformed_or_oversized_frame_closes_the_connection(lane_server, junk):
    w, server = lane_server
    with socket.create_connection((server.host, server.port), timeout=5) as s:
        s.sendall(junk)
        s.settimeout(5)
        assert s.recv(16) == b""  # closed by the server
    hello = frame("hello", messages.pack(token=server.token, epoch=0, poll_s=0.05, coalesce_s=0.0))
    with socket.create_connection((server.host, server.port), timeout=5) as s:  # after a good hello as well
        s.sendall(hello + junk)
        s.settimeout(5)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert w.calls == []


def test_the_worker_closing_its_lane_ends_every_wait_at_once(lane_server):
    w, server = lane_server

    async def run():
        lane = await Lane.open(_info(server), epoch=0, poll_s=10.0, coalesce_s=0.0)
        waiter = asyncio.ensure_future(lane.next_events(30))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        w.stop = True  # the worker's generation ended: events() answers None and the lane closes
        with w.cond:
            w.cond.notify_all()
        with pytest.raises(LaneClosed):
            await waiter
        with pytest.raises(LaneClosed):
            await lane.next_events(30)
        lane.close()
        return time.monotonic() - t0

    assert asyncio.run(run()) < 10
