"""The decode actor's ``poll`` reply, in-process (no Ray: the actor class runs its loop thread here): versioned
event wire maps (:mod:`node_common.events`) that ``event_from_wire`` reads, the request's tokens once and in order
with one ``finished`` event, a failed transfer as one ``failed`` event, and no block or request record left."""

from __future__ import annotations

import threading
import time

import pytest

from decode_node.actor import DecodeActor
from engine import LLM, EngineConfig
from engine.errors import TokenOutOfVocabError
from engine.inputs import InputProcessor
from kv_transfer import Lease
from kv_transfer.inproc.manager import Manager as InprocManager
from node_common import messages, prompt_wire
from node_common.events import EVENT_VERSION, RequestFailed, TokenEvent, event_from_wire
from prefill_node.worker import PrefillWorker
from tests.conftest import greedy, make_request

CFG = dict(dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128)


@pytest.fixture
def actor(tiny_model_dir, request):
    a = DecodeActor("decode-t", str(tiny_model_dir), CFG, "inproc", **getattr(request, "param", {}))
    yield a
    a.shutdown()


def _allocate(actor: DecodeActor, rid: str, prompt, params) -> Lease:
    reply = messages.unpack(actor.allocate(messages.pack(
        request_id=rid, prompt=prompt_wire.prompt_to_wire(prompt, for_encoder=False),
        params=messages.params_to_dict(params))))
    return Lease.from_dict(reply["lease"])


def _poll_until(actor: DecodeActor, done, timeout_s: float = 60.0, step=lambda: None) -> list:
    events, end = [], time.monotonic() + timeout_s
    while not done(events):
        assert time.monotonic() < end, events
        step()
        reply = messages.unpack(actor.poll(0.01))
        assert set(reply) == {"v", "events", "free_blocks"}
        assert all(w["v"] == EVENT_VERSION for w in reply["events"])
        events.extend(event_from_wire(w) for w in reply["events"])
    return events


def _idle(actor: DecodeActor) -> None:
    end = time.monotonic() + 10
    while not messages.unpack(actor.check_no_leaks())["idle"]:
        assert time.monotonic() < end
        time.sleep(0.01)
    assert not actor.worker.requests and messages.unpack(actor.stats())["receiving"] == 0


def test_poll_streams_typed_token_events(actor, tiny_model_dir):
    pw = PrefillWorker(tiny_model_dir, EngineConfig(**CFG))
    e = pw.engine
    prompt = InputProcessor(e.model_config, e.tokenizer, e.image_processor, e.max_model_len).process(
        make_request(9, seed=5))
    params = greedy(5)
    lease = _allocate(actor, "r", prompt, params)
    pm = InprocManager()
    pw.submit("r", prompt_wire.prompt_from_wire(prompt_wire.prompt_to_wire(prompt, for_encoder=True)), params,
              pm.sender(lease))
    events = _poll_until(actor, lambda evs: any(ev.finished for ev in evs),
                         step=lambda: pw.step() if pw.has_work() else None)
    assert all(isinstance(ev, TokenEvent) and ev.request_id == "r" for ev in events)
    want = LLM(tiny_model_dir, **CFG).generate([make_request(9, seed=5)], params)[0].outputs[0].token_ids
    assert [t for ev in events for t in ev.token_ids] == want
    assert [ev.finished for ev in events] == [False] * (len(events) - 1) + [True]
    assert events[0].kv_transfer is not None and events[0].kv_transfer["transport"] == "inproc"
    _idle(actor)
    pm.close()


def test_a_received_request_decodes_without_idle_waits(actor, tiny_model_dir):
    """The loop step that commits a transfer starts the request decoding: the loop must not then wait for new work
    as if it were idle (it waited up to 50 ms, once per received request, before the second decode step)."""
    idle_waits_while_running = []

    class Wake(threading.Event):
        def wait(self, timeout=None):
            idle_waits_while_running.append(actor.worker.engine.has_unfinished_requests())
            return super().wait(timeout)

    actor.wake = Wake()
    pw = PrefillWorker(tiny_model_dir, EngineConfig(**CFG))
    e = pw.engine
    prompt = InputProcessor(e.model_config, e.tokenizer, e.image_processor, e.max_model_len).process(
        make_request(9, seed=7))
    pm = InprocManager()
    for rid in ("a", "b"):  # each commits on an idle worker
        lease = _allocate(actor, rid, prompt, greedy(6))
        pw.submit(rid, prompt_wire.prompt_from_wire(prompt_wire.prompt_to_wire(prompt, for_encoder=True)), greedy(6),
                  pm.sender(lease))
        events = _poll_until(actor, lambda evs: any(ev.finished for ev in evs),
                             step=lambda: pw.step() if pw.has_work() else None)
        assert sum(len(ev.token_ids) for ev in events) == 6
        _idle(actor)
    assert idle_waits_while_running and not any(idle_waits_while_running)
    pm.close()


@pytest.mark.parametrize("actor", [{"lease_base_s": 0.2, "lease_min_rate_bps": 1e9}], indirect=True,
                         ids=["short-lease"])
def test_expired_lease_is_one_failed_event(actor):
    e = actor.worker.engine
    prompt = InputProcessor(e.model_config, e.tokenizer, e.image_processor, e.max_model_len).process(
        make_request(7, seed=2))
    _allocate(actor, "x", prompt, greedy(2))  # nobody sends
    events = _poll_until(actor, lambda evs: bool(evs), timeout_s=10)
    assert len(events) == 1 and isinstance(events[0], RequestFailed) and events[0].request_id == "x"
    assert events[0].reason.startswith("TransferTimeout")
    _idle(actor)


def test_reset_ends_every_request_and_old_polls_get_nothing(actor):
    """A new front-end took the worker over (cluster.control.reattach): the old one's requests end, its unpolled
    events are dropped, and a poll carrying the old epoch -- one the dead front-end left in flight -- takes nothing
    from the new one's stream."""
    e = actor.worker.engine
    prompt = InputProcessor(e.model_config, e.tokenizer, e.image_processor, e.max_model_len).process(
        make_request(7, seed=2))
    _allocate(actor, "old", prompt, greedy(2))
    reply = messages.unpack(actor.reset("its front-end restarted"))
    assert reply["ended"] == 1 and reply["epoch"] == 1 and not actor.worker.requests
    assert messages.unpack(actor.poll(0.01, 0))["events"] == []  # the old front-end's poll
    _allocate(actor, "new", prompt, greedy(2))  # nobody sends: its lease expires into one failed event
    assert messages.unpack(actor.poll(0.2, 0))["events"] == []
    events, end = [], time.monotonic() + 10
    while not events:
        assert time.monotonic() < end
        events = [event_from_wire(w) for w in messages.unpack(actor.poll(0.05, 1))["events"]]
    assert [ev.request_id for ev in events] == ["new"]
    _idle(actor)


def test_polls_coalesce_further_tokens_but_never_hold_a_first_token_or_an_end(actor):
    """``coalesce_s``: a reply carrying only further tokens comes no sooner than that after the previous reply; the
    first token (and the request's end) is not held back for it. The request is one the decode worker prefills
    itself (``admit_local``), whose first event carries ``kv_transfer`` with ``transport: "local"``."""
    prompt = InputProcessor(actor.worker.engine.model_config, None, None, 128).process(make_request(7, seed=5))
    reply = messages.unpack(actor.admit_local(messages.pack(
        request_id="c", prompt=prompt_wire.prompt_to_wire(prompt, for_encoder=False),
        params=messages.params_to_dict(greedy(60)))))
    assert set(reply) == {"v", "free_blocks"}
    replies, end = [], time.monotonic() + 60
    while not any(e.finished for _, evs in replies for e in evs):
        assert time.monotonic() < end
        got = messages.unpack(actor.poll(1.0, 0, 0.1))["events"]
        replies.append((time.monotonic(), [event_from_wire(w) for w in got]))
    events = [e for _, evs in replies for e in evs]
    assert len([t for e in events for t in e.token_ids]) == 60 and events[-1].finish_reason == "length"
    first = next(i for i, (_, evs) in enumerate(replies) if evs)
    assert replies[first][1][0].kv_transfer["transport"] == "local"
    assert sum(len(e.token_ids) for e in replies[first][1]) < 30  # not held until many steps had run
    for (t0, _), (t1, evs) in zip(replies[first:], replies[first + 1:]):
        if evs and not any(e.finished for e in evs):
            assert t1 - t0 >= 0.08, (t1 - t0, evs)
    _idle(actor)


def test_a_local_admission_checks_at_once_and_an_abort_before_its_step_leaves_nothing(actor):
    wire = lambda p: prompt_wire.prompt_to_wire(p, for_encoder=False)  # noqa: E731
    proc = InputProcessor(actor.worker.engine.model_config, None, None, 128)
    out_of_vocab = {**wire(proc.process(make_request(6, seed=9))), "token_ids": [1, 2, 10_000]}
    with pytest.raises(TokenOutOfVocabError):  # checked on the caller's thread: a typed error reply
        messages.unpack(actor.admit_local(messages.pack(
            request_id="bad", prompt=out_of_vocab, params=messages.params_to_dict(greedy(3)))))
    for i in range(5):  # aborted at once: before or after the loop took it into the batch, it ends without a trace
        rid = f"a{i}"
        messages.unpack(actor.admit_local(messages.pack(
            request_id=rid, prompt=wire(proc.process(make_request(6, seed=i))), params=messages.params_to_dict(
                greedy(200)))))
        assert actor.abort(rid)
    _idle(actor)
    assert not actor._intake


@pytest.mark.parametrize("actor", [{"max_threads": 2}], indirect=True)
def test_a_first_token_on_its_way_keeps_steps_narrow_until_the_front_end_polls_again(actor):
    """While an urgent event (here a first token) is unpolled or just replied, steps keep to ``num_threads`` so the
    front-end's process has a core to take it; the front-end's next poll ends that. A front-end that does not poll
    holds nothing up: the loop waits for a pick-up once per urgent event, at most ``PICKUP_S``, and the hand-off
    ends after ``HANDOFF_S`` whatever happens."""
    from decode_node import actor as actor_mod

    prompt = InputProcessor(actor.worker.engine.model_config, None, None, 128).process(make_request(7, seed=3))
    messages.unpack(actor.admit_local(messages.pack(
        request_id="h", prompt=prompt_wire.prompt_to_wire(prompt, for_encoder=False),
        params=messages.params_to_dict(greedy(30)))))
    end = time.monotonic() + 60
    while not actor._urgent:  # nobody polls: the first token waits in pending
        assert time.monotonic() < end
        time.sleep(0.001)
    assert actor._handoff_until > 0 and actor._urgent
    first = [event_from_wire(w) for w in messages.unpack(actor.poll(1.0))["events"]]
    assert first and first[0].kv_transfer is not None and actor._handed
    messages.unpack(actor.poll(0.0))  # the front-end is back: the hand-off is over
    assert actor._handoff_until == 0.0 and not actor._handed
    events = _poll_until(actor, lambda evs: any(e.finished for e in evs))
    assert sum(len(e.token_ids) for e in first + events) == 30
    assert not actor._pickup_due  # the first token and the end were each waited for (once, at most PICKUP_S)
    assert 0 < actor_mod.PICKUP_S <= 0.01 and 0 < actor_mod.HANDOFF_S <= 0.05
    _idle(actor)


def test_the_loopback_lane_takes_a_prompt_and_pushes_its_events(actor):
    """The front-end's fast lane (:mod:`node_common.lane`): ``admit_local`` over the socket, every event pushed
    without a poll call, the same tokens as over Ray; a new front-end generation (``reset``) closes the old lane."""
    import asyncio

    from cluster.control.lane_client import Lane, LaneClosed

    info = messages.unpack(actor.lane())
    assert info["host"] == "127.0.0.1" and len(info["token"]) == 32
    assert messages.unpack(actor.lane())["port"] == info["port"]  # opened once
    prompt = InputProcessor(actor.worker.engine.model_config, None, None, 128).process(make_request(7, seed=4))
    msg = messages.pack(request_id="l", prompt=prompt_wire.prompt_to_wire(prompt, for_encoder=False),
                        params=messages.params_to_dict(greedy(12)))

    async def run():
        lane = await Lane.open(info, epoch=actor.epoch, poll_s=0.2, coalesce_s=0.0)
        reply = messages.unpack(await lane.call("admit_local", msg, time.monotonic() + 30))
        assert set(reply) == {"v", "free_blocks"}
        events = []
        while not any(e.finished for e in events):
            events += [event_from_wire(w) for w in messages.unpack(await lane.next_events(30))["events"]]
        messages.unpack(actor.reset("a new front-end"))
        with pytest.raises(LaneClosed):
            while True:  # what was pushed before the reset, then the end
                await lane.next_events(30)
        lane.close()
        return events

    events = asyncio.run(run())
    assert sum(len(e.token_ids) for e in events) == 12 and events[0].kv_transfer["transport"] == "local"
    _idle(actor)
