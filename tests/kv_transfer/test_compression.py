"""Modal KV compression: policies, per-method error bounds, pruning and dropping, headers, byte stats, checksums
(a transfer through a manager: test_compression_transfer.py; the int kernel against a per-group loop:
test_compression_int.py)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer import (
    ChecksumMismatch,
    CodecContext,
    CompressionPolicy,
    IdentityCodec,
    InvalidPolicy,
    KVLayout,
    Method,
    ModalCodec,
    ProtocolError,
    codec_for,
    compression,
    get_codec,
    needs_scores,
    resolve_policy,
)
from kv_transfer.codec import decode_layer, encode_layer
from kv_transfer.compression import AGGRESSIVE, DEFAULT, unpack_bits

DTYPES = ["float32", "bfloat16", "float16"]
OUT_EPS = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # half an ulp, relative


# -- building cases -----------------------------------------------------------------------------------------------
@dataclass
class Case:
    layout: KVLayout
    num_blocks: int
    k: torch.Tensor
    v: torch.Tensor
    ctx: CodecContext
    policy: CompressionPolicy


def make_case(policy: CompressionPolicy, *, tokens: int, kvh: int, d: int, dtype: str = "float32",
              block_size: int = 16, extra_blocks: int = 0, seed: int = 0, magnitude: float = 1.0,
              visual_share: float = 0.5, scores: bool = False) -> Case:
    """Random K/V (per-channel offsets, like real keys), a random visual mask, optional explicit scores."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = -(-tokens // block_size) + extra_blocks
    layout = KVLayout(num_layers=2, block_size=block_size, num_kv_heads=kvh, head_dim=d, dtype=dtype)
    shape = layout.block_shape(num_blocks)
    offsets = torch.randn(kvh, d, generator=g) * 2
    k = ((torch.randn(shape, generator=g) + offsets) * magnitude).to(layout.torch_dtype)
    v = (torch.randn(shape, generator=g) * magnitude).to(layout.torch_dtype)
    visual = torch.rand(tokens, generator=g) < visual_share
    ctx = CodecContext(tokens, visual)
    if scores:
        ctx.k_channel_score = torch.stack([torch.randperm(d, generator=g) for _ in range(kvh)]).float()
        ctx.v_channel_score = torch.stack([torch.randperm(d, generator=g) for _ in range(kvh)]).float()
        ctx.token_score = torch.randperm(tokens, generator=g).float()
    return Case(layout, num_blocks, k, v, ctx, policy)


def round_trip(case: Case) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    header, payload = encode_layer("r", 0, case.k, case.v, ModalCodec(case.policy), case.ctx)
    header = msgpack.unpackb(msgpack.packb(header, use_bin_type=True), raw=False)  # as it travels
    return (header, payload, *decode_layer(header, payload.clone(), case.layout))


@st.composite
def methods(draw: st.DrawFn, kinds: tuple[str, ...] = compression.METHODS) -> Method:
    kind = draw(st.sampled_from(kinds))
    ints = {"bits": draw(st.sampled_from([4, 8])), "group": draw(st.sampled_from([1, 7, 16, 32, 64, 128]))}
    keep = st.sampled_from([1.0, 1.0, 0.75, 0.5, 0.2])
    return Method(kind, **(ints if kind == "int" else {}), keep_k=draw(keep), keep_v=draw(keep))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    policy = CompressionPolicy("t", text=draw(methods()), visual=draw(methods()),
                               keep_visual_tokens=draw(st.sampled_from([1.0, 0.6, 0.25])))
    return make_case(policy, tokens=draw(st.integers(1, 70)), kvh=draw(st.integers(1, 4)),
                     d=draw(st.sampled_from([8, 16, 32, 64])), dtype=draw(st.sampled_from(DTYPES)),
                     block_size=draw(st.sampled_from([4, 16])), extra_blocks=draw(st.integers(0, 1)),
                     seed=draw(st.integers(0, 1 << 16)), magnitude=draw(st.sampled_from([1e-3, 1.0, 300.0])),
                     visual_share=draw(st.sampled_from([0.0, 0.5, 1.0])), scores=draw(st.booleans()))


# -- the reference: what each section must look like after a round trip -------------------------------------------
def keep_count(ratio: float, n: int) -> int:
    return max(1, math.ceil(ratio * n - 1e-9))


def expected_kept_visual(case: Case, k_tokens: torch.Tensor) -> list[int]:
    visual = case.ctx.visual.nonzero().flatten()
    ratio = case.policy.keep_visual_tokens
    if ratio >= 1 or visual.numel() == 0:
        return visual.tolist()
    score = case.ctx.token_score[visual] if case.ctx.token_score is not None else \
        k_tokens[visual].float().flatten(1).norm(dim=1)
    return sorted(visual[score.topk(keep_count(ratio, visual.numel())).indices].tolist())


def expected_channels(x: torch.Tensor, keep: float, score: torch.Tensor | None) -> torch.Tensor:
    """``[kvh, c]`` sorted kept channels of a section's ``x [n, kvh, d]``."""
    d = x.shape[2]
    s = score if score is not None else x.float().norm(dim=0)
    return s.topk(keep_count(keep, d), dim=1).indices.sort(dim=1).values


def int_bound(x: torch.Tensor, bits: int, group: int, keys: bool) -> torch.Tensor:
    """Per-element bound for KIVI codes: half the stored scale (range / levels, allowing for float16 storage
    rounding of scale and min) plus float32 arithmetic slack."""
    n, kvh, c = x.shape
    mat = x.reshape(n, -1) if keys else x.reshape(n, -1).t()
    bound = torch.empty_like(mat)
    for start in range(0, mat.shape[0], group):
        rows = mat[start:start + group]
        lo, hi = rows.amin(0), rows.amax(0)
        scale = ((hi - lo) + lo.abs() * 2 ** -9 + 2 ** -23) / ((1 << bits) - 1) * (1 + 2 ** -9) + 2 ** -23
        bound[start:start + group] = scale / 2 + 2 ** -20 * (lo.abs() + hi.abs())
    return (bound if keys else bound.t()).reshape(n, kvh, c)


def fp8_bound(x: torch.Tensor) -> torch.Tensor:
    amax = x.abs().amax(dim=(0, 2))
    scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))[:, None]
    return 2 ** -4 * x.abs() + scale * 2 ** -9 + 2 ** -20 * amax[:, None]


def check_section(method: Method, keys: bool, x: torch.Tensor, y: torch.Tensor, score: torch.Tensor | None) -> None:
    """``x``: a section's original K or V ``[n, kvh, d]``; ``y``: what was decoded at its positions."""
    keep = method.keep_k if keys else method.keep_v
    chans = expected_channels(x, keep, score)
    pruned = torch.ones_like(y, dtype=torch.bool).scatter_(2, chans[None].expand(x.shape[0], -1, -1), False)
    assert torch.all(y[pruned] == 0), "pruned channels must decode to exactly zero"
    xs = x.gather(2, chans[None].expand(x.shape[0], -1, -1))
    ys = y.gather(2, chans[None].expand(x.shape[0], -1, -1))
    if method.kind == "raw":
        assert torch.equal(xs, ys)
        return
    xf = xs.float()
    bound = fp8_bound(xf) if method.kind == "fp8" else int_bound(xf, method.bits, method.group, keys)
    bound = bound + OUT_EPS[y.dtype] * (xf.abs() + bound)
    err = (ys.float() - xf).abs()
    assert torch.all(err <= bound), f"{method} max excess {(err - bound).max().item():.3g}"


@settings(max_examples=80, deadline=None)
@given(cases())
def test_round_trip_follows_each_methods_bound(case: Case) -> None:
    check_decoded(case, *round_trip(case))


def check_decoded(case: Case, header: dict, payload: torch.Tensor, k2: torch.Tensor, v2: torch.Tensor,
                  dropped: torch.Tensor | None) -> None:
    """Padding, dropped tokens and pruned channels are zero, the rest within its method's bound; stats add up."""
    n, kvh, d = case.ctx.num_tokens, case.layout.num_kv_heads, case.layout.head_dim
    assert k2.shape == case.k.shape and k2.dtype == case.k.dtype and v2.dtype == case.v.dtype
    kf, vf = case.k.reshape(-1, kvh, d), case.v.reshape(-1, kvh, d)
    kf2, vf2 = k2.reshape(-1, kvh, d), v2.reshape(-1, kvh, d)
    assert torch.all(kf2[n:] == 0) and torch.all(vf2[n:] == 0), "padding must decode to zero"
    visual = case.ctx.visual
    kept = expected_kept_visual(case, kf[:n])
    lost = sorted(set(visual.nonzero().flatten().tolist()) - set(kept))
    assert (dropped is None and not lost) or dropped.tolist() == lost
    if lost:
        assert torch.all(kf2[lost] == 0) and torch.all(vf2[lost] == 0)
    text = (~visual).nonzero().flatten().tolist()
    for method, pos in ((case.policy.text, text), (case.policy.visual, kept)):
        if pos:
            check_section(method, True, kf[pos], kf2[pos], case.ctx.k_channel_score)
            check_section(method, False, vf[pos], vf2[pos], case.ctx.v_channel_score)
    stats = header["codec_meta"]["stats"]
    assert stats["text"] == {"tokens": len(text), "dropped": 0, "bytes": stats["text"]["bytes"]}
    assert stats["visual"]["tokens"] == len(kept) and stats["visual"]["dropped"] == len(lost)
    assert stats["text"]["bytes"] + stats["visual"]["bytes"] == payload.numel() + mask_bytes(header)


def mask_bytes(header: dict) -> int:
    total = 0
    for sec in header["codec_meta"]["sections"].values():
        total += len(sec["tokens"]) + sum(len(b) for w in ("k", "v") for b in sec[w]["channels"] or ())
    return total


def test_headers_carry_the_policy_and_declare_what_is_needed() -> None:
    policy = CompressionPolicy("mix", text=Method("fp8", keep_v=0.5),
                               visual=Method("int", bits=4, group=7, keep_k=0.75), keep_visual_tokens=0.5)
    header, _, *_ = round_trip(make_case(policy, tokens=30, kvh=2, d=16, seed=3, visual_share=0.6))
    meta = header["codec_meta"]
    assert meta["v"] == 1 and CompressionPolicy.from_dict(meta["policy"]) == policy
    assert meta["num_tokens"] == 30 and meta["checksum_chunk"] == compression.CHECKSUM_CHUNK
    visual = meta["sections"]["visual"]
    assert visual["k"]["kind"] == "int" and visual["k"]["bits"] == 4 and visual["k"]["group"] == 7
    assert visual["k"]["scale_dtype"] == "float16" and len(visual["k"]["channels"]) == 2
    assert visual["v"]["channels"] is None and meta["sections"]["text"]["k"]["scale_dtype"] == "float32"
    assert unpack_bits(visual["tokens"], 30, "t").sum() == meta["stats"]["visual"]["tokens"]


def test_scales_fall_back_to_float32_when_float16_cannot_hold_them() -> None:
    policy = CompressionPolicy("p", text=Method("raw"), visual=Method("int", bits=8, group=16))
    case = make_case(policy, tokens=20, kvh=2, d=8, seed=4, magnitude=1e6, visual_share=1.0)
    header, _, k2, v2, _ = round_trip(case)
    assert header["codec_meta"]["sections"]["visual"]["k"]["scale_dtype"] == "float32"
    check_section(policy.visual, True, case.k.reshape(-1, 2, 8)[:20], k2.reshape(-1, 2, 8)[:20], None)
    check_section(policy.visual, False, case.v.reshape(-1, 2, 8)[:20], v2.reshape(-1, 2, 8)[:20], None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_payloads_stay_within_the_bound_a_receiver_buffers(dtype: str) -> None:
    """The worst case of every method (int8 in groups of one with float32 scales, fp8, raw) stays within
    ``max_layer_payload``, the most a receiver keeps for one header before the frame is verified."""
    worst = [CompressionPolicy("g1", text=Method("int", bits=8, group=1), visual=Method("int", bits=8, group=1)),
             CompressionPolicy("fp8", text=Method("fp8"), visual=Method("fp8")), DEFAULT, AGGRESSIVE]
    for policy in worst:
        case = make_case(policy, tokens=20, kvh=2, d=8, block_size=4, dtype=dtype, magnitude=1e6 if dtype ==
                         "float32" else 1.0, visual_share=0.5)
        _, payload, *_ = round_trip(case)
        assert payload.numel() <= compression.max_layer_payload(case.layout, case.num_blocks), policy.name
    layout = KVLayout(num_layers=1, block_size=4, num_kv_heads=2, head_dim=8, dtype="float16")
    identity = IdentityCodec().encode(*[torch.zeros(layout.block_shape(3), dtype=torch.float16)] * 2)[0]
    assert identity.numel() == layout.layer_nbytes(3) <= compression.max_layer_payload(layout, 3)
    assert compression.max_layer_payload(layout, 1) == 1184  # the docstring's worked example


@pytest.mark.parametrize("policy", [DEFAULT, AGGRESSIVE], ids=["default", "aggressive"])
def test_zero_and_constant_inputs_need_no_scale(policy: CompressionPolicy) -> None:
    case = make_case(policy, tokens=12, kvh=2, d=8, block_size=4, visual_share=0.5)
    case.k.zero_()
    case.v.fill_(3.0)
    header, payload, k2, v2, dropped = round_trip(case)
    check_decoded(case, header, payload, k2, v2, dropped)
    assert torch.all(k2 == 0) and torch.all(v2.reshape(-1, 2, 8)[:12] == 3.0)


def test_without_a_context_every_position_is_a_text_token() -> None:
    case = make_case(AGGRESSIVE, tokens=8, kvh=1, d=8, block_size=4)
    header, payload = encode_layer("r", 0, case.k, case.v, ModalCodec(AGGRESSIVE))
    assert header["codec_meta"]["stats"]["text"]["tokens"] == 8
    assert decode_layer(header, payload, case.layout)[2] is None


# -- policies -----------------------------------------------------------------------------------------------------
def test_named_policies_and_specs_resolve() -> None:
    assert resolve_policy(None) is None and resolve_policy("none") is None
    assert resolve_policy("default") is DEFAULT and resolve_policy(AGGRESSIVE) is AGGRESSIVE
    assert DEFAULT.text == Method("raw") and DEFAULT.visual == Method("int", bits=8, group=64)
    assert AGGRESSIVE.text == Method("fp8") and AGGRESSIVE.visual == Method("int", bits=4, group=64, keep_k=0.75)
    spec = '{"visual": {"kind": "int", "bits": 4, "group": 16, "keep_v": 0.5}, "keep_visual_tokens": 0.5}'
    policy = resolve_policy(spec)
    assert policy == CompressionPolicy("custom", Method(), Method("int", bits=4, group=16, keep_v=0.5), 0.5)
    assert resolve_policy(policy.to_dict()) == policy
    assert CompressionPolicy.from_dict(msgpack.unpackb(msgpack.packb(policy.to_dict()))) == policy
    assert policy.to_dict()["version"] == 1
    assert isinstance(codec_for(None), IdentityCodec) and codec_for(DEFAULT).policy is DEFAULT
    assert not needs_scores(DEFAULT) and needs_scores(AGGRESSIVE) and needs_scores(policy)
    assert isinstance(get_codec("modal"), ModalCodec)


def test_policy_none_is_byte_identical_to_the_identity_codec() -> None:
    case = make_case(DEFAULT, tokens=10, kvh=2, d=8, block_size=4, dtype="bfloat16")
    header, payload = encode_layer("r", 0, case.k, case.v, codec_for(resolve_policy("none")), case.ctx)
    ref_header, ref_payload = encode_layer("r", 0, case.k, case.v, IdentityCodec())
    assert header == ref_header and torch.equal(payload, ref_payload)


@pytest.mark.parametrize(("spec", "field"), [
    ('{"visual": {"kind": "int3"}}', "policy.visual.kind"),
    ({"visual": {"kind": "int", "bits": 3, "group": 8}}, "policy.visual.bits"),
    ({"visual": {"kind": "int", "bits": 8, "group": 0}}, "policy.visual.group"),
    ({"visual": {"kind": "int", "bits": 8}}, "policy.visual.group"),
    ({"text": {"kind": "fp8", "bits": 8}}, "policy.text.bits"),
    ({"text": {"keep_k": 0}}, "policy.text.keep_k"),
    ({"text": {"keep_v": 1.5}}, "policy.text.keep_v"),
    ({"text": {"keeep_v": 1.0}}, "keeep_v"),
    ({"keep_visual_tokens": 0.0}, "policy.keep_visual_tokens"),
    ({"colour": "red"}, "colour"),
    ({"version": 2}, "policy.version"),
    ("turbo", "default"),
    ("{not json", "JSON"),
    (42, "int"),
], ids=lambda x: x if isinstance(x, str) and len(x) < 30 else None)
def test_bad_policy_specs_name_the_field(spec: object, field: str) -> None:
    with pytest.raises(InvalidPolicy, match=field) as info:
        resolve_policy(spec)
    assert "\n" not in str(info.value) and isinstance(info.value, ValueError)


# -- sizes ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("policy", "tokens", "kvh", "d", "vs_f32", "vs_bf16"), [
    (DEFAULT, 36, 2, 32, 3.5, 1.8),
    (DEFAULT, 576, 8, 128, 3.5, 1.8),
    (AGGRESSIVE, 36, 2, 32, 7.0, 3.5),
    (AGGRESSIVE, 576, 8, 128, 7.0, 3.5),
], ids=["default-36", "default-576", "aggressive-36", "aggressive-576"])
def test_visual_tokens_shrink_by_the_promised_ratio(policy: CompressionPolicy, tokens: int, kvh: int, d: int,
                                                    vs_f32: float, vs_bf16: float) -> None:
    case = make_case(policy, tokens=tokens, kvh=kvh, d=d, visual_share=1.0)
    header, *_ = round_trip(case)
    sent = header["codec_meta"]["stats"]["visual"]["bytes"]  # codes + scales + masks
    f32 = 2 * tokens * kvh * d * 4
    assert f32 / sent >= vs_f32 and (f32 // 2) / sent >= vs_bf16


# -- corruption -----------------------------------------------------------------------------------------------------
MIXED = CompressionPolicy("mix", text=Method("fp8", keep_v=0.5), visual=Method("int", bits=4, group=7, keep_k=0.75),
                          keep_visual_tokens=0.5)


def mixed_frame() -> tuple[Case, dict, torch.Tensor]:
    case = make_case(MIXED, tokens=30, kvh=2, d=16, seed=5, visual_share=0.6)
    header, payload, *_ = round_trip(case)
    return case, header, payload


def test_corrupted_payload_fails_the_checksum_of_its_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compression, "CHECKSUM_CHUNK", 64)
    case, header, payload = mixed_frame()
    assert header["codec_meta"]["checksum_chunk"] == 64 and len(header["checksums"]) == -(-payload.numel() // 64)
    payload[2 * 64 + 3] ^= 0x10
    with pytest.raises(ChecksumMismatch, match=r"chunk\(s\) \[2\]"):
        decode_layer(header, payload, case.layout)


def _sec(name: str, which: str | None = None):
    def get(meta: dict) -> dict:
        return meta["sections"][name] if which is None else meta["sections"][name][which]
    return get


HEADER_FAULTS = {
    "version": lambda m: m.update(v=2),
    "no-version": lambda m: m.pop("v"),
    "policy-version": lambda m: m["policy"].update(version=7),
    "policy-kind": lambda m: m["policy"]["visual"].update(kind="zstd"),
    "num-tokens-over-capacity": lambda m: m.update(num_tokens=10_000),
    "num-tokens-negative": lambda m: m.update(num_tokens=-1),
    "num-tokens-str": lambda m: m.update(num_tokens="30"),
    "num-tokens-mismatch": lambda m: m.update(num_tokens=20),
    "sections-missing": lambda m: m["sections"].pop("visual"),
    "sections-extra": lambda m: m["sections"].update(audio={}),
    "tokens-wrong-length": lambda m: _sec("text")(m).update(tokens=b"\x00"),
    "tokens-stray-bits": lambda m: _sec("text")(m).update(tokens=_sec("text")(m)["tokens"][:-1] + b"\xff"),
    "tokens-overlap": lambda m: _sec("text")(m).update(tokens=_sec("visual")(m)["tokens"]),
    "tokens-not-bytes": lambda m: _sec("visual")(m).update(tokens=[1, 2, 3, 4]),
    "kind": lambda m: _sec("visual", "k")(m).update(kind="int2"),
    "bits": lambda m: _sec("visual", "k")(m).update(bits=3),
    "group": lambda m: _sec("visual", "v")(m).update(group=0),
    "group-changes-length": lambda m: _sec("visual", "v")(m).update(group=8),
    "scale-dtype": lambda m: _sec("visual", "k")(m).update(scale_dtype="float64"),
    "fp8-scale-dtype": lambda m: _sec("text", "k")(m).update(scale_dtype="float16"),
    "offset-negative": lambda m: _sec("text", "k")(m).update(offset=-1),
    "offset-past-end": lambda m: _sec("visual", "v")(m).update(offset=1 << 40),
    "length": lambda m: _sec("text", "v")(m).update(length=_sec("text", "v")(m)["length"] + 1),
    "length-missing": lambda m: _sec("text", "v")(m).pop("length"),
    "channels-count": lambda m: _sec("visual", "k")(m).update(channels=_sec("visual", "k")(m)["channels"][:1]),
    "channels-length": lambda m: _sec("visual", "k")(m).update(channels=[b"\xff", b"\xff"]),
    "channels-uneven": lambda m: _sec("visual", "k")(m).update(channels=[b"\xff\x0f", b"\xff\x00"]),
    "channels-none-kept": lambda m: _sec("visual", "k")(m).update(channels=[b"\x00\x00", b"\x00\x00"]),
    "channels-not-list": lambda m: _sec("text", "v")(m).update(channels=b"\xff"),
    "entry-not-map": lambda m: _sec("text")(m).update(k=[1]),
    "checksum-chunk-zero": lambda m: m.update(checksum_chunk=0),
    "checksum-chunk-str": lambda m: m.update(checksum_chunk="64"),
}


@pytest.mark.parametrize("fault", list(HEADER_FAULTS), ids=list(HEADER_FAULTS))
def test_every_malformed_header_field_is_a_protocol_error(fault: str) -> None:
    case, header, payload = mixed_frame()
    bad = copy.deepcopy(header)
    HEADER_FAULTS[fault](bad["codec_meta"])
    with pytest.raises(ProtocolError):
        decode_layer(bad, payload.clone(), case.layout)
    decode_layer(header, payload, case.layout)  # the untouched frame still decodes
