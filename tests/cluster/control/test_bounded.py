""":func:`cluster.control.bounded.bounded`: a timed await whose caller's cancellation is never swallowed, even when the
awaited thing completes in the same loop iteration as the cancel (``asyncio.wait_for`` before Python 3.12 returns the
result then). The front-end's symptom was a disconnected client's request decoding on to ``max_tokens``."""

from __future__ import annotations

import asyncio
import time
import types

import pytest

import cluster.control.bounded as bounded_mod
from cluster.control.bounded import bounded
from cluster.control.streams import DecodeStreams


@pytest.fixture(params=["native", "fallback"])
def impl(request, monkeypatch):
    """Both code paths: ``asyncio.timeout`` (Python 3.11+) and the ``asyncio.wait`` one kept for 3.10."""
    if request.param == "fallback":
        monkeypatch.setattr(bounded_mod, "sys", types.SimpleNamespace(version_info=(3, 10)))
    return request.param


def _cancel_as_item_arrives(wait) -> list:
    """Run ``wait(queue)`` in a task, then in one loop iteration put an item (waking its ``get``) and cancel the
    task. Returns what the task got; raises CancelledError when the cancellation reached it (the right outcome)."""
    async def main() -> list:
        q: asyncio.Queue = asyncio.Queue()
        got: list = []

        async def waiter() -> None:
            got.append(await wait(q))
            await asyncio.sleep(3600)  # a swallowed cancel leaves it here: the test would see got == [1]

        t = asyncio.create_task(waiter())
        await asyncio.sleep(0.01)  # the waiter is blocked in q.get()
        q.put_nowait(1)
        t.cancel()
        try:
            await asyncio.wait_for(t, 2)
        except asyncio.TimeoutError:
            pass
        return got
    return asyncio.run(main())


def test_a_cancel_racing_a_completion_is_raised(impl):
    with pytest.raises(asyncio.CancelledError):
        _cancel_as_item_arrives(lambda q: bounded(q.get(), 5))


def test_streams_next_gives_way_to_a_cancel_racing_an_event():
    """The attempt's wait for its next decode event (the place the front-end lost the cancellation)."""
    with pytest.raises(asyncio.CancelledError):
        _cancel_as_item_arrives(lambda q: DecodeStreams.next(q, "r", time.monotonic() + 30))


def test_result_and_timeout(impl):
    async def main() -> tuple:
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait("x")
        got = await bounded(q.get(), 1)
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await bounded(q.get(), 0.05)
        waited = time.monotonic() - t0
        q.put_nowait("y")  # the timed-out get was cancelled: it did not take this item
        return got, waited, q.get_nowait()

    got, waited, left = asyncio.run(main())
    assert got == "x" and waited >= 0.05 and left == "y"


def test_errors_of_the_awaited_pass_through(impl):
    async def boom() -> None:
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        asyncio.run(bounded(boom(), 1))
