"""``await`` with a time limit that never loses its caller's cancellation.

``asyncio.wait_for`` before Python 3.12 returns the awaited result when the awaitable completes in the same loop
iteration as a ``cancel()`` of the task awaiting it: the cancellation is swallowed, and the task runs on as if nobody
had asked it to stop. On the front-end that was a real leak: a client that disconnected while its request's next
token event was already queued left the request decoding to its last token (``max_tokens``), its KV blocks held
throughout, because the abort that the cancellation should have sent was never sent. :func:`bounded` raises the
cancellation in that case (the completed result is dropped: whoever cancelled does not want it).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def bounded(aw: Awaitable[T], timeout: float) -> T:
    """``await aw``, at most ``timeout`` seconds (then ``asyncio.TimeoutError``, ``aw`` cancelled). A cancellation
    of the calling task always propagates as ``CancelledError``."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(max(0.0, timeout)):
            return await aw
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=max(0.0, timeout))
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise asyncio.TimeoutError
    return task.result()
