"""The front-end's per-worker counters and an attempt's hold on its pair (:mod:`cluster.control.worker`), and the
wait for a request's next event (:meth:`cluster.control.streams.DecodeStreams.next`): pure, no Ray."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from cluster.control.admission import PrefillAdmission
from cluster.control.errors import RequestTimeoutError
from cluster.control.router import WorkerLoad
from cluster.control.spec import ClusterSpec
from cluster.control.streams import DecodeStreams
from cluster.control.worker import Assignment, Worker
from node_common.events import RequestFailed, TokenEvent


class _Admission:
    """Records releases as PrefillAdmission would make them."""

    def __init__(self) -> None:
        self.released: list[int] = []

    def release(self, pw: Worker, tokens: int, *, images: bool = False) -> None:
        pw.discharge(tokens, images=images)
        self.released.append(tokens)


def _actor() -> SimpleNamespace:
    aborts: list[str] = []
    return SimpleNamespace(abort=SimpleNamespace(remote=aborts.append), aborts=aborts)


def _pair() -> tuple[_Admission, Worker, Worker]:
    return _Admission(), Worker(WorkerLoad("prefill-0"), _actor()), Worker(WorkerLoad("decode-0"), _actor())


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
    assert dw.actor.aborts == ["r"] and pw.actor.aborts == []  # the dead prefill worker is not called


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


def test_a_decode_poll_that_raises_fails_its_requests_at_once():
    """Not only a dead actor: a poll that raises anything (a task error, an undecodable reply) marks the worker dead
    and fails its requests now, instead of leaving them to their deadline behind a poller that stopped."""
    import asyncio
    from types import SimpleNamespace

    from cluster.control.router import WorkerLoad
    from cluster.control.streams import DecodeStreams
    from cluster.control.worker import Worker
    from node_common.events import RequestFailed

    async def boom():
        raise RuntimeError("poll raised")

    deaths: list[str] = []
    actor = SimpleNamespace(poll=SimpleNamespace(remote=lambda timeout_s, epoch=0, coalesce_s=0.0: boom()))
    w = Worker(WorkerLoad("decode-0"), actor)

    async def run():
        streams = DecodeStreams()
        with streams.inbox("r", "decode-0") as q:
            await asyncio.wait_for(streams.poll(w, lambda w, why: deaths.append(why)), timeout=10)
            return q.get_nowait()

    ev = asyncio.run(run())
    assert isinstance(ev, RequestFailed) and ev.request_id == "r" and "decode-0 died" in ev.reason
    assert not w.alive and deaths == ["poll failed: RuntimeError"]


def test_a_decode_worker_marked_dead_elsewhere_fails_its_requests_at_once():
    """Liveness cleared by someone else (a failed call, a health-ping timeout, a re-formed group) while a poll is in
    flight: the poller ends and that worker's requests fail at once; the death is not reported twice."""
    import asyncio
    from types import SimpleNamespace

    from cluster.control.router import WorkerLoad
    from cluster.control.streams import DecodeStreams
    from cluster.control.worker import Worker
    from node_common import messages
    from node_common.events import RequestFailed

    w: Worker

    async def poll_reply():
        w.mark_dead("health ping timed out")
        return messages.pack(events=[], free_blocks=3)

    deaths: list[str] = []
    w = Worker(WorkerLoad("decode-1"),
               SimpleNamespace(poll=SimpleNamespace(remote=lambda timeout_s, epoch=0, coalesce_s=0.0: poll_reply())))

    async def run():
        streams = DecodeStreams()
        with streams.inbox("a", "decode-1") as qa, streams.inbox("b", "decode-0") as qb:
            await asyncio.wait_for(streams.poll(w, lambda w, why: deaths.append(why)), timeout=10)
            return qa.get_nowait(), qb.empty()

    ev, other_untouched = asyncio.run(run())
    assert isinstance(ev, RequestFailed) and "health ping timed out" in ev.reason
    assert other_untouched and deaths == []


def test_an_unmeasured_prefill_worker_is_admitted_as_much_as_the_slowest_measured_one(tiny_model_dir):
    """A fresh worker's first prompt is slow (warm-up); held to one prompt until then, it would watch the measured
    worker take a whole burst. It is capped as the pool's slowest measured worker instead (and one prompt at a time
    only while no worker is measured)."""
    adm = PrefillAdmission(ClusterSpec(model_dir=str(tiny_model_dir), max_num_batched_tokens=64, lease_base_s=2.0))
    fast, slow, fresh = (Worker(WorkerLoad(f"prefill-{i}"), _actor()) for i in range(3))
    assert adm.cap(fresh) == 0  # nothing measured: one prompt at a time
    fast.observe_speed(0.01, 1)
    slow.observe_speed(0.04, 1)
    assert adm.cap(fast) == min(64 * 4, 0.5 * 2.0 / 0.01) and adm.cap(slow) == 0.5 * 2.0 / 0.04 == adm.cap(fresh, 0.04)

    async def place(n: int) -> list[str]:
        picks = []
        for i in range(n):  # 10-token prompts, distinct: no prefix affinity
            pw, _ = await adm.admit(lambda: [fast, fresh], 10, [], f"r{i}", time.monotonic() + 0.5, frozenset())
            picks.append(pw.worker_id)
        return picks

    fast.charge(200, 0)  # the measured worker is busy: the fresh one takes prompts beyond its first
    picks = asyncio.run(place(3))
    assert picks == ["prefill-2"] * 3 and fresh.prefill_tokens == 30


def test_a_local_prefill_waits_behind_at_most_one_prompt_of_its_length():
    from cluster.control.admission import LOCAL_PENDING_MIN_TOKENS, pick_local_decode_worker
    w = Worker(WorkerLoad("decode-0", free_blocks=1000), _actor())
    pick = lambda tokens: pick_local_decode_worker([w], tokens, 4096, 16, draining=set())  # noqa: E731
    assert pick(4097) is None  # over the limit: the prefill pool's
    assert pick(4096) is w  # nothing pending: any prompt up to the limit
    w.local_tokens = 1000
    assert pick(1000) is w and pick(900) is None  # behind one prompt of its own length, not a longer one
    w.local_tokens = 3 * LOCAL_PENDING_MIN_TOKENS // 2
    assert pick(LOCAL_PENDING_MIN_TOKENS // 2) is w  # short prompts count as LOCAL_PENDING_MIN_TOKENS long
    assert pick(LOCAL_PENDING_MIN_TOKENS // 2 + 1) is None
    w.local_tokens, w.load.free_blocks = 0, 10
    assert pick(160) is w and pick(161) is None  # 10 blocks of 16 tokens hold 160


def test_a_woken_request_runs_before_the_next_poll_is_sent():
    """Sending a poll holds the front-end loop (~1 ms with Ray): the requests a reply woke go first, so a first token
    does not wait for it."""
    from node_common import messages

    order: list[str] = []
    replies = [messages.pack(events=[TokenEvent("r", 0, [7]).to_wire()], free_blocks=3)]

    def poll(timeout_s, epoch=0, coalesce_s=0.0):
        order.append("poll")
        if not replies:
            w.mark_dead("test over")

        async def reply():
            return replies.pop() if replies else messages.pack(events=[], free_blocks=3)
        return reply()

    w = Worker(WorkerLoad("decode-0"), SimpleNamespace(poll=SimpleNamespace(remote=poll)))

    async def run():
        streams = DecodeStreams()
        with streams.inbox("r", "decode-0") as q:
            async def consume():
                ev = await q.get()
                order.append(f"token {ev.token_ids}")
            consumer = asyncio.create_task(consume())
            await asyncio.sleep(0)  # the consumer waits on its inbox
            await asyncio.wait_for(streams.poll(w, lambda w, why: None), timeout=10)
            await consumer

    asyncio.run(run())
    assert order[:3] == ["poll", "token [7]", "poll"]
