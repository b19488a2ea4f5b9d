"""Prefill and decode workers wired in one process over the in-process transport (no Ray): the disaggregated path
gives exactly the local engine's tokens, streamed per layer or sent whole, greedy and seeded sampling, and frees
every block on both sides — also when a transfer fails or is aborted. Every step's typed events carry each token
once, end each request with exactly one ``finished`` event (or one RequestFailed), and no request record outlives
its request."""

from __future__ import annotations

import pytest

from decode_node.worker import DecodeWorker
from engine import LLM, EngineConfig, SamplingParams
from kv_transfer import KVPoll, LeasePolicy
from node_common.events import RequestFailed, TokenEvent, event_from_wire
from kv_transfer.inproc.manager import Manager as InprocManager
from prefill_node.worker import PrefillWorker
from tests.conftest import LLM_DEFAULTS, greedy, make_image, make_request

CFG = dict(dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128)


def _pair(model_dir, stream_layers=True):
    pm, dm = InprocManager(), InprocManager()
    return PrefillWorker(model_dir, EngineConfig(**CFG), stream_layers=stream_layers), \
        DecodeWorker(model_dir, EngineConfig(**CFG), dm), pm


def _run(pw, dw, pm, prompts, params, *, tamper=None):
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        lease = dw.allocate(f"r{i}", p, sp)
        sender = pm.sender(lease)
        if tamper is not None and i == 0:
            sender.tamper = tamper
        pw.submit(f"r{i}", p, sp, sender)
    tokens, failed, _ = _step_until_idle(pw, dw)
    return [tokens.get(f"r{i}") for i in range(len(prompts))], failed


def _step_until_idle(pw, dw):
    """Step both workers until neither has work; returns the tokens by request id, the failures and every event
    (checked by :func:`_check_events`)."""
    tokens, failed, events = {}, {}, []
    for _ in range(2000):
        if not (pw.has_work() or dw.has_work()):
            break
        pw.step()
        report = dw.step()
        failed.update(report.failed)
        events.extend(event_from_wire(ev.to_wire()) for ev in report.events)
        for out in report.outputs:
            tokens[out.request_id] = out.outputs[0].token_ids
        if not pw.has_work() and dw.receivers:
            next(iter(dw.receivers.values())).wait(0.05)
    _check_events(events, tokens, failed)
    return tokens, failed, events


def _check_events(events, tokens: dict[str, list[int]], failed: dict[str, str]) -> None:
    """What the front-end would read: each finished request's tokens once, in order, its last event (only) finished;
    a failed request one RequestFailed with the report's reason and nothing after it."""
    assert {e.request_id: e.reason for e in events if isinstance(e, RequestFailed)} == failed
    for rid, want in tokens.items():
        mine = [e for e in events if e.request_id == rid]
        if rid in failed:
            assert isinstance(mine[-1], RequestFailed)
            continue
        assert all(isinstance(e, TokenEvent) and e.index == 0 for e in mine)
        assert [t for e in mine for t in e.token_ids] == want
        assert [e.finished for e in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].choice_finished and mine[-1].finish_reason is not None


def _local(model_dir, prompts, params):
    llm = LLM(model_dir, **{**LLM_DEFAULTS, **CFG})
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _idle(pw, dw):
    for w in (pw, dw):
        w.engine.block_manager.check_no_leaks()
        assert not w.engine.requests
    assert not dw.requests and dw.receiving == 0


@pytest.mark.parametrize("stream_layers", [True, False], ids=["layerwise", "whole"])
def test_disaggregated_tokens_equal_local(tiny_model_dir, stream_layers):
    prompts = [make_request(6 + 2 * i, seed=i, images=[make_image(i)] * (i % 2)) for i in range(4)]
    params = [greedy(4 + i) for i in range(3)] + [SamplingParams(temperature=0.8, top_k=20, max_tokens=6, seed=11)]
    pw, dw, pm = _pair(tiny_model_dir, stream_layers)
    got, failed = _run(pw, dw, pm, prompts, params)
    assert not failed
    assert got == _local(tiny_model_dir, prompts, params)
    _idle(pw, dw)


def test_routing_hints_and_transfer_stats(tiny_model_dir):
    pw, dw, pm = _pair(tiny_model_dir)
    prompt = make_request(9, seed=3)
    lease = dw.allocate("r", prompt, greedy(2))
    pw.submit("r", prompt, greedy(2), pm.sender(lease))
    hints = stats = None
    while pw.has_work() or dw.has_work():
        pw.step()
        report = dw.step()
        hints = hints or report.routing_hints.get("r")
        stats = stats or report.transfers.get("r")
        if "r" in report.transfers:  # the commit's event carries both to the front-end
            first = next(e for e in report.events if e.request_id == "r")
            assert first.expert_hist == report.routing_hints["r"] and first.kv_transfer == report.transfers["r"]
    cfg = dw.engine.model_config.text
    assert len(hints) == cfg.num_layers and all(sum(row) == len(prompt["prompt_token_ids"]) * cfg.top_k
                                                for row in hints)
    assert stats["layers"] == cfg.num_layers and stats["bytes"] == lease.layout.transfer_nbytes(lease.num_blocks)
    assert stats["wire_bytes"] > 0  # the inproc receiver counts what travelled (declared on KVReceiver)
    _idle(pw, dw)


def test_corrupt_transfer_fails_and_frees_blocks(tiny_model_dir):
    def flip(header, payload):
        payload[0] ^= 0xFF

    pw, dw, pm = _pair(tiny_model_dir)
    got, failed = _run(pw, dw, pm, [make_request(7, seed=1), make_request(5, seed=2)], [greedy(3), greedy(3)],
                       tamper=flip)
    assert "r0" in failed and "mismatch" in failed["r0"]
    assert got[0] is None and got[1] == _local(tiny_model_dir, [make_request(5, seed=2)], [greedy(3)])[0]
    _idle(pw, dw)


def test_abort_on_either_side_frees_both(tiny_model_dir):
    pw, dw, pm = _pair(tiny_model_dir)
    prompt = make_request(12, seed=4)
    lease = dw.allocate("a", prompt, greedy(3))
    sender = pm.sender(lease)
    pw.submit("a", prompt, greedy(3), sender)
    dw.abort("a")
    assert sender.wait(2.0) == KVPoll.FAILED
    pw.step()  # sees the failed transfer and drops the prefill
    _idle(pw, dw)


def test_lease_deadline_scales_with_bytes_and_expiry_frees_blocks(tiny_model_dir):
    import time

    dw = DecodeWorker(tiny_model_dir, EngineConfig(**CFG), InprocManager(),
                      lease=LeasePolicy(base_s=0.2, min_rate_bps=1e9))
    prompt = make_request(9, seed=8)
    lease = dw.allocate("x", prompt, greedy(2))
    nbytes = lease.layout.transfer_nbytes(lease.num_blocks)
    assert time.time() < lease.deadline_s <= time.time() + 0.2 + nbytes / 1e9 + 0.05
    time.sleep(0.3)  # nobody sends
    report = dw.step()
    assert "x" in report.failed and "deadline" in report.failed["x"]
    assert report.events == [RequestFailed("x", report.failed["x"])]
    dw.engine.block_manager.check_no_leaks()
    assert not dw.requests


def _count_calls(monkeypatch, obj, name: str) -> list[int]:
    calls = [0]
    inner = getattr(obj, name)

    def counted(*a, **kw):
        calls[0] += 1
        return inner(*a, **kw)
    monkeypatch.setattr(obj, name, counted)
    return calls


def test_decode_worker_never_processes_or_encodes_images_it_received(tiny_model_dir, monkeypatch):
    """The prompt's image features only matter where the prompt is computed: the decode worker neither resizes the
    images nor runs its vision tower for a request whose KV it received (same tokens as the local engine)."""
    prompts = [make_request(6, seed=1, images=[make_image(1), make_image(2)]), make_request(8, seed=2)]
    params = [greedy(6), greedy(5)]
    pw, dw, pm = _pair(tiny_model_dir)
    encoded = {w: _count_calls(monkeypatch, w.engine.runner.model, "encode_images") for w in (pw, dw)}
    processed = {w: _count_calls(monkeypatch, w.engine.inputs.image_processor, "resize") for w in (pw, dw)}
    got, failed = _run(pw, dw, pm, prompts, params)
    assert not failed and got == _local(tiny_model_dir, prompts, params)
    assert encoded[pw] == [1] and processed[pw] == [1]  # both images in one batch, once
    assert encoded[dw] == [0] and processed[dw] == [0]
    _idle(pw, dw)


def test_decode_worker_encodes_images_when_a_preemption_recomputes_the_prompt(tiny_model_dir, monkeypatch):
    """Pressed for blocks, the decode worker preempts a request and recomputes it from its tokens: only then does
    it process and encode the images (lazily), and the tokens still equal the local engine's."""
    prompts = [make_request(6, seed=s, images=[make_image(s), make_image(s + 1)]) for s in (1, 2)]
    params = [greedy(20), greedy(20)]
    pm = InprocManager()
    pw = PrefillWorker(tiny_model_dir, EngineConfig(**CFG))
    dw = DecodeWorker(tiny_model_dir, EngineConfig(**{**CFG, "num_kv_blocks": 10}), InprocManager())
    encoded = _count_calls(monkeypatch, dw.engine.runner.model, "encode_images")
    got, failed = _run(pw, dw, pm, prompts, params)
    assert not failed and got == _local(tiny_model_dir, prompts, params)
    assert encoded[0] >= 1
    _idle(pw, dw)


def test_a_decode_worker_without_its_vision_tower_decodes_image_prompts_and_refuses_to_encode_them(tiny_model_dir):
    """``vision_tower=False`` (what a decode actor runs: its prompts come without pixels): the tower is neither built
    nor loaded, image prompts prefilled elsewhere decode to the local engine's tokens, and a prompt whose images
    would have to be encoded here is refused with a typed error, nothing kept."""
    from engine.errors import InvalidRequestError

    prompts = [make_request(6, seed=s, images=[make_image(s)]) for s in (1, 2)] + [make_request(9, seed=5)]
    params = [greedy(8), greedy(6), greedy(7)]
    pm = InprocManager()
    pw = PrefillWorker(tiny_model_dir, EngineConfig(**CFG))
    dw = DecodeWorker(tiny_model_dir, EngineConfig(**CFG, vision_tower=False), InprocManager())
    assert dw.engine.model.vision is None
    assert not any(n.startswith("vision.") for n, _ in dw.engine.model.named_parameters())
    assert any(n.startswith("vision.") for n, _ in pw.engine.model.named_parameters())
    got, failed = _run(pw, dw, pm, prompts, params)
    assert not failed and got == _local(tiny_model_dir, prompts, params)
    free = dw.free_blocks
    with pytest.raises(InvalidRequestError, match="vision tower"):
        dw.engine.add_request("img", prompts[0], greedy(2))
    assert dw.free_blocks == free and "img" not in dw.engine.requests
    _idle(pw, dw)


def test_a_prefill_worker_reports_the_requests_it_gave_up(tiny_model_dir):
    """A request whose transfer failed before its prefill ran (the decode side aborted it) is dropped by the prefill
    worker and named in its next report, once, with the reason: a front-end whose decode side may not know (a lease
    waiting for its transfer to start) ends that attempt from it."""
    pw, dw, pm = _pair(tiny_model_dir)
    prompt, sp = make_request(6, seed=70), greedy(2)
    lease = dw.allocate("gone", prompt, sp, start_by_s=__import__("time").time() + 60)
    assert lease.start_by_s is not None and lease.transfer_s is not None
    sender = pm.sender(lease)
    pw.submit("gone", prompt, sp, sender)
    pw.take_report()  # what the submit reply would carry
    dw.abort("gone")
    assert sender.wait(5) is KVPoll.FAILED
    pw.step()
    report = pw.take_report()
    assert [rid for rid, _ in report["dropped"]] == ["gone"] and "transfer failed" in report["dropped"][0][1]
    assert pw.take_report()["dropped"] == [] and not pw.has_work()
    assert not dw.has_work()


def test_a_transfer_that_fails_after_the_hand_off_is_reported_too(tiny_model_dir):
    """The prefill worker handed the request off (every layer and the finish frame queued) but the transfer failed
    afterwards (here: the decode side aborted it): the next report names it."""
    pw, dw, pm = _pair(tiny_model_dir)
    prompt, sp = make_request(5, seed=71), greedy(2)
    lease = dw.allocate("late", prompt, sp, start_by_s=__import__("time").time() + 60)
    sender = pm.sender(lease)
    sender.tamper = lambda header, payload: header.update(v=99)  # every frame refused: the receiver fails
    pw.submit("late", prompt, sp, sender)
    for _ in range(50):
        if not pw.has_work():
            break
        pw.step()
    assert not pw.has_work() and sender.wait(5) is KVPoll.FAILED
    report = pw.take_report()
    assert [rid for rid, _ in report["dropped"]] == ["late"] and "after the hand-off" in report["dropped"][0][1]
    assert pw.take_report()["dropped"] == []
    dw.step()
    assert not dw.has_work()


def test_a_landed_transfer_calls_on_transfer_done_before_it_is_committed(tiny_model_dir):
    """The decode worker's ``on_transfer_done`` runs once per transfer, as it lands and before any step commits it
    (the actor's loop wakes on it instead of finding the transfer at its next 2 ms poll)."""
    pw, dw, pm = _pair(tiny_model_dir)
    landed = []
    dw.on_transfer_done = lambda: landed.append(dict(dw.receivers))
    prompts = [make_request(6, seed=31), make_request(9, seed=32)]
    for i, p in enumerate(prompts):
        pw.submit(f"r{i}", p, greedy(3), pm.sender(dw.allocate(f"r{i}", p, greedy(3))))
    while pw.has_work():
        pw.step()
    for receiver in list(dw.receivers.values()):
        receiver.wait(10)
    assert len(landed) == 2 and all(len(r) == 2 for r in landed)  # both called while both were still uncommitted
    tokens, failed, _ = _step_until_idle(pw, dw)
    assert not failed and len(landed) == 2 and set(tokens) == {"r0", "r1"}
    pm.close()
