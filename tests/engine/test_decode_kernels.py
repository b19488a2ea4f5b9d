"""The compiled decode-step kernels (engine.cpu_kernels): per-head norm + rotary, decode attention with its KV writes,
the MoE router, the residual add + norm, and a whole decoder layer in one call -- each equal to the torch ops it
replaces to float rounding -- and the engine running them: same greedy tokens and logits as the module path, with the
one-call layer actually taken on decode steps of a few sequences and not elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from duet_testing.checkpoints import TinySpec
from engine import LLM, SamplingParams, cpu_kernels
from engine import moe as moe_mod
from engine import text_model
from engine.layers import apply_rotary
from engine.moe import SparseMoe

LIB = cpu_kernels.library()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler here: the compiled kernels are not built")
TOL = dict(rtol=2e-5, atol=2e-5)
DECODE_LAYER = cpu_kernels.decode_layer  # the real ones, before any test wraps them
DECODE_PROBE = text_model._one_call_probe


def _rope(t: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.rand(t, 1, d // 2, generator=g) * 6.0
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos(), torch.cat([-emb[..., : d // 2].sin(), emb[..., d // 2:].sin()], dim=-1)


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), eps=eps) * w


@pytest.mark.parametrize("t,r,d", [(1, 10, 64), (3, 6, 16), (5, 3, 128), (2, 1, 8)])
@pytest.mark.parametrize("with_norm", [True, False])
def test_norm_rope_equals_norm_then_rotary(t, r, d, with_norm):
    g = torch.Generator().manual_seed(t * 100 + r + d)
    x = torch.randn(t, r, d, generator=g)
    w = torch.rand(r, d, generator=g) + 0.5 if with_norm else None
    cos, sin = _rope(t, d, g)
    want = apply_rotary(_norm(x, w) if with_norm else x, cos, sin)
    got = cpu_kernels.norm_rope(LIB, x.clone(), w, 1e-6, cos, sin)
    torch.testing.assert_close(got, want, **TOL)


def test_norm_rope_refuses_tables_of_another_shape():
    x = torch.randn(2, 3, 16)
    cos, sin = _rope(3, 16, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="norm_rope"):
        cpu_kernels.norm_rope(LIB, x, None, 1e-6, cos, sin)


def _mirror_case(b: int, h: int, kvh: int, d: int, cap: int, g: torch.Generator):
    slots_total = b + 3
    mk, mv = torch.randn(slots_total, kvh, cap, d, generator=g), torch.randn(slots_total, kvh, cap, d, generator=g)
    slots = torch.randperm(slots_total, generator=g)[:b]
    pos = torch.randint(0, cap, (b,), generator=g)
    pos[0] = cap - 1  # one row at the mirror's full capacity
    return mk, mv, slots, pos


def _attention_reference(q, k, v, mk, mv, slots, pos, scale):
    """Write k, v into copies of the mirror, then SDPA with a length mask, query heads grouped by KV head."""
    mk, mv = mk.clone(), mv.clone()
    mk[slots, :, pos], mv[slots, :, pos] = k, v
    b, h, d = q.shape
    kvh, cap = mk.shape[1], mk.shape[2]
    visible = torch.arange(cap).unsqueeze(0) <= pos.unsqueeze(1)
    mask = torch.zeros(b, 1, 1, cap).masked_fill_(~visible.view(b, 1, 1, cap), float("-inf"))
    o = F.scaled_dot_product_attention(q.view(b, kvh, h // kvh, d), mk[slots], mv[slots], attn_mask=mask, scale=scale)
    return o.reshape(b, h, d), mk, mv


@pytest.mark.parametrize("b,h,kvh,d,cap", [(1, 8, 2, 64, 40), (3, 4, 4, 16, 9), (4, 6, 1, 32, 300),
                                           (2, 4, 2, 24, 5), (16, 8, 2, 64, 700),
                                           (2, 8, 2, 128, 50)])  # the last runs threaded
def test_decode_attention_equals_sdpa_and_writes_the_mirror_and_pool(b, h, kvh, d, cap):
    g = torch.Generator().manual_seed(b * 7 + h + d + cap)
    mk, mv, slots, pos = _mirror_case(b, h, kvh, d, cap, g)
    qkv = torch.randn(b, h + 2 * kvh, d, generator=g)  # q, k, v as row slices of one projection, as the layer has them
    q, k, v = qkv[:, :h], qkv[:, h:h + kvh], qkv[:, h + kvh:]
    pool_k, pool_v = torch.zeros(20 + b, kvh, d), torch.zeros(20 + b, kvh, d)
    pool_slots = torch.randperm(20 + b, generator=g)[:b]
    want, want_mk, want_mv = _attention_reference(q, k, v, mk, mv, slots, pos, d ** -0.5)
    got = cpu_kernels.decode_attention(LIB, q, k, v, mk, mv, slots, pos, int(pos.max()) + 1, d ** -0.5,
                                       pool=(pool_k, pool_v, pool_slots))
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(mk, want_mk) and torch.equal(mv, want_mv)  # copies, bit for bit
    assert torch.equal(pool_k[pool_slots], k) and torch.equal(pool_v[pool_slots], v)
    untouched = torch.ones(20 + b, dtype=torch.bool)
    untouched[pool_slots] = False
    assert not pool_k[untouched].any() and not pool_v[untouched].any()


def test_decode_attention_refuses_a_layout_it_cannot_read():
    g = torch.Generator().manual_seed(1)
    mk, mv, slots, pos = _mirror_case(2, 4, 2, 16, 8, g)
    q = torch.randn(2, 16, 4, generator=g).transpose(1, 2)  # heads not contiguous within a token
    k = v = torch.randn(2, 2, 16, generator=g)
    with pytest.raises(ValueError, match="strides"):
        cpu_kernels.decode_attention(LIB, q, k, v, mk, mv, slots, pos, 8, 0.25)


@pytest.mark.parametrize("t,h,e,k,norm", [(1, 64, 16, 2, True), (3, 40, 60, 4, False), (4, 33, 8, 1, True),
                                          (16, 64, 128, 8, True)])
def test_moe_route_equals_softmax_top_k(t, h, e, k, norm):
    g = torch.Generator().manual_seed(t + h + e + k)
    x, gate = torch.randn(t, h, generator=g), torch.randn(e, h, generator=g) * 0.3
    counts = torch.zeros(e, dtype=torch.int64)
    counts[0] = 5
    probs = torch.softmax(F.linear(x, gate), dim=-1, dtype=torch.float32)
    want_w, want_ids = torch.topk(probs, k, dim=-1)
    if norm:
        want_w = want_w / want_w.sum(dim=-1, keepdim=True)
    w, ids = cpu_kernels.moe_route(LIB, x, gate, k, norm, counts)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, **TOL)
    want_counts = torch.bincount(want_ids.view(-1), minlength=e)
    want_counts[0] += 5
    assert torch.equal(counts, want_counts)


def test_moe_route_keeps_ids_in_range_on_nan():
    x = torch.full((2, 8), float("nan"))
    w, ids = cpu_kernels.moe_route(LIB, x, torch.randn(6, 8), 3, True, torch.zeros(6, dtype=torch.int64))
    assert ids.min() >= 0 and ids.max() < 6 and len(set(ids[0].tolist())) == 3


def test_add_rms_norm_equals_torch():
    g = torch.Generator().manual_seed(3)
    x, r, w = torch.randn(5, 100, generator=g), torch.randn(5, 100, generator=g), torch.rand(100, generator=g)
    s, y = cpu_kernels.add_rms_norm(LIB, x, r, w, 1e-5)
    torch.testing.assert_close(s, x + r, **TOL)
    torch.testing.assert_close(y, _norm(x + r, w, 1e-5), **TOL)


def _layer_reference(x, p, cos, sin, mk, mv, slots, pos, scale):
    """The layer as torch ops (the module path's math)."""
    h, kvh, d = p["heads"], p["kv_heads"], p["head_dim"]
    b = x.shape[0]
    qkv = F.linear(_norm(x, p["ln1"]), p["wqkv"], p["bqkv"]).view(b, h + 2 * kvh, d)
    qk = qkv[:, : h + kvh]
    if p["qk_norm"] is not None:
        qk = _norm(qk, p["qk_norm"])
    qk = apply_rotary(qk, cos, sin)
    att, mk, mv = _attention_reference(qk[:, :h], qk[:, h:], qkv[:, h + kvh:], mk, mv, slots, pos, scale)
    x2 = x + F.linear(att.reshape(b, h * d), p["wo"], p["bo"])
    h2 = _norm(x2, p["ln2"])
    if p["router"] is None:
        gu = F.linear(h2, p["gate_up"])
        i = gu.shape[-1] // 2
        return x2 + F.linear(F.silu(gu[:, :i]) * gu[:, i:], p["down"]), mk, mv
    probs = torch.softmax(F.linear(h2, p["router"]), dim=-1)
    w, ids = torch.topk(probs, p["top_k"], dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    y = torch.zeros_like(x2)
    for t in range(b):
        for j in range(p["top_k"]):
            e = ids[t, j]
            gu = p["gate_up"][e] @ h2[t]
            i = gu.shape[0] // 2
            y[t] += w[t, j] * (p["down"][e] @ (F.silu(gu[:i]) * gu[i:]))
    return x2 + y, mk, mv


@pytest.mark.parametrize("b,tile_rows", [(1, 0), (3, 0), (4, 0), (20, 0), (20, 8)])  # 8: the projections tiled
@pytest.mark.parametrize("moe,bias,qk_norm,panel", [(True, False, True, False), (False, True, False, False),
                                                    (True, True, False, False), (True, False, True, True)])
def test_decode_layer_equals_the_layer_in_torch_ops(b, tile_rows, moe, bias, qk_norm, panel, monkeypatch):
    import ctypes

    monkeypatch.setattr(ctypes.c_int64.in_dll(LIB, "duet_linear_tile_rows"), "value", tile_rows)
    g = torch.Generator().manual_seed(b * 10 + moe * 2 + bias)
    hid, h, kvh, d, inter, e = 48, 4, 2, 16, 24, 6
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    p = dict(heads=h, kv_heads=kvh, head_dim=d, ln1=torch.rand(hid, generator=g) + 0.5,
             ln2=torch.rand(hid, generator=g) + 0.5, wqkv=r((h + 2 * kvh) * d, hid),
             bqkv=r((h + 2 * kvh) * d) if bias else None, qk_norm=torch.rand(h + kvh, d, generator=g) + 0.5
             if qk_norm else None, wo=r(hid, h * d), bo=r(hid) if bias else None,
             router=r(e, hid) * 5 if moe else None, top_k=2,
             gate_up=r(e, 2 * inter, hid) if moe else r(2 * inter, hid), down=r(e, hid, inter) if moe else r(hid, inter))
    x = torch.randn(b, hid, generator=g)
    cos, sin = _rope(b, d, g)
    mk, mv, slots, pos = _mirror_case(b, h, kvh, d, 12, g)
    pool_k, pool_v = torch.zeros(30, kvh, d), torch.zeros(30, kvh, d)
    pool_slots = torch.randperm(30, generator=g)[:b]
    want, want_mk, want_mv = _layer_reference(x, p, cos, sin, mk, mv, slots, pos, d ** -0.5)
    counts = torch.zeros(max(e, 1), dtype=torch.int64)
    got = cpu_kernels.decode_layer(
        LIB, x, eps=1e-6, ln1=p["ln1"], ln2=p["ln2"], wqkv=p["wqkv"], bqkv=p["bqkv"], heads=h, kv_heads=kvh,
        head_dim=d, qk_norm=p["qk_norm"], scale=d ** -0.5, cos=cos, sin_signed=sin, mirror=(mk, mv), slots=slots,
        pos=pos, max_len=int(pos.max()) + 1, pool=(pool_k, pool_v, pool_slots), wo=p["wo"], bo=p["bo"],
        gate_up=cpu_kernels.panel_pack(p["gate_up"]) if panel else p["gate_up"],
        down=cpu_kernels.panel_pack(p["down"]) if panel else p["down"], router=p["router"], top_k=2, norm_topk=True,
        counts=counts if moe else None, panel=panel)  # panel: the experts as the one-call path keeps them
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mk, want_mk, **TOL)
    torch.testing.assert_close(mv, want_mv, **TOL)
    torch.testing.assert_close(pool_k[pool_slots], want_mk[slots, :, pos], **TOL)
    if moe:
        assert counts.sum() == 2 * b


SPECS = {
    "qwen3moe": TinySpec(),  # q/k norms, MoE in every layer
    "mixtral-top1-mha": TinySpec(text="mixtral", top_k=1, num_kv_heads=4),
    "llama-dense": TinySpec(text="llama", vision="clip"),
    "qwen3moe-mlp-only": TinySpec(num_layers=4, decoder_sparse_step=2, mlp_only_layers=(3,)),
}


def _force_one_call(monkeypatch, upto: int) -> None:
    """The load-time choices forced: the MoE's one-call path up to 64 tokens (the layer call needs it), the one-call
    layer measured faster up to ``upto`` sequences."""
    monkeypatch.setattr(moe_mod, "_PATHS", {})
    monkeypatch.setattr(SparseMoe, "_measure_paths", lambda self: ((False,) * 3, 64))
    monkeypatch.setattr(text_model, "_ONE_CALL", {})
    monkeypatch.setattr(text_model, "_one_call_probe", lambda layers, b: (1.0, 0.5) if b <= upto else (0.5, 1.0))


def _generate(path, prompts, monkeypatch, *, one_call: bool):
    _force_one_call(monkeypatch, 4 if one_call else 0)
    calls = []
    monkeypatch.setattr(cpu_kernels, "decode_layer",
                        lambda lib, x, **kw: calls.append(x.shape[0]) or DECODE_LAYER(lib, x, **kw))
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=4)
    params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True, return_logits=True)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    llm.engine.block_manager.check_no_leaks()
    return [o.outputs[0] for o in outs], calls


@pytest.mark.parametrize("name", list(SPECS))
def test_engine_one_call_layer_equals_the_module_path(name, tiny_ckpt, monkeypatch):
    path = tiny_ckpt(SPECS[name])
    g = torch.Generator().manual_seed(9)
    # three sequences (decode steps of 3 rows, then fewer as they finish one by one) and five (over the one-call
    # limit until the first finishes)
    for n in (3, 5):
        prompts = [torch.randint(0, 200, (4 + 3 * i,), generator=g).tolist() for i in range(n)]
        want, none = _generate(path, prompts, monkeypatch, one_call=False)
        got, calls = _generate(path, prompts, monkeypatch, one_call=True)
        assert none == [] and calls, "the one-call layer must run on decode steps, and only when enabled"
        assert max(calls) <= 4
        for a, b in zip(got, want, strict=True):
            assert a.token_ids == b.token_ids
            for la, lb in zip(a.logits, b.logits, strict=True):
                torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)


def test_packed_mode_keeps_the_module_path(tiny_ckpt, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_kernels, "decode_layer", lambda lib, x, **kw: calls.append(1) or DECODE_LAYER(lib, x, **kw))
    llm = LLM(tiny_ckpt(SPECS["llama-dense"]), dtype="float32", num_kv_blocks=64, block_size=4, cpu_linear="packed")
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert calls == []


def test_the_one_call_limit_is_measured_at_load(tiny_ckpt, monkeypatch):
    path = tiny_ckpt(SPECS["qwen3moe"])
    _force_one_call(monkeypatch, 8)  # faster up to 8 sequences, slower at 16
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=4)
    assert llm.engine.model.linear_kernels["layer_call_upto"] == 8
    assert {m.layer_call_upto for m in llm.engine.model.text.layers} == {8}
    # measured for real: a probe size, the routing counts untouched by the probes, and cached per shape
    monkeypatch.setattr(text_model, "_one_call_probe", DECODE_PROBE)
    monkeypatch.setattr(text_model, "_ONE_CALL", {})
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=4)
    upto = llm.engine.model.linear_kernels["layer_call_upto"]
    assert upto in (0, *text_model.ONE_CALL_PROBES)
    assert not llm.engine.model.text.moe_counts().any()
    assert len(text_model._ONE_CALL) == 1


def test_the_probe_times_both_paths_on_the_model_layers(tiny_ckpt, monkeypatch):
    _force_one_call(monkeypatch, 0)
    llm = LLM(tiny_ckpt(SPECS["qwen3moe"]), dtype="float32", num_kv_blocks=64, block_size=4)
    layers = list(llm.engine.model.text.layers)
    calls = []
    monkeypatch.setattr(cpu_kernels, "decode_layer", lambda lib, x, **kw: calls.append(1) or DECODE_LAYER(lib, x, **kw))
    modules, one = DECODE_PROBE(layers, 3)
    assert 0 < modules < 1 and 0 < one < 1
    assert len(calls) == 6 * len(layers)  # the one-call path ran in each of its rounds (the warm-up included)
