"""The compiled prefill attention (engine/cpu_attention.c, engine.cpu_kernels.prefill_attention): equal to SDPA to
float rounding over shapes, layouts, causal chunks after a cached prefix and full attention; its refusals; and the
engine running it (greedy tokens and logits equal to transformers, chunked and prefix-cached prompts included),
taken from the measured prompt-chunk length and not in the library-only modes."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from duet_testing.checkpoints import TinySpec, load_reference_model
from engine import LLM, SamplingParams, cpu_kernels
from engine import attention as attention_mod
from tests.engine.test_cpu_kernels import avx2_library

LIB = cpu_kernels.library()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler here: the compiled kernels are not built")
PREFILL = cpu_kernels.prefill_attention  # the real one, before any test wraps it


def _sdpa(q, k, v, scale, causal):
    """q [T, H, D] over k, v [C, KVH, D]; causal: query i at position C - T + i."""
    t, c = q.shape[0], k.shape[0]
    mask = torch.arange(c).unsqueeze(0) <= torch.arange(c - t, c).unsqueeze(1) if causal else None
    o = F.scaled_dot_product_attention(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), attn_mask=mask,
                                       scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


@pytest.mark.parametrize("t,c,h,kvh,d", [(1, 1, 4, 2, 16), (3, 3, 8, 4, 64), (70, 70, 8, 4, 64), (65, 65, 2, 1, 32),
                                         (33, 100, 8, 2, 128), (17, 17, 4, 4, 16), (64, 200, 6, 3, 48),
                                         (130, 257, 12, 4, 80), (5, 129, 16, 1, 64),
                                         # head_dims that are not whole vectors (Qwen3-VL's vision tower: 72)
                                         (70, 70, 8, 4, 72), (33, 100, 4, 2, 40), (17, 17, 2, 2, 8), (9, 20, 3, 1, 24)])
@pytest.mark.parametrize("causal", [True, False])
def test_equals_sdpa(t, c, h, kvh, d, causal):
    g = torch.Generator().manual_seed(t * 1000 + c)
    q, k, v = torch.randn(t, h, d, generator=g), torch.randn(c, kvh, d, generator=g), torch.randn(c, kvh, d,
                                                                                                   generator=g)
    got = cpu_kernels.prefill_attention(LIB, q, k, v, d ** -0.5, causal=causal)
    torch.testing.assert_close(got, _sdpa(q, k, v, d ** -0.5, causal), rtol=1e-5, atol=1e-5)


def test_reads_row_slices_and_writes_into_a_slice():
    """The layouts the model hands it: q and k as column slices of one projection's rows, out a row range of a wider
    output; nothing outside the range is written."""
    g = torch.Generator().manual_seed(3)
    t, h, kvh, d = 40, 8, 2, 64
    qk = torch.randn(t, h + kvh, d, generator=g)
    v = torch.randn(t, kvh, d, generator=g)
    out = torch.full((t + 10, h, d), 7.0)
    got = cpu_kernels.prefill_attention(LIB, qk[:, :h], qk[:, h:], v, 0.1, out=out[5:5 + t])
    assert got.data_ptr() == out[5].data_ptr()
    torch.testing.assert_close(out[5:5 + t], _sdpa(qk[:, :h], qk[:, h:], v, 0.1, True), rtol=1e-5, atol=1e-5)
    assert (out[:5] == 7).all() and (out[5 + t:] == 7).all()


def test_large_scores_stay_finite():
    """Scores in the hundreds (the running max is subtracted before exp): no overflow, no NaN."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(90, 4, 32, generator=g) * 30 for _ in range(3))
    got = cpu_kernels.prefill_attention(LIB, q, k[:, :2], v[:, :2], 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _sdpa(q, k[:, :2], v[:, :2], 1.0, True), rtol=1e-4, atol=1e-4)


def test_refuses_what_it_cannot_read():
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    for args in ((torch.randn(4, 4, 272), torch.randn(4, 2, 272), torch.randn(4, 2, 272)),  # head_dim over 256
                 (torch.randn(4, 3, 16), k, k),  # 3 query heads over 2 KV heads
                 (q.double(), k.double(), k.double()),
                 (q, torch.randn(3, 2, 16), torch.randn(3, 2, 16)),  # causal with fewer keys than queries
                 (q.transpose(0, 1).contiguous().transpose(0, 1), k, k)):  # a token's heads not contiguous
        assert not cpu_kernels.prefill_attention_fits(*args) or args[1].shape[0] < args[0].shape[0]
        with pytest.raises(ValueError, match="prefill_attention"):
            cpu_kernels.prefill_attention(LIB, *args, 0.25)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86 instruction-set level")
def test_built_without_avx512_equals_sdpa(tmp_path, monkeypatch):
    lib = avx2_library(tmp_path, monkeypatch)
    g = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(50, 8, 48, generator=g), torch.randn(80, 2, 48, generator=g), torch.randn(80, 2, 48,
                                                                                                    generator=g)
    torch.testing.assert_close(cpu_kernels.prefill_attention(lib, q, k, v, 0.2), _sdpa(q, k, v, 0.2, True),
                               rtol=1e-5, atol=1e-5)


def _spy(monkeypatch, start: int) -> list[int]:
    """Force the measured choice to ``start`` and record each call's query count."""
    calls: list[int] = []
    monkeypatch.setattr(attention_mod, "_PREFILL_FROM", {})
    monkeypatch.setattr(attention_mod, "choose_prefill_kernel", lambda *a: start)
    monkeypatch.setattr("engine.text_model.choose_prefill_kernel", lambda *a: start)
    monkeypatch.setattr(cpu_kernels, "prefill_attention",
                        lambda lib, q, *a, **kw: calls.append(q.shape[0]) or PREFILL(lib, q, *a, **kw))
    return calls


def _reference(path, ids, max_new):
    ref = load_reference_model(path)
    ref.generation_config.eos_token_id = None
    with torch.inference_mode():
        g = ref.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=max_new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return g.sequences[0, len(ids):].tolist(), [x[0].float() for x in g.logits]


@pytest.mark.parametrize("spec", [TinySpec(), TinySpec(text="mixtral", top_k=1, num_kv_heads=4),
                                  TinySpec(num_kv_heads=1, head_dim=32)], ids=["gqa", "mha", "mqa-d32"])
def test_engine_equals_transformers_through_the_kernel(spec, tiny_ckpt, monkeypatch):
    """Prompts of 5-40 tokens, prefilled whole and in chunks of 8 (so later chunks read their context from the pool),
    then a repeat of the longest (its cached blocks skipped): tokens and logits equal transformers'."""
    path = tiny_ckpt(spec)
    calls = _spy(monkeypatch, 1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, spec.vocab_size - 8, n).tolist() for n in (5, 23, 40)]
    prompts.append(list(prompts[-1]))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, return_logits=True)
    want = [_reference(path, ids, 4) for ids in prompts]
    for chunk in (4096, 8):
        calls.clear()
        llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=chunk)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts[:3]], params)
        outs += llm.generate([{"prompt_token_ids": prompts[3]}], params)
        assert outs[3].num_cached_tokens > 0
        for out, (tokens, logits) in zip(outs, want, strict=True):
            assert out.outputs[0].token_ids == tokens
            for a, b in zip(out.outputs[0].logits, logits, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert calls and (max(calls) <= 8 if chunk == 8 else max(calls) == 40)
        llm.engine.block_manager.check_no_leaks()


def test_chunks_shorter_than_the_measured_length_keep_sdpa(tiny_ckpt, monkeypatch):
    calls = _spy(monkeypatch, 16)
    llm = LLM(tiny_ckpt(TinySpec()), dtype="float32", num_kv_blocks=64, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(3, 18))}, {"prompt_token_ids": list(range(3, 23))}], params)
    assert calls and set(calls) == {20}  # the 20-token prompt, once per layer; the 15-token one through SDPA


@pytest.mark.parametrize("mode", ["packed", "native"])
def test_library_only_modes_never_take_it(tiny_ckpt, monkeypatch, mode):
    calls = _spy(monkeypatch, 1)
    llm = LLM(tiny_ckpt(TinySpec()), dtype="float32", num_kv_blocks=64, block_size=4, cpu_linear=mode)
    llm.generate([{"prompt_token_ids": list(range(3, 30))}], SamplingParams(temperature=0, max_tokens=2))
    assert calls == []


def test_the_choice_is_measured_once_per_shape(monkeypatch):
    monkeypatch.setattr(attention_mod, "_PREFILL_FROM", {})
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        first = attention_mod.choose_prefill_kernel(8, 4, 64)
        assert torch.get_num_threads() == 2  # timed on one thread, the caller's count given back
    finally:
        torch.set_num_threads(threads)
    assert first in (0, *attention_mod.PREFILL_PROBES)
    assert attention_mod.choose_prefill_kernel(8, 4, 64) == first and len(attention_mod._PREFILL_FROM) == 1
    assert attention_mod.choose_prefill_kernel(8, 4, 272) == 0  # head_dim the kernel does not take: never timed


def _kernel_towers(monkeypatch, **size):
    """transformers' Qwen3-VL-MoE vision tower (eager attention) and ours with every frame through the kernel."""
    from engine.models.qwen3_vl.vision import Attention as VisionAttention
    from tests.engine.test_qwen_vision import SPECS as TOWERS, SMALL, _randomize, QwenVisionConfig, QwenVisionTower

    cfg_cls, model_cls, extra = TOWERS["moe-p16"]
    ref_cfg = cfg_cls(**(SMALL | size), **extra)
    ref_cfg._attn_implementation = "eager"
    ref = model_cls(ref_cfg).eval()
    _randomize(ref, seed=99)
    ours = QwenVisionTower(QwenVisionConfig.from_dict(ref_cfg.to_dict())).eval()
    ours.load_state_dict(ref.state_dict())
    for m in ours.modules():
        if isinstance(m, VisionAttention):
            m.kernel_from = 1
    calls: list[int] = []
    monkeypatch.setattr(cpu_kernels, "prefill_attention",
                        lambda lib, q, *a, **kw: calls.append(q.shape[0]) or PREFILL(lib, q, *a, **kw))
    return ref, ours, calls


@pytest.mark.parametrize("size", [{}, {"hidden_size": 144, "num_heads": 2}], ids=["head_dim16", "head_dim72"])
def test_vision_tower_equals_transformers_through_the_kernel(monkeypatch, size):
    """Frames of several sizes in one call (a 2-frame video among them), whole and run by rows in pieces: features
    and DeepStack levels equal transformers' (head_dim 72 as in the released towers)."""
    from tests.engine.test_qwen_vision import _assert_matches, _run_both

    ref, ours, calls = _kernel_towers(monkeypatch, **size)
    grids = [(1, 12, 10), (2, 4, 4), (1, 2, 8)]
    want, got = _run_both(ref, ours, grids, seed=3)
    _assert_matches(got, want)
    assert sorted(set(calls)) == [16, 120]  # every frame's attention went through the kernel
    calls.clear()
    g = torch.Generator().manual_seed(3)
    px = torch.randn(sum(t * h * w for t, h, w in grids), ours.cfg.patch_dim, generator=g)
    with torch.no_grad():
        job = ours.start(px, torch.tensor(grids))
        while not ours.advance(job, rows=37):
            pass
        feats, deepstack = ours.finish(job)
    _assert_matches((feats, deepstack), want)
    assert calls and max(calls) <= 37
