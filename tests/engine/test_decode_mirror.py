"""The decode KV mirror: filled from the pool, appended per step, compacted on release, grown on demand; and the
engine's outputs through it equal step-by-step references when decoding sequences come and go mid-run."""

from __future__ import annotations

import torch

from engine.decode_mirror import DecodeKVMirror
from tests.conftest import greedy, make_request


def _pool(num_blocks: int = 8, block_size: int = 4, kvh: int = 2, d: int = 3, layers: int = 2):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(num_blocks, block_size, kvh, d, generator=g), torch.randn(num_blocks, block_size, kvh, d,
                                                                                  generator=g)) for _ in range(layers)]


def test_assign_fills_slot_from_pool_blocks_in_table_order():
    pool = _pool()
    m = DecodeKVMirror(2, max_slots=4, kv_heads=2, head_dim=3, dtype=torch.float32, device=torch.device("cpu"),
                       initial_capacity=4, initial_slots=1)
    slot = m.assign(seq_id=7, num_cached=6, pool=pool, block_table=[5, 2], next_len=7)
    assert slot == 0 and m.capacity >= 7  # grew from 4 by doubling
    for layer, (k, v) in enumerate(pool):
        want_k = torch.cat([k[5], k[2]])[:6]  # [6, kvh, d]
        assert torch.equal(m.k[layer][0, :, :6], want_k.transpose(0, 1))
        assert torch.equal(m.v[layer][0, :, :6], torch.cat([v[5], v[2]])[:6].transpose(0, 1))
    assert m.assign(7, 6, pool, [5, 2], 8) == 0  # known sequence: same slot, nothing refilled


def test_release_moves_last_slot_into_the_hole_and_growth_keeps_contents():
    pool = _pool()
    m = DecodeKVMirror(2, max_slots=8, kv_heads=2, head_dim=3, dtype=torch.float32, device=torch.device("cpu"),
                       initial_capacity=4, initial_slots=1)
    tables = {1: [0], 2: [1], 3: [2, 3]}
    for sid, table in tables.items():
        m.assign(sid, 4, pool, table, 5)
    assert [m.slot_of[s] for s in (1, 2, 3)] == [0, 1, 2]
    before = m.k[1][2].clone()
    m.release(1)
    assert m.slot_of == {2: 1, 3: 0} and m.seq_in_slot == [3, 2]
    assert torch.equal(m.k[1][0], before)
    m.release(99)  # unknown: no-op
    m.release(3)
    m.release(2)
    assert m.num_active == 0 and not m.slot_of


def test_decoders_joining_and_leaving_mid_run_match_solo_runs(make_llm):
    """Requests with different lengths and arrival steps: the batch's slots get holes, moves and new members, and
    every request still produces exactly its solo greedy tokens."""
    prompts = [make_request(5 + 3 * i, seed=i) for i in range(5)]
    lengths = [3, 9, 5, 12, 7]
    solo = make_llm()
    want = [solo.generate([p], greedy(n))[0].outputs[0].token_ids for p, n in zip(prompts, lengths, strict=True)]
    llm = make_llm(max_num_batched_tokens=12)
    eng = llm.engine
    got: dict[str, list[int]] = {}
    pending = list(enumerate(zip(prompts, lengths, strict=True)))
    step = 0
    while pending or eng.has_unfinished_requests():
        if pending and step % 2 == 0:  # a new request every other step
            i, (p, n) = pending.pop(0)
            eng.add_request(f"r{i}", p, greedy(n))
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert [got[f"r{i}"] for i in range(5)] == want
    assert eng.runner.mirror.num_active == 0


def test_mirror_growth_during_a_step_then_release_outside_it(make_llm):
    """More decoders than the mirror's initial slots: it grows inside the step; finishing requests (outside the
    step) must still be able to compact it."""
    llm = make_llm(max_num_seqs=12, num_kv_blocks=128)
    prompts = [make_request(4, seed=i) for i in range(12)]
    outs = llm.generate(prompts, [greedy(2 + i % 5) for i in range(12)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2 + i % 5 for i in range(12)]
    assert llm.engine.runner.mirror.num_active == 0
