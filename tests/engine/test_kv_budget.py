"""The KV budget covers everything attention reads: ``kv_cache_memory_gb`` pays for the decode mirror's starting
allocation (and a tower's workspace) before the paged pool, and the engine reports them (the mirror's growth
included)."""

from __future__ import annotations

import logging

import pytest

from engine import LLM
from engine.decode_mirror import INITIAL_CAPACITY, INITIAL_SLOTS, reserved_bytes
from tests.conftest import greedy, make_request

SEQS, BLOCK, MAX_LEN = 8, 4, 128


def _per_token(tiny_model_dir) -> int:
    llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=8, block_size=BLOCK, max_num_seqs=SEQS,
              max_model_len=MAX_LEN)
    return llm.engine.runner.kv_bytes_per_token


def _workspace(tiny_model_dir) -> int:
    """The vision tower's reserve the budget pays before the pool (engine.workspace.encoder_reserve)."""
    return LLM(tiny_model_dir, dtype="float32", num_kv_blocks=8, block_size=BLOCK, max_num_seqs=SEQS,
               max_model_len=MAX_LEN).engine.workspace


@pytest.mark.parametrize("mirror_tokens", [None, 32], ids=["mirror-on-demand", "mirror-reserved"])
def test_pool_plus_mirror_reservation_stay_within_the_budget(tiny_model_dir, mirror_tokens):
    per_token = _per_token(tiny_model_dir)
    reserved = reserved_bytes(SEQS, per_token, mirror_tokens)
    workspace = _workspace(tiny_model_dir)
    assert workspace > 0  # the tiny LLaVA model has a tower
    budget = reserved + workspace + 400 * per_token + 3  # room for exactly 100 blocks of 4 tokens after both
    llm = LLM(tiny_model_dir, dtype="float32", block_size=BLOCK, max_num_seqs=SEQS, max_model_len=MAX_LEN,
              kv_cache_memory_gb=budget / 2**30, decode_mirror_tokens=mirror_tokens)
    kv = llm.engine.kv_memory()
    assert llm.engine.block_manager.num_blocks == 100
    assert kv.pool_bytes == 100 * BLOCK * per_token
    assert kv.mirror_bytes == reserved == llm.engine.runner.mirror.nbytes
    assert kv.total_bytes == kv.pool_bytes + kv.mirror_bytes
    assert kv.workspace_bytes == workspace and kv.total_bytes + workspace <= kv.budget_bytes == budget


def test_worked_reservations():
    assert reserved_bytes(64, 10) == INITIAL_SLOTS * INITIAL_CAPACITY * 10  # on demand: the first 8 slots
    assert reserved_bytes(4, 10) == 4 * INITIAL_CAPACITY * 10  # never more slots than sequences
    assert reserved_bytes(64, 10, reserve_tokens=512) == 64 * 512 * 10


def test_budget_below_one_sequence_warns_and_keeps_one(tiny_model_dir, caplog):
    per_token = _per_token(tiny_model_dir)
    budget = reserved_bytes(SEQS, per_token)  # the mirror takes all of it
    with caplog.at_level(logging.WARNING, logger="engine.llm_engine"):
        llm = LLM(tiny_model_dir, dtype="float32", block_size=BLOCK, max_num_seqs=SEQS, max_model_len=MAX_LEN,
                  kv_cache_memory_gb=budget / 2**30)
    assert llm.engine.block_manager.num_blocks == MAX_LEN // BLOCK
    assert "over budget" in caplog.text


def test_fixed_pool_has_no_budget_and_reports_both(make_llm):
    llm = make_llm()
    kv = llm.engine.kv_memory()
    assert kv.budget_bytes is None
    assert kv.pool_bytes == 64 * 4 * llm.engine.runner.kv_bytes_per_token  # LLM_DEFAULTS: 64 blocks of 4
    assert kv.mirror_bytes == llm.engine.runner.mirror.nbytes > 0


def test_growing_the_mirror_updates_the_reported_bytes(make_llm):
    llm = make_llm(max_num_seqs=12, num_kv_blocks=128)
    eng = llm.engine
    before = eng.kv_memory()
    for i in range(12):  # more decoders than the mirror's first 8 slots
        eng.add_request(f"r{i}", make_request(4, seed=i), greedy(4))
    seen = [before.mirror_bytes]
    while eng.has_unfinished_requests():
        eng.step()
        seen.append(eng.kv_memory().mirror_bytes)
    after = eng.kv_memory()
    assert after.mirror_bytes == eng.runner.mirror.nbytes == before.mirror_bytes * 12 // 8  # 8 -> 12 slots
    assert max(seen) == after.mirror_bytes and after.pool_bytes == before.pool_bytes
    assert after.total_bytes == after.pool_bytes + after.mirror_bytes
