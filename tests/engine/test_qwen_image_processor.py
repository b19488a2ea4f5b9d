"""engine.models.qwen3_vl.image_processor against transformers' Qwen2VLImageProcessorPil (what Qwen3-VL checkpoints use)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from transformers import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference_smart_resize

from engine.errors import CheckpointError, InvalidRequestError, UnsupportedModelError
from engine.models.qwen3_vl.image_processor import ImageSizeError, QwenVLImageProcessor
from tests.conftest import make_image

# What a Qwen3-VL checkpoint's preprocessor_config.json holds (transformers 5 spelling of the area bounds).
QWEN3_VL_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
    "size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}
# The older Qwen2-VL spelling: top-level min_pixels / max_pixels.
QWEN2_VL_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
    "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3,
}


def _image(height: int, width: int, mode: str = "RGB", seed: int = 0) -> PIL.Image.Image:
    """Random noise in ``mode``; ``"P+t"`` is a palette image with a transparent colour."""
    rgba = PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 4), dtype=np.uint8))
    if mode.startswith("P"):
        image = rgba.convert("RGB").quantize(colors=64)
        if mode == "P+t":
            image.info["transparency"] = 3
        return image
    return rgba.convert(mode)


def _assert_matches(ours: QwenVLImageProcessor, reference: Qwen2VLImageProcessorPil,
                    images: list[PIL.Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
    expected = reference(images, return_tensors="pt")
    pixel_values, grid_thw = ours(images)
    assert pixel_values.dtype == torch.float32 and grid_thw.dtype == torch.int64
    assert torch.equal(grid_thw, expected["image_grid_thw"])
    assert pixel_values.shape == expected["pixel_values"].shape
    assert torch.allclose(pixel_values, expected["pixel_values"].float(), atol=1e-5, rtol=0)
    assert [list(ours.grid_thw(im.height, im.width)) for im in images] == grid_thw.tolist()  # no-pixel path
    return pixel_values, grid_thw


@pytest.mark.parametrize("patch_size", [14, 16])
@pytest.mark.parametrize("hw", [(33, 47), (100, 61), (257, 255), (500, 300)], ids=lambda hw: f"{hw[0]}x{hw[1]}")
def test_sizes_not_multiples_of_the_factor(hw: tuple[int, int], patch_size: int) -> None:
    ours = QwenVLImageProcessor(patch_size=patch_size)
    _assert_matches(ours, Qwen2VLImageProcessorPil(patch_size=patch_size), [make_image(seed=hw[0], size=hw)])


@pytest.mark.parametrize("hw", [(1, 1), (5, 3), (20, 9)])
def test_tiny_image_is_upscaled_to_min_pixels(hw: tuple[int, int]) -> None:
    ours = QwenVLImageProcessor(min_pixels=64 * 64)
    _, grid = _assert_matches(ours, Qwen2VLImageProcessorPil(patch_size=16, min_pixels=64 * 64), [make_image(size=hw)])
    _, h, w = grid[0].tolist()
    assert h * w * 16 * 16 >= ours.min_pixels


def test_large_image_is_downscaled_below_max_pixels() -> None:
    ours = QwenVLImageProcessor(max_pixels=128 * 128)
    reference = Qwen2VLImageProcessorPil(patch_size=16, max_pixels=128 * 128)
    _, grid = _assert_matches(ours, reference, [make_image(size=(480, 640))])
    _, h, w = grid[0].tolist()
    assert h * w * 16 * 16 <= ours.max_pixels and (h, w) == (6, 8)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P", "P+t"])
def test_modes_composite_like_the_reference(mode: str) -> None:
    image = _image(45, 70, mode, seed=3)
    _assert_matches(QwenVLImageProcessor(), Qwen2VLImageProcessorPil(patch_size=16), [image])


def test_batch_of_different_sizes_concatenates_in_order() -> None:
    images = [make_image(seed=1, size=(33, 47)), _image(257, 255, "RGBA", 2), make_image(seed=3, size=(100, 61))]
    ours = QwenVLImageProcessor()
    pixel_values, grid = _assert_matches(ours, Qwen2VLImageProcessorPil(patch_size=16), images)
    counts = grid.prod(dim=1).tolist()
    singles = [ours([image])[0] for image in images]
    assert counts == [len(s) for s in singles]
    assert torch.equal(pixel_values, torch.cat(singles))
    assert [ours.num_visual_tokens(im.height, im.width) for im in images] == [c // 4 for c in counts]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"resample": PIL.Image.Resampling.BILINEAR},
        {"resample": PIL.Image.Resampling.LANCZOS, "image_mean": (0.1, 0.2, 0.3), "image_std": (0.9, 0.8, 0.7)},
        {"resample": PIL.Image.Resampling.NEAREST, "do_normalize": False},
        {"do_rescale": False},
        {"do_rescale": False, "do_normalize": False},
        {"temporal_patch_size": 1, "merge_size": 1},
        {"temporal_patch_size": 3, "patch_size": 14},
    ],
    ids=["bilinear", "lanczos-mean-std", "nearest-no-normalize", "no-rescale", "raw", "t1-m1", "t3-p14"],
)
def test_options_match(kwargs: dict) -> None:
    kwargs = {"patch_size": 16, **kwargs}
    images = [make_image(seed=5, size=(90, 77)), _image(40, 130, "P", 6)]
    _assert_matches(QwenVLImageProcessor(**kwargs), Qwen2VLImageProcessorPil(**kwargs), images)


def test_without_resize_takes_multiples_of_the_factor_as_is() -> None:
    images = [make_image(seed=7, size=(64, 96))]
    ours = QwenVLImageProcessor(do_resize=False)
    _assert_matches(ours, Qwen2VLImageProcessorPil(patch_size=16, do_resize=False), images)
    with pytest.raises(ImageSizeError):
        ours([make_image(size=(64, 95))])


def test_patch_rows_keep_merge_groups_adjacent() -> None:
    """Worked example: a 4x8 image, P=2, m=2, no scaling; pixel value = 10*row + col (same in every channel)."""
    plane = np.add.outer(10 * np.arange(4), np.arange(8)).astype(np.uint8)
    image = PIL.Image.fromarray(np.repeat(plane[..., None], 3, axis=2))
    ours = QwenVLImageProcessor(patch_size=2, min_pixels=4, do_resize=False, do_rescale=False, do_normalize=False)
    pixel_values, grid = ours([image])
    assert grid.tolist() == [[1, 2, 4]]
    rows = pixel_values.reshape(8, 3, 2, 2, 2)[:, 0, 0]  # channel 0, frame 0: each row's 2x2 patch
    # first merge group: patches (0,0) (0,1) (1,0) (1,1); then the group to its right
    assert rows[:5].tolist() == [[[0, 1], [10, 11]], [[2, 3], [12, 13]], [[20, 21], [30, 31]],
                                 [[22, 23], [32, 33]], [[4, 5], [14, 15]]]
    assert torch.equal(pixel_values.reshape(8, 3, 2, 4)[:, :, 0], pixel_values.reshape(8, 3, 2, 4)[:, :, 1])


@pytest.mark.parametrize("config", [QWEN3_VL_CONFIG, QWEN2_VL_CONFIG,
                                    {**QWEN3_VL_CONFIG, "min_pixels": 4096, "max_pixels": 40000}],
                         ids=["size-dict", "min-max-pixels", "both-min-max-wins"])
def test_config_read_like_the_reference(tmp_path: Path, config: dict) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    ours = QwenVLImageProcessor.from_pretrained(tmp_path)
    reference = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    assert (ours.min_pixels, ours.max_pixels) == (reference.size.shortest_edge, reference.size.longest_edge)
    assert ours.patch_size == config["patch_size"]
    _assert_matches(ours, reference, [make_image(seed=8, size=(100, 61)), _image(33, 47, "RGBA", 9)])


def test_missing_config_gives_defaults(tmp_path: Path) -> None:
    assert QwenVLImageProcessor.from_pretrained(tmp_path) == QwenVLImageProcessor()
    reference = Qwen2VLImageProcessorPil()
    ours = QwenVLImageProcessor()
    assert (ours.min_pixels, ours.max_pixels) == (reference.size.shortest_edge, reference.size.longest_edge)
    assert (ours.image_mean, ours.image_std, ours.resample) == (reference.image_mean, reference.image_std, 3)
    assert (ours.temporal_patch_size, ours.merge_size, ours.patch_size) == (2, 2, 16)


@pytest.mark.parametrize("patch_size", [14, 16])
def test_grid_from_size_alone_matches_reference(patch_size: int) -> None:
    ours = QwenVLImageProcessor(patch_size=patch_size, max_pixels=1 << 22)
    reference = Qwen2VLImageProcessorPil(patch_size=patch_size, max_pixels=1 << 22)
    rng = np.random.default_rng(patch_size)
    sizes = [(1, 1), (1, 200), (3000, 15), (4000, 4000), *rng.integers(1, 3000, (200, 2)).tolist()]
    for h, w in sizes:
        if max(h, w) / min(h, w) > 200:
            continue
        factor = patch_size * 2
        rh, rw = reference_smart_resize(h, w, factor, reference.size.shortest_edge, reference.size.longest_edge)
        assert ours.grid_thw(h, w) == (1, rh // patch_size, rw // patch_size), (h, w)
        assert ours.num_visual_tokens(h, w) * 4 == reference.get_number_of_image_patches(h, w, {}), (h, w)


@pytest.mark.parametrize("hw", [(1, 201), (2000, 3), (0, 10)])
def test_bad_sizes_raise_typed_errors(hw: tuple[int, int]) -> None:
    ours = QwenVLImageProcessor()
    with pytest.raises(ImageSizeError) as err:
        ours.grid_thw(*hw)
    assert isinstance(err.value, InvalidRequestError) and "\n" not in str(err.value)
    if min(hw) > 0:
        with pytest.raises(ValueError):  # the reference rejects the same images
            Qwen2VLImageProcessorPil(patch_size=16)([make_image(size=hw)])
        with pytest.raises(ImageSizeError):
            ours([make_image(size=(32, 32)), make_image(size=hw)])


def test_without_convert_rgb_only_rgb_is_accepted() -> None:
    ours = QwenVLImageProcessor(do_convert_rgb=False)
    _assert_matches(ours, Qwen2VLImageProcessorPil(patch_size=16, do_convert_rgb=False), [make_image(size=(50, 70))])
    with pytest.raises(InvalidRequestError):
        ours([_image(40, 40, "RGBA")])


def test_empty_batch() -> None:
    pixel_values, grid = QwenVLImageProcessor()([])
    assert pixel_values.shape == (0, 1536) and grid.shape == (0, 3)


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ({"image_processor_type": "SiglipImageProcessor"}, UnsupportedModelError),
        ({"video_processor_type": "Qwen3VLVideoProcessor", "size": {"shortest_edge": 1, "longest_edge": 2}},
         CheckpointError),
        ({"size": {"longest_edge": 1000}}, CheckpointError),
        ({"size": 224}, CheckpointError),
        ({"patch_size": 0}, CheckpointError),
        ({"min_pixels": 5000, "max_pixels": 4000}, CheckpointError),
        ({"image_mean": [0.5, 0.5]}, CheckpointError),
        ({"resample": 9}, CheckpointError),
        ({"patch_size": "big"}, CheckpointError),
        ("{not json", CheckpointError),
    ],
    ids=["other-type", "video-only", "half-size", "int-size", "zero-patch", "min-over-max", "mean-2", "resample",
         "not-int", "bad-json"],
)
def test_config_errors(tmp_path: Path, content: dict | str, error: type[Exception]) -> None:
    text = content if isinstance(content, str) else json.dumps(content)
    (tmp_path / "preprocessor_config.json").write_text(text)
    with pytest.raises(error) as err:
        QwenVLImageProcessor.from_pretrained(tmp_path)
    assert "\n" not in str(err.value)
