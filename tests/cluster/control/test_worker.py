"""The front-end's per-worker counters and an attempt's hold on its pair (:mod:`cluster.control.worker`), and the
wait for a request's next event (:meth:`cluster.control.streams.DecodeStreams.next`): pure, no Ray."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from cluster.control.errors import RequestTimeoutError
from cluster.control.router import WorkerLoad
from cluster.control.streams import DecodeStreams
from cluster.control.worker import Assignment, Worker
from node_common.events import RequestFailed, TokenEvent


class _Admission:
    """Records releases as PrefillAdmission would make them."""

    def __init__(self) -> None:
        self.released: list[int] = []

    def release(self, pw: Worker, tokens: int) -> None:
        pw.discharge(tokens)
        self.released.append(tokens)


def _pair() -> tuple[_Admission, Worker, Worker]:
    aborts: list[str] = []
    actor = SimpleNamespace(abort=SimpleNamespace(remote=aborts.append), aborts=aborts)
    return _Admission(), Worker(WorkerLoad("prefill-0"), actor), Worker(WorkerLoad("decode-0"), actor)


def test_an_assignment_gives_its_charge_back_once_at_the_first_token():
    adm, pw, dw = _pair()
    charge = pw.charge(10, 4)  # 10 prompt tokens, 4 predicted cached
    assert charge == 6 and (pw.prefill_tokens, pw.placed_tokens, pw.predicted_cached_tokens) == (6, 10, 4)
    with Assignment(adm, pw, charge, [b"h"]) as a:
        a.bind(dw)
        assert pw.inflight == dw.inflight == 1
        a.submitted(prefix_seq=3)
        a.first_token()
        a.first_token()  # later deltas change nothing
        assert adm.released == [6] and pw.prefill_tokens == 0 and pw.s_per_token is not None
    assert adm.released == [6] and pw.inflight == dw.inflight == 0


def test_an_assignment_that_ends_early_gives_back_what_it_holds():
    adm, pw, dw = _pair()
    with pytest.raises(RuntimeError):
        with Assignment(adm, pw, pw.charge(8, 0), []):
            raise RuntimeError("no decode worker")  # before bind: only the charge is held
    assert adm.released == [8] and pw.prefill_tokens == 0 and pw.inflight == 0 and dw.inflight == 0


def test_prefill_gone_only_before_the_first_token():
    adm, pw, dw = _pair()
    with Assignment(adm, pw, pw.charge(4, 0), []) as a:
        a.bind(dw)
        a.submitted(prefix_seq=0)
        assert a.prefill_gone() is None
        assert pw.mark_dead("health ping timed out") and not pw.mark_dead("again")
        assert "prefill-0" in a.prefill_gone() and "health ping timed out" in a.prefill_gone()
        a.first_token()
        assert a.prefill_gone() is None  # handed off: decode no longer needs it
        a.abort("r")
    assert pw.actor.aborts == ["r"]  # the live decode worker only; the dead prefill worker is not called


def test_next_ends_a_wait_whose_prefill_worker_died():
    async def run():
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        ev = await DecodeStreams.next(q, "r", deadline=__import__("time").monotonic() + 30,
                                      gone=lambda: "prefill worker prefill-0 is gone (killed)")
        return ev, loop.time() - t0

    ev, waited = asyncio.run(run())
    assert isinstance(ev, RequestFailed) and "prefill-0 is gone" in ev.reason and waited < 5


def test_next_returns_events_and_times_out_on_the_deadline():
    import time

    async def run():
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait(TokenEvent("r", 0, [5]))
        got = await DecodeStreams.next(q, "r", time.monotonic() + 5)
        with pytest.raises(RequestTimeoutError):
            await DecodeStreams.next(q, "r", time.monotonic() + 0.2)
        return got

    assert asyncio.run(run()).token_ids == [5]
