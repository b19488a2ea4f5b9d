"""The engine's hooks (:mod:`engine.hooks`) are declared once, at construction, and reach their owners: the block
manager's eviction hook, the runner's routing and query-capture switches, the engine's KV exporter and choice
forking. Defaults give a plain engine."""

from __future__ import annotations

import pytest

from engine import EngineHooks, LLMEngine
from engine.config import EngineConfig
from tests.conftest import LLM_DEFAULTS, assert_no_leaked_blocks, greedy, make_request


def test_defaults_give_a_plain_engine(tiny_model_dir):
    e = LLMEngine(tiny_model_dir, EngineConfig(**LLM_DEFAULTS))
    assert e.hooks == EngineHooks() and e.hooks.fork_choices and e.hooks.kv_exporter is None
    assert e.block_manager.on_evict is None and e.runner.query_window == 0 and not e.runner.track_routing


def test_each_hook_reaches_its_owner_and_is_called(tiny_model_dir):
    exported: list[tuple[int, list[str]]] = []
    evicted: list[bytes] = []
    hooks = EngineHooks(kv_exporter=lambda layer, seqs: exported.append((layer, [s.request_id for s in seqs])),
                        fork_choices=False, track_routing=True, query_window=4, on_evict=evicted.append)
    e = LLMEngine(tiny_model_dir, EngineConfig(**LLM_DEFAULTS), hooks=hooks)
    assert e.block_manager.on_evict is hooks.on_evict and e.runner.query_window == 4 and e.runner.track_routing
    e.add_request("r", make_request(8), greedy(1, n=2, temperature=1.0, seed=0))
    seq = e.requests["r"]
    while e.has_unfinished_requests():
        e.step()
    assert exported == [(i, ["r"]) for i in range(e.model_config.text.num_layers)]  # each layer once, in order
    assert len(seq.group) == 1 and len(seq.pending_choices) == 1  # choice 1's first token kept, unforked
    assert seq.expert_hist is not None and seq.expert_hist.sum() > 0  # the tiny model is MoE
    assert e.abort_request("r")  # the other choice never runs here: the owner ends the request, as a prefill worker
    assert_no_leaked_blocks(e)


def test_a_negative_query_window_is_refused():
    with pytest.raises(ValueError, match="query_window"):
        EngineHooks(query_window=-1)
