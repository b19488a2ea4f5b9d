"""Coded visual KV pages (engine.coded_kv): the page format's error bound, decode attention over pages (compiled
kernel and torch fallback) equal to attention over the dequantized keys, and the block manager's page accounting
(floor, forks, frees)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import engine.cpu_kernels as ck
from engine.block_manager import BlockManager
from engine.coded_kv import CodedKV, attend_torch, coded_blocks, coded_rows, page_capacity, read_pages, write_pages
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

LIB = ck.library()


def test_page_capacity_counts_statistics_and_codes():
    assert page_capacity(16, 64, 4) == 56  # K: 64 * 16 / 64 - 8 = 56; V: 4096 // 72 = 56
    assert page_capacity(16, 128, 4) == 56 and page_capacity(16, 128, 2) == 24
    assert page_capacity(4, 128, 2) == 0  # a 16-bit block of 4 tokens cannot even hold the statistics
    assert page_capacity(8, 24, 4) == 24
    assert page_capacity(16, 512, 4) == 0  # wider heads than the kernel reads keep their image KV plain


def test_coded_blocks_are_whole_image_blocks():
    positions = np.arange(5, 40)  # image tokens at 5..39
    assert coded_blocks(positions, 44, 8).tolist() == [1, 2, 3, 4]  # 8..39; block 0 mixes text and image
    assert coded_blocks(positions, 30, 8).tolist() == [1, 2]  # only full prompt blocks
    assert coded_blocks(None, 30, 8).tolist() == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 55, 56, 57, 200])
def test_pages_round_trip_within_half_a_step(dtype, n):
    bs, kvh, d = 16, 2, 64
    g = page_capacity(bs, d, torch.empty(0, dtype=dtype).element_size())
    pages = list(range(3, 3 + -(-n // g)))
    pk, pv = torch.zeros(16, bs, kvh, d, dtype=dtype), torch.zeros(16, bs, kvh, d, dtype=dtype)
    gen = torch.Generator().manual_seed(n)
    k = torch.randn(n, kvh, d, generator=gen)
    k[:, :, 5] *= 40  # an outlier channel: per-channel key statistics keep it from costing the others
    v = torch.randn(n, kvh, d, generator=gen)
    write_pages(pk, pv, pages, g, k, v)
    counts = [g] * (len(pages) - 1) + [n - g * (len(pages) - 1)]
    rk, rv = read_pages(pk, pv, pages, counts, g, kvh, d)
    for p, c in enumerate(counts):
        sl = slice(p * g, p * g + c)
        step_k = (k[sl].amax(0) - k[sl].amin(0)) / 255  # per channel over the page's tokens
        assert ((rk[sl] - k[sl]).abs() <= step_k / 2 + 1e-5).all()
        step_v = (v[sl].amax(2, keepdim=True) - v[sl].amin(2, keepdim=True)) / 255  # per token and head
        assert ((rv[sl] - v[sl]).abs() <= step_v / 2 + 1e-5).all()
    untouched = [b for b in range(16) if b not in pages]
    assert not pk[untouched].any() and not pv[untouched].any()


def _case(d, kvh, h, bs, lens, coded_counts, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = page_capacity(bs, d, 4)
    pk, pv = torch.randn(64, bs, kvh, d, generator=gen), torch.randn(64, bs, kvh, d, generator=gen)
    rows, ref, nxt = [], [], 0
    for n in coded_counts:
        if not n:
            rows.append(None)
            ref.append(None)
            continue
        pages = list(range(nxt, nxt + -(-n // g)))
        nxt += len(pages)
        write_pages(pk, pv, pages, g, 3 * torch.randn(n, kvh, d, generator=gen), torch.randn(n, kvh, d, generator=gen))
        counts = [g] * (len(pages) - 1) + [n - g * (len(pages) - 1)]
        rows.append(CodedKV(np.arange(0), pages, counts, bs))
        ref.append(read_pages(pk, pv, pages, counts, g, kvh, d))
    b = len(lens)
    cr = coded_rows(rows, np.array(lens), g)
    cr.max_keys = max(length + n for length, n in zip(lens, coded_counts, strict=True))
    mk, mv = torch.randn(2, b + 1, kvh, 80, d, generator=gen).unbind(0)
    q, kn, vn = torch.randn(b, h, d, generator=gen), torch.randn(b, kvh, d, generator=gen), torch.randn(b, kvh, d, generator=gen)
    slots = torch.arange(b)
    pos = torch.tensor([n - 1 for n in lens])
    return pk, pv, cr, ref, mk, mv, q, kn, vn, slots, pos


def _reference(q, mk, mv, slots, lens, ref, kvh):
    b, h, d = q.shape
    out = torch.empty_like(q)
    for i in range(b):
        k, v = mk[slots[i], :, :lens[i]], mv[slots[i], :, :lens[i]]
        if ref[i] is not None:
            k, v = torch.cat([k, ref[i][0].transpose(0, 1)], 1), torch.cat([v, ref[i][1].transpose(0, 1)], 1)
        for hh in range(h):
            j = hh // (h // kvh)
            out[i, hh] = torch.softmax(k[j] @ q[i, hh] * d ** -0.5, 0) @ v[j]
    return out


# D 16-multiples and not, GQA groups of 4, 2 and 80 (more than the kernel's 64 query heads a pass)
SHAPES = [(64, 2, 8, 16), (128, 4, 8, 16), (16, 2, 4, 16), (24, 1, 2, 8), (16, 1, 80, 16)]


@pytest.mark.skipif(LIB is None, reason="no C compiler")
@pytest.mark.parametrize("d,kvh,h,bs", SHAPES)
def test_kernel_attends_over_pages_as_over_their_values(d, kvh, h, bs):
    g = page_capacity(bs, d, 4)
    lens, coded = [10, 33, 1, 5], [0, 2 * g + 5, 17, g]
    pk, pv, cr, ref, mk, mv, q, kn, vn, slots, pos = _case(d, kvh, h, bs, lens, coded)
    out = ck.decode_attention(LIB, q, kn, vn, mk, mv, slots, pos, max(lens), d ** -0.5, coded=cr, pages=(pk, pv))
    assert torch.equal(mk[slots, :, pos], kn) and torch.equal(mv[slots, :, pos], vn)  # the new token was written
    torch.testing.assert_close(out, _reference(q, mk, mv, slots, lens, ref, kvh), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("d,kvh,h,bs", SHAPES[:2])
def test_torch_fallback_attends_over_pages_and_masks_dropped_tokens(d, kvh, h, bs):
    g = page_capacity(bs, d, 4)
    lens, coded = [7, 20], [g + 3, 0]
    pk, pv, cr, ref, mk, mv, q, _, _, slots, pos = _case(d, kvh, h, bs, lens, coded, seed=1)
    mask = torch.zeros(2, 1, 1, 20)
    mask[0, ..., 7:] = float("-inf")
    kd, vd = mk[:2, :, :20], mv[:2, :, :20]
    qg = q.view(2, kvh, h // kvh, d)
    got = attend_torch(qg, kd, vd, mask, cr, pk, pv, 0, d ** -0.5).reshape(2, h, d)
    torch.testing.assert_close(got, _reference(q, mk, mv, slots, lens, ref, kvh), rtol=1e-4, atol=1e-5)
    cr.rows[0].dropped[0] = np.array([0, g + 2])  # dropped coded tokens get no attention
    got = attend_torch(qg, kd, vd, mask, cr, pk, pv, 0, d ** -0.5).reshape(2, h, d)
    keep = [i for i in range(g + 3) if i not in (0, g + 2)]
    ref[0] = (ref[0][0][keep], ref[0][1][keep])
    torch.testing.assert_close(got, _reference(q, mk, mv, slots, lens, ref, kvh), rtol=1e-4, atol=1e-5)


def _seq(i: int, n: int, bs: int, positions: np.ndarray | None = None) -> Sequence:
    return Sequence(seq_id=i, request_id=f"r{i}", token_ids=list(range(n)), num_prompt_tokens=n,
                    params=SamplingParams(), block_size=bs)


def test_block_manager_pages_floor_fork_and_free():
    bm = BlockManager(20, 4, visual_floor=8)
    seq = _seq(0, 30, 4)  # 8 blocks, of which 3 coded into 2 pages
    coded = CodedKV(np.array([1, 2, 3]), [], [8, 4], 4)
    assert bm.allocate_received(seq, coded, 30, 2)
    assert seq.block_table.count(-1) == 3 and len(seq.block_table) == 8 and seq.coded is coded
    assert bm.num_pages == 2 and bm.num_free_blocks == 20 - 5 - 2
    assert bm.regions(100) == {"text_kv_bytes": 500, "visual_kv_bytes": 200, "floor_bytes": 800}
    assert bm.lend(11) is None and bm.lend_pages(11) is None  # 13 free, but the elastic region stops at 20 - 8
    lent = bm.lend(10)
    assert lent is not None and bm.lend(1) is None and bm.lend_pages(1) is None
    bm.give_back(lent)
    child = _seq(1, 30, 4)
    bm.fork(seq, child, 30)  # the full blocks and the pages are shared, the partial last block copied
    assert coded.refs == 2 and child.coded is coded and child.block_table[:7] == seq.block_table[:7]
    bm.free(seq)
    assert bm.num_pages == 2 and coded.pages  # the child still reads them
    bm.free(child)
    assert bm.num_pages == 0 and coded.refs == 0 and seq.coded is None
    bm.check_no_leaks()


def test_block_manager_refuses_what_it_cannot_hold_now_and_changes_nothing():
    bm = BlockManager(10, 4, visual_floor=2)
    seq = _seq(0, 30, 4)
    assert not bm.allocate_received(seq, CodedKV(np.array([1, 2, 3]), [], [8, 4], 4), 30, 9)  # > elastic room
    assert not bm.allocate_received(seq, None, 44, 0)  # 11 plain blocks > 10
    assert seq.block_table == [] and seq.coded is None and bm.num_pages == 0
    bm.check_no_leaks()
