"""oneDNN linear layers with packed weights (engine.cpu_linear): the same results as F.linear to float rounding for
every row count and dtype, experts packed without a second copy of their weights, and the modes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_linear
from engine.config import EngineConfig
from engine.layers import Linear
from engine.moe import SparseMoe
from engine.text_config import TextConfig

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no oneDNN linear ops")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_kernel_equals_f_linear(dtype, tol, bias):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 40, generator=g) * 0.1).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    kernel = cpu_linear.LinearKernel(w, b, (True,) * len(cpu_linear.ROW_PROBES))
    assert kernel.weight is None and torch.equal(kernel.dense(), w)  # packed everywhere: the plain copy is not kept
    for shape in [(1, 40), (7, 40), (300, 40), (2, 5, 40), (0, 40)]:
        x = torch.randn(*shape, generator=g).to(dtype)
        got, want = kernel(x), F.linear(x, w, b)
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_a_kernel_uses_each_row_range_as_measured():
    w = torch.randn(64, 32)
    kernel = cpu_linear.LinearKernel(w, None, (True, False, True))  # decode rows packed, mid-size batches not
    assert kernel.weight is w and kernel.packed is not None
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    class Spy:
        def __call__(self, *a):
            calls.append(a[0].shape[0])
            return real(*a)

    mkldnn = torch.ops.mkldnn
    try:
        torch.ops.mkldnn = type("M", (), {"_linear_pointwise": Spy()})()
        for rows in (1, 16, 300):
            torch.testing.assert_close(kernel(torch.ones(rows, 32)), F.linear(torch.ones(rows, 32), w))
    finally:
        torch.ops.mkldnn = mkldnn
    assert calls == [1, 320]  # 300 rows run padded (cpu_linear.padded_rows)
    assert cpu_linear.LinearKernel(w, None, (False,) * 3).packed is None


def test_measuring_gives_one_answer_per_probe_and_everywhere_is_all_or_nothing():
    w = torch.randn(128, 64)
    per_probe = cpu_linear.measure(w, None)
    assert len(per_probe) == len(cpu_linear.ROW_PROBES) and all(isinstance(v, bool) for v in per_probe)
    everywhere = cpu_linear.measure(w, None, everywhere=True)
    assert len(set(everywhere)) == 1
    times = cpu_linear.timings(w, None)
    assert cpu_linear.timings(w.clone(), None) is times and all(n > 0 and p > 0 for n, p in times)  # once per shape


def test_one_weights_probes_share_its_cold_copies(monkeypatch):
    """Timing a weight both ways and against the few-row kernel clones (and packs) its cold copies once."""
    made = []
    real = cpu_linear._cold_copies
    monkeypatch.setattr(cpu_linear, "_cold_copies", lambda w: made.append(w.shape) or real(w))
    monkeypatch.setattr(cpu_linear, "_timings", {})
    monkeypatch.setattr(cpu_linear, "_few_row_timings", {})
    monkeypatch.setattr(cpu_linear.tuning_cache, "remembered", lambda table, _n, key, fn, like: table.setdefault(key, fn()))
    kernel = cpu_linear.make_kernel("auto")(torch.randn(72, 56), None)
    assert made == [torch.Size([72, 56])]
    assert len(cpu_linear._timings) == 1 and len(cpu_linear._few_row_timings) == (cpu_linear.cpu_kernels.library()
                                                                                  is not None)
    x = torch.randn(3, 56)
    torch.testing.assert_close(kernel(x), x @ kernel.dense().T, rtol=1e-5, atol=1e-5)


def _moe(e: int = 6, hidden: int = 24, inter: int = 16) -> SparseMoe:
    cfg = TextConfig(model_type="qwen3_moe", vocab_size=32, hidden_size=hidden, intermediate_size=48, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=hidden // 2, num_experts=e, top_k=2,
                     moe_intermediate_size=inter,
                     rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, hidden_act="silu",
                     tie_word_embeddings=False, attention_bias=False, qk_norm=True, norm_topk_prob=True,
                     moe_layers=(True,), sliding_window=None)
    moe = SparseMoe(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in (moe.gate.weight, moe.gate_up_proj, moe.down_proj):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return moe.eval().requires_grad_(False)


def test_packed_experts_equal_the_grouped_path_and_keep_one_copy():
    moe = _moe()
    gu, down = moe.gate_up_proj.clone(), moe.down_proj.clone()
    x = torch.randn(9, 24, generator=torch.Generator().manual_seed(2))
    want = moe(x)
    kernels = cpu_linear.pack_linears(moe, "packed")
    # the router and each expert's two projections; the MoE runs no one-call path in "packed" mode
    assert kernels == {"layers": 1 + 2 * 6, "packed": 1 + 2 * 6, "few_rows": 0, "moe_one_call_upto": [0]}
    assert moe.gate_up_proj.numel() == 0 and moe.down_proj.numel() == 0  # the plain experts are dropped
    all_gu, all_down = moe.expert_weights()
    assert torch.equal(all_gu, gu) and torch.equal(all_down, down)
    torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moe(x[:1]), want[:1], rtol=1e-5, atol=1e-5)  # a decode row: most experts idle
    moe.release_experts()
    assert moe._packed is None and moe.gate_up_proj.numel() == 0


@pytest.mark.parametrize("measured", [(True, False, False), (False, False, False), (True, True, True)])
def test_auto_experts_take_the_path_measured_faster_for_each_step_size(monkeypatch, measured):
    """Auto mode times the grouped GEMM against the packed experts per step size; a mixed answer keeps both copies
    and each step runs the path measured faster for its token count, with the same results either way."""
    from engine import moe as moe_mod

    moe = _moe()
    x = torch.randn(40, 24, generator=torch.Generator().manual_seed(3))  # judged by the 16-token probe
    want_one, want_many = moe(x[:1]), moe(x)
    paths = []
    real = SparseMoe._experts

    def spy(self, *a, packed):
        paths.append(packed)
        return real(self, *a, packed=packed)

    monkeypatch.setattr(moe_mod, "_PATHS", {})
    monkeypatch.setattr(SparseMoe, "_measure_paths", lambda self: (measured, 0))
    cpu_linear.pack_linears(moe, "auto")
    monkeypatch.setattr(SparseMoe, "_experts", spy)
    torch.testing.assert_close(moe(x[:1]), want_one, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moe(x), want_many, rtol=1e-5, atol=1e-5)
    assert paths == [measured[0], measured[1]]
    assert (moe._packed is not None) == any(measured)  # no packed copy where it never runs
    assert (moe.gate_up_proj.numel() > 0) == (not all(measured))  # the plain experts only where a step needs them


def test_expert_paths_are_measured_once_per_shape(monkeypatch):
    from engine import moe as moe_mod

    a, b = _moe(), _moe()
    make = cpu_linear.make_kernel("auto")
    calls = []
    real = SparseMoe._experts
    monkeypatch.setattr(moe_mod, "_PATHS", {})
    monkeypatch.setattr(SparseMoe, "_experts",
                        lambda self, *args, packed: calls.append(packed) or real(self, *args, packed=packed))
    a.pack_linears(make)
    timed = len(calls)
    b.pack_linears(make)  # the same shapes: the first one's answer
    assert timed > 0 and len(calls) == timed and len(a._packed_for) == len(cpu_linear.ROW_PROBES)
    key = (6, 32, 24, 2, torch.float32, torch.get_num_threads(), a._fusable())
    assert (a._packed_for, a._fused_upto) == (b._packed_for, b._fused_upto) == moe_mod._PATHS[key]


def test_native_mode_and_bad_modes():
    layer = Linear(8, 4)
    assert cpu_linear.pack_linears(layer, "native") == {"layers": 0, "packed": 0, "few_rows": 0,
                                                                "moe_one_call_upto": []} \
        and layer.kernel is None
    with pytest.raises(ValueError, match="cpu_linear"):
        cpu_linear.pack_linears(layer, "fast")
    with pytest.raises(ValueError, match="cpu_linear"):
        EngineConfig(cpu_linear="fast")
    x = torch.randn(3, 8)
    want = layer(x)
    assert cpu_linear.pack_linears(layer, "packed") == {"layers": 1, "packed": 1, "few_rows": 0,
                                                        "moe_one_call_upto": []}
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_packed_calls_run_at_a_bounded_set_of_row_counts():
    """oneDNN builds a kernel per input shape: the rows a packed call runs at are padded to a bounded set, never
    fewer than asked, so a prefill's varying lengths do not build kernels without end."""
    shapes = {cpu_linear.padded_rows(r) for r in range(1, 4097)}
    assert len(shapes) == 16 + 16 + 28
    assert all(r <= cpu_linear.padded_rows(r) < r + 128 for r in range(1, 4097))
    assert [cpu_linear.padded_rows(r) for r in (1, 16, 17, 33, 512, 513)] == [1, 16, 32, 64, 512, 640]


def test_processes_take_turns_to_tune_and_a_turn_never_waits_past_its_deadline(tmp_path):
    """``tuning_turn``: one process measures at a time (an exclusive lock on one file per host); a second waits for
    the first to finish, and one that waits past its deadline measures anyway rather than hang."""
    import subprocess
    import sys
    import textwrap

    from engine.cpu_linear import tuning_turn

    lock = str(tmp_path / "tuning.lock")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from engine.cpu_linear import tuning_turn
        with tuning_turn({lock!r}) as held:
            print("held" if held else "not held", flush=True)
            time.sleep(1.0)
    """)], stdout=subprocess.PIPE, text=True, cwd=str(Path(__file__).resolve().parents[2]))
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with tuning_turn(lock, wait_s=0.2) as held:  # the holder keeps it for ~1 s: this one gives up waiting
            assert not held and time.monotonic() - t0 < 0.9
        with tuning_turn(lock, wait_s=30.0) as held:  # ... and this one waits for the holder to finish
            assert held
        assert holder.wait(timeout=30) == 0
    finally:
        holder.kill()
    with tuning_turn(str(tmp_path / "missing-dir" / "tuning.lock")) as held:  # cannot be opened: measure anyway
        assert not held
