"""Tests of the tiny-checkpoint factory: every layout loads cleanly in transformers and means the same model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from duet_testing.checkpoints import (
    BENCH_SPEC,
    TinySpec,
    build_config,
    build_model,
    image_tokens_per_image,
    load_reference_model,
    make_tiny_checkpoint,
)

VISIONS = ("siglip", "clip")
TEXTS = ("qwen3_moe", "mixtral", "qwen3", "llama", "mistral")
# A layout read wrongly (a swapped or transposed expert, q/k mixed up) moves tiny-model logits by 1e-2 or more; float
# rounding across layouts and CPUs stays below 1e-5 (2.4e-6 seen on an AMD EPYC)
LAYOUT_ATOL = 1e-5
LAYOUTS = [("hf", False), ("hf", True), ("published", False), ("published", True), ("fused", False), ("fused", True)]


def _load(path: Path):
    from transformers import LlavaForConditionalGeneration

    model, info = LlavaForConditionalGeneration.from_pretrained(path, output_loading_info=True,
                                                                attn_implementation="eager")
    return model.eval(), info


def _assert_clean(info: dict) -> None:
    assert {k: v for k, v in info.items() if v} == {}, info


def _inputs(spec: TinySpec, seed: int = 1, text_len: int = 6) -> dict[str, torch.Tensor]:
    """A prompt ``[bos, image tokens..., text...]`` with one random image."""
    g = torch.Generator().manual_seed(seed)
    ids = spec.special_token_ids
    text = torch.randint(0, spec.vocab_size - 4, (text_len,), generator=g)
    image = torch.full((image_tokens_per_image(spec),), ids["<image>"])
    input_ids = torch.cat([torch.tensor([ids["<s>"]]), image, text])[None]
    pixel_values = torch.randn(1, 3, spec.image_size, spec.image_size, generator=g)
    return {"input_ids": input_ids, "pixel_values": pixel_values.to(getattr(torch, spec.dtype))}


def _logits(model, spec: TinySpec) -> torch.Tensor:
    with torch.no_grad():
        return model(**_inputs(spec)).logits


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("vision", VISIONS)
def test_every_combination_loads_cleanly_and_matches_memory(tmp_path_factory, vision, text):
    spec = TinySpec(vision=vision, text=text, with_tokenizer=False, with_processor=False)
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(f"{vision}_{text}"), spec)
    model, info = _load(path)
    _assert_clean(info)
    logits = _logits(model, spec)
    assert logits.shape == (1, _inputs(spec)["input_ids"].shape[1], spec.vocab_size)
    assert torch.isfinite(logits).all()
    # same weights, but a layout loaded from disk may hold them with other strides: GEMM rounding differs by CPU
    torch.testing.assert_close(logits, _logits(build_model(spec), spec), rtol=0, atol=LAYOUT_ATOL)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("text", ["qwen3_moe", "mixtral"])
def test_layouts_give_identical_logits(tmp_path_factory, text, tie):
    base = TinySpec(vision="clip" if text == "mixtral" else "siglip", text=text, tie_word_embeddings=tie,
                    with_tokenizer=False, with_processor=False)
    reference = None
    for layout, sharded in LAYOUTS:
        spec = dataclasses.replace(base, layout=layout, sharded=sharded)
        path = make_tiny_checkpoint(tmp_path_factory.mktemp(f"{text}_{layout}_{sharded}"), spec)
        model, info = _load(path)
        _assert_clean(info)
        logits = _logits(model, spec)
        reference = logits if reference is None else reference
        torch.testing.assert_close(logits, reference, rtol=0, atol=LAYOUT_ATOL, msg=f"{layout} sharded={sharded}")
        if tie:
            assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()


def test_sharded_index_covers_every_shard(tmp_path_factory):
    for layout in ("hf", "fused"):
        path = make_tiny_checkpoint(tmp_path_factory.mktemp(f"shards_{layout}"), layout=layout, sharded=True,
                                    with_tokenizer=False, with_processor=False)
        shards = sorted(p.name for p in path.glob("*.safetensors"))
        assert len(shards) >= 2 and not (path / "model.safetensors").exists()
        weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        assert sorted(set(weight_map.values())) == shards
        for shard in shards:
            with safe_open(path / shard, "pt") as f:
                assert sorted(f.keys()) == sorted(k for k, v in weight_map.items() if v == shard)


def test_key_layouts_as_documented(tmp_path_factory):
    spec = TinySpec(text="qwen3_moe", vision="clip", with_tokenizer=False, with_processor=False)
    E, H, I = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    hf = _tensors(make_tiny_checkpoint(tmp_path_factory.mktemp("hf"), spec))
    assert hf["language_model.model.layers.0.mlp.experts.3.gate_proj.weight"].shape == (I, H)
    assert hf["language_model.model.layers.0.mlp.experts.3.down_proj.weight"].shape == (H, I)
    assert {"language_model.lm_head.weight", "multi_modal_projector.linear_1.weight",
            "vision_tower.encoder.layers.0.mlp.fc1.weight", "vision_tower.embeddings.class_embedding"} <= set(hf)
    pub = _tensors(make_tiny_checkpoint(tmp_path_factory.mktemp("pub"), spec, layout="published"))
    assert {k for k in pub if k.startswith("vision_tower.")} == {
        "vision_tower.vision_model." + k[len("vision_tower."):] for k in hf if k.startswith("vision_tower.")}
    fused = _tensors(make_tiny_checkpoint(tmp_path_factory.mktemp("fused"), spec, layout="fused"))
    gate_up = fused["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (E, 2 * I, H)
    assert fused["model.language_model.layers.0.mlp.experts.down_proj"].shape == (E, H, I)
    # rows [0, I) are the gate, [I, 2I) the up projection of the same expert
    torch.testing.assert_close(gate_up[3, :I], hf["language_model.model.layers.0.mlp.experts.3.gate_proj.weight"])
    torch.testing.assert_close(gate_up[3, I:], hf["language_model.model.layers.0.mlp.experts.3.up_proj.weight"])
    assert all(k.startswith(("model.", "lm_head.")) for k in fused)

    mix = dataclasses.replace(spec, text="mixtral", tie_word_embeddings=True)
    hf_mix = _tensors(make_tiny_checkpoint(tmp_path_factory.mktemp("hf_mix"), mix))
    assert hf_mix["language_model.model.layers.1.block_sparse_moe.experts.7.w1.weight"].shape == (
        mix.intermediate_size, H)
    assert "language_model.lm_head.weight" not in hf_mix
    fused_mix = _tensors(make_tiny_checkpoint(tmp_path_factory.mktemp("fused_mix"), mix, layout="fused"))
    assert fused_mix["model.language_model.layers.1.mlp.experts.gate_up_proj"].shape == (
        E, 2 * mix.intermediate_size, H)
    assert "lm_head.weight" not in fused_mix


def test_config_is_the_same_in_every_layout(tmp_path_factory):
    spec = TinySpec(dtype="bfloat16", with_tokenizer=False, with_processor=False)
    paths = [make_tiny_checkpoint(tmp_path_factory.mktemp(layout), spec, layout=layout)
             for layout in ("hf", "published", "fused")]
    configs = [json.loads((path / "config.json").read_text()) for path in paths]
    assert configs[0] == configs[1] == configs[2]
    assert configs[0]["dtype"] == "bfloat16" and configs[0]["image_seq_length"] == 3
    assert configs[0]["text_config"]["num_local_experts"] == 8  # qwen3_moe's num_experts, serialized in 5.x


def test_same_spec_gives_identical_files_and_seed_changes_them(tmp_path_factory):
    spec = TinySpec(text="mixtral", vocab_size=600)
    a = make_tiny_checkpoint(tmp_path_factory.mktemp("a"), spec)
    b = make_tiny_checkpoint(tmp_path_factory.mktemp("b"), spec)
    c = make_tiny_checkpoint(tmp_path_factory.mktemp("c"), spec, seed=1)
    ta, tb, tc = _tensors(a), _tensors(b), _tensors(c)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not any(torch.equal(ta[k], tc[k]) for k in ta if "norm" not in k)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_caller_rng_is_untouched():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(TinySpec())
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"vocab_size": 1000}, {"image_token_index": 5, "eos_token_id": 7}],
    ids=["bytes-only", "bpe", "custom-ids"],
)
def test_tokenizer_loads_in_auto_tokenizer(tmp_path_factory, overrides):
    from transformers import AutoTokenizer

    spec = TinySpec(with_processor=False, **overrides)
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tok"), spec)
    tok = AutoTokenizer.from_pretrained(path)
    ids = spec.special_token_ids
    assert len(tok) == spec.vocab_size
    assert tok.convert_tokens_to_ids("<image>") == spec.image_token_id == ids["<image>"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (ids["<s>"], ids["</s>"], ids["<pad>"])
    text = "Describe <image> please: the café, 42 cats!\n"
    encoded = tok(text).input_ids
    assert encoded[0] == ids["<s>"] and encoded.count(ids["<image>"]) == 1
    assert max(encoded) < spec.vocab_size
    assert tok.decode(encoded, skip_special_tokens=False) == "<s>" + text
    config = json.loads((path / "config.json").read_text())
    generation = json.loads((path / "generation_config.json").read_text())
    assert config["image_token_index"] == spec.image_token_id
    assert config["text_config"]["eos_token_id"] == generation["eos_token_id"] == ids["</s>"]


@pytest.mark.parametrize("vision", VISIONS)
def test_processor_expands_image_tokens(tmp_path_factory, vision):
    from PIL import Image
    from transformers import AutoProcessor

    spec = TinySpec(vision=vision)
    processor = AutoProcessor.from_pretrained(make_tiny_checkpoint(tmp_path_factory.mktemp("proc"), spec))
    image = Image.new("RGB", (45, 33), (200, 10, 90))
    out = processor(images=image, text="a <image> b", return_tensors="pt")
    assert out["pixel_values"].shape == (1, 3, spec.image_size, spec.image_size)
    assert (out["input_ids"] == spec.image_token_id).sum().item() == image_tokens_per_image(spec)


@pytest.mark.parametrize(
    "overrides",
    [{"vision": v, "vision_feature_select_strategy": s} for v in VISIONS for s in ("default", "full")]
    + [{"vision": "clip", "vision_feature_layer": (-3, -1), "image_size": 42}],
    ids=["siglip-default", "siglip-full", "clip-default", "clip-full", "clip-multilayer-42px"],
)
def test_image_tokens_per_image_matches_reference(overrides):
    spec = TinySpec(**overrides)
    model = build_model(spec)
    pixel_values = torch.randn(2, 3, spec.image_size, spec.image_size)
    with torch.no_grad():
        features = model.get_image_features(pixel_values=pixel_values).pooler_output
    assert [f.shape for f in features] == [(image_tokens_per_image(spec), spec.hidden_size)] * 2
    assert model.config.image_seq_length == image_tokens_per_image(spec)
    with torch.no_grad():
        model(**_inputs(spec))  # the placeholder count agrees with the features


@pytest.mark.parametrize(("vision", "text"), [("siglip", "qwen3_moe"), ("clip", "mixtral"), ("siglip", "qwen3")])
def test_greedy_generation_is_not_on_near_ties(tmp_path_factory, vision, text):
    spec = TinySpec(vision=vision, text=text, with_tokenizer=False, with_processor=False)
    model = load_reference_model(make_tiny_checkpoint(tmp_path_factory.mktemp("gen"), spec))
    gaps = []
    for seed in range(4):
        out = model.generate(**_inputs(spec, seed=seed), max_new_tokens=8, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
        for scores in out.scores:
            top2 = scores[0].float().topk(2).values
            gaps.append((top2[0] - top2[1]).item())
    gaps_t = torch.tensor(gaps)
    assert (gaps_t > 1e-3).float().mean() >= 0.9, gaps
    assert gaps_t.median() > 0.2, gaps  # transformers' default init gives ~0.03


def test_load_reference_model_keeps_dtype_and_uses_eager(tmp_path_factory):
    spec = TinySpec(dtype="bfloat16", layout="fused", with_tokenizer=False, with_processor=False)
    model = load_reference_model(make_tiny_checkpoint(tmp_path_factory.mktemp("bf16"), spec))
    assert model.dtype == torch.bfloat16 and not model.training
    assert model.config.text_config._attn_implementation == "eager"
    assert model.config.vision_config._attn_implementation == "eager"
    assert torch.isfinite(_logits(model, spec).float()).all()


def test_bench_spec_parameter_count():
    with torch.device("meta"):
        from transformers import LlavaForConditionalGeneration

        model = LlavaForConditionalGeneration(build_config(BENCH_SPEC))
    count = sum(p.numel() for p in model.parameters())
    print(f"BENCH_SPEC parameters: {count:,}")
    assert 45e6 <= count <= 60e6
    assert image_tokens_per_image(BENCH_SPEC) == 255


def test_invalid_spec_and_non_empty_target_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="special ids"):
        TinySpec(image_token_index=254)  # collides with the default eos id
    with pytest.raises(ValueError, match="top_k"):
        TinySpec(top_k=9)
    (tmp_path / "x").write_text("")
    with pytest.raises(FileExistsError):
        make_tiny_checkpoint(tmp_path, with_tokenizer=False)
    assert not [p for p in tmp_path.parent.iterdir() if p.name.startswith(f".{tmp_path.name}.")]
