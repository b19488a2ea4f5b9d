"""``engine.models.qwen3_vl.vision`` against transformers' Qwen3-VL vision towers (MoE and dense), random weights, float32."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen3VLMoeVisionConfig, Qwen3VLMoeVisionModel, Qwen3VLVisionConfig, Qwen3VLVisionModel

from engine.errors import CheckpointError, UnsupportedModelError
from engine.models.qwen3_vl.config import QwenVisionConfig
from engine.models.qwen3_vl.vision import IGNORED_KEYS, QwenVisionTower

ATOL = 1e-5
# Two towers: MoE with 16-px patches and an 8x8 position table; dense with 14-px patches, a 6x6 table and exact GELU.
SPECS = {
    "moe-p16": (Qwen3VLMoeVisionConfig, Qwen3VLMoeVisionModel, dict(patch_size=16, num_position_embeddings=64,
                                                                     hidden_act="gelu_pytorch_tanh")),
    "dense-p14": (Qwen3VLVisionConfig, Qwen3VLVisionModel, dict(patch_size=14, num_position_embeddings=36,
                                                               hidden_act="gelu")),
}
SMALL = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, temporal_patch_size=2, spatial_merge_size=2,
             in_channels=3, out_hidden_size=48, deepstack_visual_indexes=[0, 2])
RELEASED = {  # Qwen3-VL-30B-A3B's vision_config
    "deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
    "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_vl_moe",
    "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
    "spatial_merge_size": 2, "temporal_patch_size": 2,
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial values everywhere: weights ~ N(0, 1/fan_in), norm gains around 1, biases ~ N(0, 0.2²)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name == "pos_embed.weight":
                p.copy_(r)
            elif p.dim() > 1:
                p.copy_(r / p[0].numel() ** 0.5)
            elif name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * r)
            else:
                p.copy_(0.2 * r)


@pytest.fixture(scope="module", params=list(SPECS), ids=list(SPECS))
def towers(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, QwenVisionTower]:
    cfg_cls, model_cls, extra = SPECS[request.param]
    ref_cfg = cfg_cls(**SMALL, **extra)
    ref_cfg._attn_implementation = "eager"  # an independent attention path from ours (SDPA)
    ref = model_cls(ref_cfg).eval()
    _randomize(ref, seed=1234)
    ours = QwenVisionTower(QwenVisionConfig.from_dict(ref_cfg.to_dict())).eval()
    ours.load_state_dict(ref.state_dict())  # strict: identical names and shapes
    return ref, ours


def _pixels(cfg: QwenVisionConfig, grids: list[tuple[int, int, int]], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), cfg.patch_dim, generator=g)


def _run_both(ref: torch.nn.Module, ours: QwenVisionTower, grids: list[tuple[int, int, int]], seed: int = 0):
    px, thw = _pixels(ours.cfg, grids, seed), torch.tensor(grids)
    with torch.no_grad():
        out = ref(px, grid_thw=thw, return_dict=True)
        merged, deepstack = ours(px, thw)
    return (out.pooler_output, list(out.deepstack_features)), (merged, deepstack)


def _assert_matches(got: tuple[torch.Tensor, list[torch.Tensor]], want: tuple[torch.Tensor, list[torch.Tensor]]):
    assert len(got[1]) == len(want[1])
    for g, w in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
        assert g.dtype == torch.float32 and g.shape == w.shape
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


def test_parameter_names_match_reference(towers):
    ref, ours = towers
    assert not IGNORED_KEYS
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    assert ours.state_dict()["patch_embed.proj.weight"].dim() == 5


@pytest.mark.parametrize("grid", [(1, 4, 6), (1, 12, 10), (1, 2, 2), (1, 2, 16), (1, 8, 8), (1, 6, 6), (2, 4, 4)],
                         ids=lambda g: "x".join(map(str, g)))
def test_single_image_matches_reference(towers, grid):
    """Non-square, larger than the table side (interpolated up), smaller (down), equal, and a 2-frame video."""
    ref, ours = towers
    want, got = _run_both(ref, ours, [grid])
    assert got[0].shape == (ours.cfg.tokens_for_grid(*grid), 48)
    assert len(got[1]) == 2
    _assert_matches(got, want)


@pytest.mark.parametrize("grids", [[(1, 4, 6), (1, 10, 2)], [(1, 4, 4), (1, 4, 4), (1, 2, 8)], [(1, 2, 2), (2, 6, 4)]],
                         ids=["two-sizes", "same-size-batched", "image-and-video"])
def test_several_images_match_reference_and_each_alone(towers, grids):
    ref, ours = towers
    want, got = _run_both(ref, ours, grids, seed=7)
    _assert_matches(got, want)
    # Each image encoded alone gives its rows of the joint call: no attention across images.
    px, ofs, rows = _pixels(ours.cfg, grids, seed=7), 0, 0
    for t, h, w in grids:
        n, m = t * h * w, ours.cfg.tokens_for_grid(t, h, w)
        with torch.no_grad():
            merged, deepstack = ours(px[ofs:ofs + n], torch.tensor([[t, h, w]]))
        _assert_matches((got[0][rows:rows + m], [d[rows:rows + m] for d in got[1]]), (merged, deepstack))
        ofs, rows = ofs + n, rows + m


def test_bfloat16_weights_cast_inputs(towers):
    """bf16 tower takes float32 pixels; close to the bf16 reference (both round the same way, loosely)."""
    ref, ours = towers
    grids = [(1, 4, 6), (1, 2, 2)]
    px, thw = _pixels(ours.cfg, grids), torch.tensor(grids)
    ref16, ours16 = (m.to(torch.bfloat16) for m in (ref, ours))
    try:
        with torch.no_grad():
            want = ref16(px.to(torch.bfloat16), grid_thw=thw, return_dict=True).pooler_output
            got, _ = ours16(px, thw)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.05)
    finally:
        ref.float(), ours.float()


def test_rejects_inputs_not_matching_grid(towers):
    _, ours = towers
    with pytest.raises(ValueError, match="pixel_values shape"):
        ours(torch.zeros(15, ours.cfg.patch_dim), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="multiples of 2"):
        ours(torch.zeros(12, ours.cfg.patch_dim), torch.tensor([[1, 3, 4]]))


def test_from_dict_released_config():
    cfg = QwenVisionConfig.from_dict(RELEASED)
    assert cfg == QwenVisionConfig(
        depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, temporal_patch_size=2,
        spatial_merge_size=2, in_channels=3, out_hidden_size=2048, num_position_embeddings=2304,
        deepstack_visual_indexes=(8, 16, 24), hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, rope_theta=10000.0)
    assert (cfg.head_dim, cfg.position_side, cfg.patch_dim) == (72, 48, 1536)
    assert cfg.tokens_for_grid(1, 32, 24) == 192 and cfg.tokens_for_grid(2, 4, 6) == 12
    # transformers' aliases and defaults for optional keys
    alias = {k: v for k, v in RELEASED.items() if k not in ("depth", "num_heads", "in_channels", "temporal_patch_size")}
    assert QwenVisionConfig.from_dict({**alias, "num_hidden_layers": 27, "num_attention_heads": 16}) == cfg


@pytest.mark.parametrize("change, error, match", [
    ({"hidden_size": None}, CheckpointError, "missing 'hidden_size'"),
    ({"deepstack_visual_indexes": None}, CheckpointError, "missing 'deepstack_visual_indexes'"),
    ({"hidden_act": "swiglu_fancy"}, UnsupportedModelError, "activation"),
    ({"rope_parameters": {"rope_type": "mrope"}}, UnsupportedModelError, "rope_type"),
    ({"num_position_embeddings": 2300}, CheckpointError, "not a square"),
    ({"deepstack_visual_indexes": [8, 27]}, CheckpointError, "deepstack"),
    ({"num_heads": 7}, CheckpointError, "head_dim"),
    ({"depth": 0}, CheckpointError, "positive"),
    ({"patch_size": "16px"}, CheckpointError, "patch_size"),
], ids=["no-hidden", "no-deepstack", "act", "rope", "pos-square", "deepstack-range", "heads", "depth", "type"])
def test_from_dict_rejects_bad_config(change, error, match):
    d = {k: v for k, v in {**RELEASED, **change}.items() if v is not None}
    with pytest.raises(error, match=match) as e:
        QwenVisionConfig.from_dict(d)
    if error is CheckpointError:
        assert not isinstance(e.value, UnsupportedModelError)


def test_config_is_validated_on_construction():
    cfg = QwenVisionConfig.from_dict(RELEASED)
    with pytest.raises(UnsupportedModelError):
        dataclasses.replace(cfg, hidden_act="nope")
    with pytest.raises(CheckpointError):
        dataclasses.replace(cfg, deepstack_visual_indexes=(8, 8))
