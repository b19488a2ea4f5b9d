"""A decode worker that prefills short text prompts itself (``DecodeWorker.admit_local``, the default on hosts whose
cores the prefill and decode workers share): its tokens are the engine's, in the same batch as requests whose KV it
received; the first token event says so (``kv_transfer.transport == "local"``, the prefill stages measured there);
what it cannot do (a prompt with images: it holds no pixels) is a typed error that leaves nothing behind; an abort
frees every block."""

from __future__ import annotations

import pytest

from decode_node.worker import DecodeWorker
from engine import EngineConfig, SamplingParams
from engine.errors import InvalidRequestError
from kv_transfer.inproc.manager import Manager as InprocManager
from node_common.events import TokenEvent
from prefill_node.worker import PrefillWorker
from tests.conftest import greedy, make_image, make_request
from tests.decode_node.test_workers_inproc import CFG, _idle, _local, _step_until_idle


def _drive(pw, dw, pm, received, local):
    """``received``: (prompt, params) whose KV comes from ``pw``; ``local``: (prompt, params) ``dw`` prefills
    itself. Returns the tokens by request id, the failures and every event."""
    for i, (p, sp) in enumerate(received):
        pw.submit(f"x{i}", p, sp, pm.sender(dw.allocate(f"x{i}", p, sp)))
    for i, (p, sp) in enumerate(local):
        dw.admit_local(f"l{i}", p, sp)
    return _step_until_idle(pw, dw)


@pytest.fixture
def pair(tiny_model_dir):
    return (PrefillWorker(tiny_model_dir, EngineConfig(**CFG)),
            DecodeWorker(tiny_model_dir, EngineConfig(**CFG), InprocManager()), InprocManager())


def test_local_prefills_give_the_engines_tokens_beside_received_ones(tiny_model_dir, pair):
    pw, dw, pm = pair
    received = [(make_request(7, seed=1, images=[make_image(1)]), greedy(5)),
                (make_request(9, seed=2), greedy(4))]
    local = [(make_request(6 + 3 * i, seed=10 + i), greedy(3 + i)) for i in range(3)]
    local.append((make_request(8, seed=20), SamplingParams(temperature=0.8, top_k=20, max_tokens=6, seed=5)))
    tokens, failed, events = _drive(pw, dw, pm, received, local)
    assert not failed
    want = _local(tiny_model_dir, [p for p, _ in received + local], [sp for _, sp in received + local])
    got = [tokens[f"x{i}"] for i in range(len(received))] + [tokens[f"l{i}"] for i in range(len(local))]
    assert got == want
    first = {e.request_id: e for e in reversed(events) if isinstance(e, TokenEvent) and e.kv_transfer}
    for i in range(len(local)):
        kv = first[f"l{i}"].kv_transfer
        assert kv["transport"] == "local" and kv["bytes"] == 0 and kv["exposed_seconds"] == 0.0
        assert kv["prefill_stages"]["prefill_compute_s"] > 0.0
    assert first["x0"].kv_transfer["transport"] == "inproc" and first["x0"].kv_transfer["bytes"] > 0
    assert pw.prompt_tokens == sum(len(p["prompt_token_ids"]) for p, _ in received)  # the local ones never went there
    _idle(pw, dw)


def test_a_prompt_with_images_is_refused_and_nothing_is_kept(pair):
    pw, dw, _ = pair
    free = dw.free_blocks
    with pytest.raises(InvalidRequestError, match="pixels"):
        dw.admit_local("img", make_request(6, seed=3, images=[make_image(3)]), greedy(3))
    with pytest.raises(InvalidRequestError):  # the engine's own check: a token outside the vocabulary
        dw.admit_local("bad", {"prompt_token_ids": [1, 2, 10_000]}, greedy(3))
    assert dw.free_blocks == free and not dw.requests and not dw.has_work()
    _idle(pw, dw)


def test_aborting_a_local_request_frees_its_blocks(pair):
    pw, dw, _ = pair
    dw.admit_local("a", make_request(12, seed=4), greedy(50))
    dw.admit_local("b", make_request(10, seed=5), greedy(3))
    assert dw.local_prefilling
    dw.step()  # both prefilled in one step
    assert not dw.local_prefilling
    assert dw.abort("a")
    report = dw.step()
    while dw.has_work():
        report = dw.step()
    assert [o.request_id for o in report.outputs if o.finished] == ["b"]
    _idle(pw, dw)
