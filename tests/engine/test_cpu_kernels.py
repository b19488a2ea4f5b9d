"""The compiled few-row CPU kernels (engine.cpu_kernels): equal to F.linear and to the MoE's grouped path to float
rounding for every row count, shape remainder and routing; checked inputs; the build cache; the fallback when no
library can be built; and the layers that choose them (engine.cpu_linear, engine.moe)."""

from __future__ import annotations

import logging
import platform

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_kernels, cpu_linear
from engine.moe import SparseMoe
from tests.engine.test_cpu_linear import _moe

LIB = cpu_kernels.library()
needs_lib = pytest.mark.skipif(LIB is None, reason="no C compiler here: the few-row kernels are not built")


@needs_lib
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n,k", [(64, 512), (37, 100), (4, 16), (3, 7), (130, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g)
    got = cpu_kernels.linear(LIB, x, w, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    tol = 2e-6 * k ** 0.5 * 10  # sums of k unit-scale products, added in another order than the GEMM's
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=tol, atol=tol)
    x3 = torch.randn(2, 1, k, generator=g).transpose(0, 1)  # leading dims kept; a non-contiguous input is copied
    torch.testing.assert_close(cpu_kernels.linear(LIB, x3, w, b), F.linear(x3, w, b), rtol=tol, atol=tol)


@needs_lib
def test_linear_refuses_a_mismatched_input():
    with pytest.raises(ValueError, match="features"):
        cpu_kernels.linear(LIB, torch.randn(1, 8), torch.randn(4, 9), None)


@pytest.fixture
def tile_rows():
    """The library's process-wide row count for the tiled linear, restored after the test."""
    import ctypes

    cell = ctypes.c_int64.in_dll(LIB, "duet_linear_tile_rows")
    saved = cell.value
    yield cell
    LIB.duet_set_linear_tile_rows(saved)


@needs_lib
@pytest.mark.parametrize("rows", [1, 8, 16, 17, 33])
@pytest.mark.parametrize("n,k", [(64, 512), (70, 37), (200, 16), (16, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_tiled_linear_equals_f_linear(rows, n, k, bias, tile_rows):
    """From the set row count the linear transposes its rows and runs the tiled GEMM (weights of 64+ rows; a row
    count, a weight row count or an input width that is not whole vectors); below it, and for narrower weights,
    gemv as before."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    tol = 2e-5 * k ** 0.5
    for threshold in (0, 8):
        LIB.duet_set_linear_tile_rows(threshold)
        assert tile_rows.value == threshold
        torch.testing.assert_close(cpu_kernels.linear(LIB, x, w, b), F.linear(x, w, b), rtol=tol, atol=tol)


@needs_lib
def test_the_tiled_linear_row_count_is_measured_once_and_set(tile_rows, monkeypatch):
    monkeypatch.setattr(cpu_linear, "_tile_rows", {})
    w = torch.randn(96, 64)
    got = cpu_linear.choose_tile_rows(w)
    assert got in (0, *cpu_linear.TILE_ROW_PROBES) and tile_rows.value == got
    LIB.duet_set_linear_tile_rows(5)
    assert cpu_linear.choose_tile_rows(w) == got and tile_rows.value == got  # remembered, set again
    assert cpu_linear.choose_tile_rows(w.to(torch.bfloat16)) == 0  # the compiled kernels take float32 only


def _moe_reference(x, gate_up, down, experts, weights):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in sorted(range(experts.shape[1]), key=lambda j: int(experts[t, j])):
            e = int(experts[t, j])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (down[e] @ (F.silu(gate) * up))
    return out


@needs_lib
@pytest.mark.parametrize("tokens,top_k,h,i", [(1, 4, 64, 32), (3, 2, 40, 24), (4, 8, 33, 17), (1, 1, 16, 16),
                                              (16, 2, 64, 32), (37, 4, 40, 24)])
def test_moe_equals_the_reference(tokens, top_k, h, i):
    g = torch.Generator().manual_seed(tokens + top_k + h)
    e = 12
    gate_up, down = torch.randn(e, 2 * i, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2
    x = torch.randn(tokens, h, generator=g)
    experts = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    got = cpu_kernels.moe_silu(LIB, x, gate_up, down, experts, weights)
    torch.testing.assert_close(got, _moe_reference(x, gate_up, down, experts, weights), rtol=1e-5, atol=1e-5)


@needs_lib
@pytest.mark.parametrize("tile_min", [1, 5, 16])
@pytest.mark.parametrize("tokens,top_k,h,i,e", [(40, 3, 64, 32, 3), (70, 2, 40, 24, 2), (200, 4, 48, 20, 8),
                                                (33, 1, 16, 13, 1), (50, 3, 100, 52, 5)])
def test_moe_tiled_path_equals_the_reference(tokens, top_k, h, i, e, tile_min):
    """Experts with at least ``tile_min`` rows take the tiled GEMM (rows gathered transposed, column counts that are
    not whole vectors, weight rows beyond whole tiles, hidden sizes that are not whole vectors)."""
    g = torch.Generator().manual_seed(tokens * 7 + h + tile_min)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2
    x = torch.randn(tokens, h, generator=g)
    experts = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    got = cpu_kernels.moe_silu(LIB, x, gate_up, down, experts, weights, tile_min=tile_min)
    torch.testing.assert_close(got, _moe_reference(x, gate_up, down, experts, weights), rtol=1e-5, atol=1e-5)


@needs_lib
@pytest.mark.parametrize("tile_min", [1, 16, 20])
def test_moe_tail_rows_past_whole_vectors_equal_the_reference(tile_min):
    """Experts whose rows spill a few past a whole vector (17-22, 33, 49: the tiled path takes the whole vectors and
    gemv the rest) and some further past it (23-31: a zero-padded vector), beside exact multiples and a few-row
    expert, in one call, with top-2 routing so a token's rows come from both paths."""
    counts = [17, 18, 19, 20, 21, 22, 23, 26, 31, 32, 33, 49, 5, 16]
    e, h, i = len(counts), 40, 24
    g = torch.Generator().manual_seed(tile_min)
    ids = torch.cat([torch.full((c,), j, dtype=torch.long) for j, c in enumerate(counts)])
    ids = ids[torch.randperm(len(ids), generator=g)]
    experts = ids.view(-1, 2)
    keep = experts[:, 0] != experts[:, 1]  # top-k pairs name distinct experts
    experts = experts[keep]
    gate_up, down = torch.randn(e, 2 * i, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2
    x = torch.randn(len(experts), h, generator=g)
    weights = torch.rand(len(experts), 2, generator=g)
    got = cpu_kernels.moe_silu(LIB, x, gate_up, down, experts, weights, tile_min=tile_min)
    torch.testing.assert_close(got, _moe_reference(x, gate_up, down, experts, weights), rtol=1e-5, atol=1e-5)


@needs_lib
@pytest.mark.parametrize("tile_min", [1, 10 ** 9])
def test_moe_silu_holds_over_the_whole_float_range(tile_min):
    """The tiled path's vector exp: silu of gate values from -200 to 200 (clamped beyond the float range of exp)
    equals torch's to float rounding, and NaN inputs stay NaN."""
    h, i = 16, 64
    gate_up = torch.zeros(1, 2 * i, h)
    gate_up[0, :i, 0] = torch.linspace(-200.0, 200.0, i)  # gate rows read x[:, 0]
    gate_up[0, i:, 1] = 1.0  # up rows read x[:, 1]
    down = torch.eye(h, i).unsqueeze(0)
    x = torch.zeros(20, h)
    x[:, 0] = torch.linspace(-1.0, 1.0, 20)
    x[:, 1] = 1.0
    x[3, 0] = float("nan")
    experts, weights = torch.zeros(20, 1, dtype=torch.long), torch.ones(20, 1)
    got = cpu_kernels.moe_silu(LIB, x, gate_up, down, experts, weights, tile_min=tile_min)
    want = _moe_reference(x, gate_up, down, experts, weights)
    assert torch.isnan(got[3]).sum() == torch.isnan(want[3]).sum() > 0
    keep = torch.arange(20) != 3
    torch.testing.assert_close(got[keep], want[keep], rtol=2e-6, atol=1e-30)


def avx2_library(tmp_path, monkeypatch):
    """The kernels built for x86-64-v3 (AVX2 + FMA, no AVX-512), in a cache of their own."""
    import ctypes
    import shutil

    monkeypatch.setenv("DUET_KERNEL_CACHE", str(tmp_path))
    cc = shutil.which("cc") or shutil.which("gcc")
    flags = tuple(f for f in cpu_kernels.FLAGS if not f.startswith("-march")) + ("-march=x86-64-v3", "-Wno-psabi")
    lib = ctypes.CDLL(str(cpu_kernels._build(cc, (*flags, *cpu_kernels.OPENMP))))
    cpu_kernels._declare(lib)
    return lib


@needs_lib
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86 instruction-set level")
def test_kernels_built_without_avx512_equal_the_reference(tmp_path, monkeypatch):
    """A host without AVX-512 (x86-64-v3: AVX2 + FMA) builds the same source: the few-row loop without its
    register hints, the tiled MoE GEMM with its narrower tiles; both equal the references (the build itself failed
    there before)."""
    lib = avx2_library(tmp_path, monkeypatch)
    g = torch.Generator().manual_seed(11)
    for tokens, top_k, h, i, e in ((50, 3, 100, 52, 5), (40, 2, 64, 32, 2)):
        gate_up, down = torch.randn(e, 2 * i, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2
        x = torch.randn(tokens, h, generator=g)
        experts = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k, generator=g)
        want = _moe_reference(x, gate_up, down, experts, weights)
        for tile_min in (1, 10 ** 9):
            got = cpu_kernels.moe_silu(lib, x, gate_up, down, experts, weights, tile_min=tile_min)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    w, xs = torch.randn(130, 33, generator=g), torch.randn(3, 33, generator=g)
    torch.testing.assert_close(cpu_kernels.linear(lib, xs, w, None), F.linear(xs, w), rtol=1e-4, atol=1e-4)


@needs_lib
def test_moe_refuses_ids_outside_the_experts_and_too_large_a_top_k():
    gate_up, down, x = torch.randn(4, 8, 6), torch.randn(4, 6, 4), torch.randn(1, 6)
    for bad in (4, -1):
        with pytest.raises(ValueError, match="expert ids"):
            cpu_kernels.moe_silu(LIB, x, gate_up, down, torch.tensor([[0, bad]]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="top-"):
        cpu_kernels.moe_silu(LIB, x, gate_up, down, torch.zeros(1, cpu_kernels.MAX_TOP_K + 1, dtype=torch.long),
                             torch.ones(1, cpu_kernels.MAX_TOP_K + 1))


def _fresh(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_lib", None)


@needs_lib
def test_the_build_is_cached_per_source_and_host(monkeypatch, tmp_path):
    monkeypatch.setenv("DUET_KERNEL_CACHE", str(tmp_path))
    _fresh(monkeypatch)
    assert cpu_kernels.library() is not None
    built = list(tmp_path.glob("duet_cpu_kernels_*.so"))
    assert len(built) == 1 and not [p for p in tmp_path.iterdir() if p not in built]  # no temporary left behind
    stamp = built[0].stat().st_mtime_ns
    _fresh(monkeypatch)
    calls = []
    real_run = cpu_kernels.subprocess.run
    monkeypatch.setattr(cpu_kernels.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or real_run(cmd, **kw))
    assert cpu_kernels.library() is not None
    assert built[0].stat().st_mtime_ns == stamp and all("--version" in c for c in calls)  # not compiled again


def test_no_library_when_off_or_unbuildable(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("DUET_KERNEL_CACHE", str(tmp_path))
    _fresh(monkeypatch)
    monkeypatch.setenv("DUET_CPU_KERNELS", "0")
    assert cpu_kernels.library() is None
    _fresh(monkeypatch)
    monkeypatch.delenv("DUET_CPU_KERNELS")
    bad = tmp_path / "badcc"
    bad.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo bad 1.0 && exit 0\necho 'no such flag' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CC", str(bad))
    with caplog.at_level(logging.WARNING, logger="engine.cpu_kernels"):
        assert cpu_kernels.library() is None
    assert "did not build" in caplog.text and "no such flag" in caplog.text
    assert not list(tmp_path.glob("*.so"))  # nothing half-written is left to load later
    # the layers then keep the library kernels: no few-row range is chosen
    assert cpu_linear.few_rows_upto(torch.randn(8, 16), None) == 0
    assert cpu_linear.LinearKernel(torch.randn(8, 16), None, (False,) * 3, few_rows=4).few_rows_upto == 0


@needs_lib
def test_a_linear_kernel_runs_the_few_row_kernel_up_to_its_measured_rows(monkeypatch):
    w, b = torch.randn(24, 40), torch.randn(24)
    kernel = cpu_linear.LinearKernel(w, b, (False, False, True), few_rows=2)
    seen = []
    real = cpu_kernels.linear
    monkeypatch.setattr(cpu_kernels, "linear", lambda lib, x, *a: seen.append(x.shape[0]) or real(lib, x, *a))
    for rows in (1, 2, 3, 300):
        x = torch.randn(rows, 40)
        torch.testing.assert_close(kernel(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert seen == [1, 2]
    assert kernel(torch.randn(1, 40, dtype=torch.bfloat16).float()).shape == (1, 24)
    upto = cpu_linear.few_rows_upto(w, b)
    assert upto in (0, *cpu_linear.FEW_ROW_PROBES)  # measured: which one depends on the host
    times = cpu_linear.few_row_timings(w, b)
    assert len(times) == len(cpu_linear.FEW_ROW_PROBES) and all(lib > 0 and few > 0 for lib, few in times)


@needs_lib
@pytest.mark.parametrize("upto", [1, 4, 16])
def test_moe_one_call_path_equals_the_grouped_path(monkeypatch, upto):
    from engine import moe as moe_mod

    moe = _moe()
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(4))
    want = [moe(x[:t]) for t in range(1, 7)]
    monkeypatch.setattr(moe_mod, "_PATHS", {})
    monkeypatch.setattr(SparseMoe, "_measure_paths", lambda self: ((False, False, False), upto))
    cpu_linear.pack_linears(moe, "auto")
    assert moe._fused is not None and moe._fused_upto == upto and moe.gate_up_proj.numel() > 0
    calls = []
    real = cpu_kernels.moe_silu
    monkeypatch.setattr(cpu_kernels, "moe_silu", lambda lib, xs, *a, **kw: calls.append(xs.shape[0]) or real(lib, xs, *a, **kw))
    for t in range(1, 7):
        torch.testing.assert_close(moe(x[:t]), want[t - 1], rtol=1e-5, atol=1e-5)
    assert calls == list(range(1, min(upto, 6) + 1))
    moe.release_experts()  # an expert-parallel group takes the experts: the one-call path must not read them
    assert moe._fused is None


@needs_lib
def test_moe_measures_the_one_call_path_on_its_own_shapes(monkeypatch):
    from engine import moe as moe_mod

    monkeypatch.setattr(moe_mod, "_PATHS", {})
    moe = _moe()
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(5))
    want = moe(x)
    moe.pack_linears(cpu_linear.make_kernel("auto"))
    (key, (packed_for, upto)), = moe_mod._PATHS.items()
    assert key[-1] is True and len(packed_for) == len(cpu_linear.ROW_PROBES)
    assert upto in (0, *moe_mod.FUSED_PROBES[:-1], moe_mod.FUSED_ALL)
    assert moe._fused_upto == upto and (moe._fused is not None) == (upto > 0)  # which one depends on the host
    torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)


@needs_lib
def test_results_do_not_depend_on_the_thread_count():
    """With OpenMP the kernels share work among the caller's threads; each output is computed by the same code in
    the same order whatever the split, so the results are the same bits."""
    g = torch.Generator().manual_seed(6)
    w, b, x = torch.randn(300, 256, generator=g), torch.randn(300, generator=g), torch.randn(3, 256, generator=g)
    gate_up, down = torch.randn(8, 64, 48, generator=g) * 0.2, torch.randn(8, 48, 32, generator=g) * 0.2
    xm = torch.randn(20, 48, generator=g)
    experts = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(20)])
    weights = torch.rand(20, 3, generator=g)
    before = torch.get_num_threads()
    got = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got.append((cpu_kernels.linear(LIB, x, w, b),
                        cpu_kernels.moe_silu(LIB, xm, gate_up, down, experts, weights),
                        cpu_kernels.moe_silu(LIB, xm, gate_up, down, experts, weights, tile_min=1)))
    finally:
        torch.set_num_threads(before)
    for lin, moe, tiled in got[1:]:
        assert torch.equal(lin, got[0][0]) and torch.equal(moe, got[0][1]) and torch.equal(tiled, got[0][2])
    torch.testing.assert_close(got[0][2], got[0][1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0][1], _moe_reference(xm, gate_up, down, experts, weights), rtol=1e-5, atol=1e-5)


@needs_lib
@pytest.mark.parametrize("shape,wshape", [((1, 512), (512,)), ((7, 33), (33,)), ((5, 12, 64), (12, 64)),
                                          ((3, 4, 2, 16), (16,)), ((300, 40), (40,))])
def test_rms_norm_equals_torch(shape, wshape):
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(*wshape, generator=g)
    want = F.rms_norm(x, (shape[-1],), eps=1e-6) * w
    torch.testing.assert_close(cpu_kernels.rms_norm(LIB, x, w, 1e-6), want, rtol=1e-5, atol=1e-5)
    from engine.layers import rms_norm  # the model's entry point takes the kernel for float32 CPU tensors
    torch.testing.assert_close(rms_norm(x, w, 1e-6), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="broadcast"):
        cpu_kernels.rms_norm(LIB, x, torch.randn(2, shape[-1]) if len(shape) < 3 else torch.randn(99, shape[-1]),
                             1e-6)
