"""Experts stored in panels (engine.cpu_kernels.panel_pack, cpu_panels.c): the layout round-trips exactly, the MoE
kernel and the one-call decoder layer over it equal the references at every row count (row groups, the one-row
streams, steps over K, narrower last panels, both instruction-set levels), and SparseMoe keeps its experts only in
panels where the one-call path takes every step."""

from __future__ import annotations

import platform

import pytest
import torch

from engine import cpu_kernels, cpu_linear
from engine import moe as moe_mod
from engine.moe import SparseMoe
from tests.engine.test_cpu_kernels import LIB, _moe_reference, avx2_library, needs_lib
from tests.engine.test_cpu_linear import _moe

TOL = dict(rtol=1e-4, atol=1e-4)  # each output sums its K products in order (a GEMM in blocks): float rounding


@pytest.mark.parametrize("shape", [(3, 80, 37), (16, 5), (2, 192, 300), (1, 64, 1)])
def test_panel_pack_round_trips_and_lays_rows_out_k_major(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape)))
    p = cpu_kernels.panel_pack(w)
    assert p.shape == w.shape and torch.equal(cpu_kernels.panel_unpack(p), w)
    n, k = shape[-2:]
    flat, m = p.reshape(-1), w.reshape(-1, n, k)
    for row in (0, n - 1, min(n - 1, 70)):  # element (row, col) at n0 K + col pw + (row - n0)
        n0 = row // cpu_kernels.PANEL * cpu_kernels.PANEL
        pw = min(cpu_kernels.PANEL, n - n0)
        col = k - 1
        assert flat[n0 * k + col * pw + row - n0] == m[0, row, col]


def test_panels_fit_whole_vectors_of_float32_rows_only():
    assert cpu_kernels.panels_fit(torch.zeros(4, 48, 10))
    assert not cpu_kernels.panels_fit(torch.zeros(4, 40, 10))  # 40 rows: not whole vectors
    assert not cpu_kernels.panels_fit(torch.zeros(4, 48, 10, dtype=torch.bfloat16))
    assert not cpu_kernels.panels_fit(torch.zeros(48, 20).t())  # not contiguous


def _case(tokens: int, top_k: int, h: int, i: int, e: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2
    x = torch.randn(tokens, h, generator=g)
    experts = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    return x, gate_up, down, experts, weights


@needs_lib
@pytest.mark.parametrize("tokens,top_k,h,i,e", [
    (1, 2, 64, 128, 4),    # one row an expert: 2I = 256, four whole panels read as four streams
    (1, 1, 48, 40, 3),     # one row, panels of 64 and 16 rows (no four whole panels)
    (5, 2, 32, 24, 2),     # row groups of 4 and 1
    (7, 3, 160, 136, 3),   # groups of 6 and 1; K = 160 in steps of 128; last panels of 16 and 32 rows
    (90, 2, 160, 72, 4),   # many rows an expert: every group over each K step
])
def test_moe_over_panels_equals_the_reference(tokens, top_k, h, i, e):
    x, gate_up, down, experts, weights = _case(tokens, top_k, h, i, e, tokens + h)
    want = _moe_reference(x, gate_up, down, experts, weights)
    got = cpu_kernels.moe_silu(LIB, x, cpu_kernels.panel_pack(gate_up), cpu_kernels.panel_pack(down), experts,
                               weights, panel=True)
    torch.testing.assert_close(got, want, **TOL)


@needs_lib
def test_panel_results_do_not_depend_on_the_thread_count():
    x, gate_up, down, experts, weights = _case(30, 2, 48, 40, 5, 9)
    pg, pd = cpu_kernels.panel_pack(gate_up), cpu_kernels.panel_pack(down)
    before = torch.get_num_threads()
    try:
        got = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got.append(cpu_kernels.moe_silu(LIB, x, pg, pd, experts, weights, panel=True))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(g, got[0]) for g in got[1:])


@needs_lib
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86 instruction-set level")
def test_panels_built_without_avx512_equal_the_reference(tmp_path, monkeypatch):
    lib = avx2_library(tmp_path, monkeypatch)
    for tokens in (1, 9):
        x, gate_up, down, experts, weights = _case(tokens, 2, 64, 136, 3, tokens)
        got = cpu_kernels.moe_silu(lib, x, cpu_kernels.panel_pack(gate_up), cpu_kernels.panel_pack(down), experts,
                                   weights, panel=True)
        torch.testing.assert_close(got, _moe_reference(x, gate_up, down, experts, weights), **TOL)


@needs_lib
@pytest.mark.parametrize("upto,faster", [(moe_mod.FUSED_ALL, True), (moe_mod.FUSED_ALL, False), (16, True)])
def test_experts_live_in_panels_only_where_the_one_call_path_takes_every_step(monkeypatch, upto, faster):
    """Panels where the one-call path takes every step and they were measured faster; else row-major as before."""
    moe = _moe(5, hidden=32, inter=24)  # rows of both weights in whole vectors
    gu, down = moe.gate_up_proj.clone(), moe.down_proj.clone()
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(4))
    want = [moe(x[:t]) for t in (1, 3, 40)]
    monkeypatch.setattr(moe_mod, "_PATHS", {})
    monkeypatch.setattr(moe_mod, "_PANELS", {})
    monkeypatch.setattr(SparseMoe, "_measure_paths", lambda self: ((False, False, False), upto))
    monkeypatch.setattr(moe_mod, "panels_faster", lambda *a: faster)
    cpu_linear.pack_linears(moe, "auto")
    panels = upto == moe_mod.FUSED_ALL and faster
    assert moe.kernel_experts()[2] == panels and (moe.gate_up_proj.numel() == 0) == panels
    assert moe._packed is None  # no oneDNN copy beside them: no step runs it
    for t, w in zip((1, 3, 40), want, strict=True):
        torch.testing.assert_close(moe(x[:t]), w, **TOL)
    all_gu, all_down = moe.expert_weights()
    assert torch.equal(all_gu, gu) and torch.equal(all_down, down)  # rebuilt exactly from the panels
    moe.release_experts()  # an expert-parallel group takes them: nothing may read the panels after
    assert moe._fused is None and moe.kernel_experts()[2] is False and moe.panel_gate_up is None


@needs_lib
def test_the_panel_choice_is_measured_on_cold_copies_and_remembered(monkeypatch):
    monkeypatch.setattr(moe_mod, "_PANELS", {})
    monkeypatch.setattr(moe_mod, "PANEL_PROBES", (2, 9))
    monkeypatch.setattr(moe_mod, "_PANEL_COLD_BYTES", 1 << 16)
    calls = []
    real = cpu_kernels.moe_silu
    monkeypatch.setattr(cpu_kernels, "moe_silu", lambda *a, **kw: calls.append(kw.get("panel")) or real(*a, **kw))
    moe = _moe(5, hidden=32, inter=24)
    monkeypatch.setattr(SparseMoe, "_measure_paths", lambda self: ((False, False, False), moe_mod.FUSED_ALL))
    cpu_linear.pack_linears(moe, "auto")
    (key, answer), = moe_mod._PANELS.items()
    assert key == (5, 48, 32, 2, torch.get_num_threads()) and isinstance(answer, bool)
    assert calls.count(True) == calls.count(False) >= 2 * 3  # both layouts at each probe, interleaved
    assert moe.kernel_experts()[2] == answer
    calls.clear()
    again = _moe(5, hidden=32, inter=24)
    cpu_linear.pack_linears(again, "auto")
    assert again.kernel_experts()[2] == answer and not any(c is not None for c in calls)  # not timed again
