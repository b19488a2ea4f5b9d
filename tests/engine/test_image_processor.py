"""engine.image_processor against transformers' SiglipImageProcessorPil / CLIPImageProcessorPil."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from transformers import CLIPImageProcessorPil, SiglipImageProcessorPil

from engine.errors import CheckpointError, ImageDecodeError, InvalidRequestError, UnsupportedModelError
from engine.image_processor import ImageProcessor, image_content_hash, load_image


def _image(width: int, height: int, mode: str, seed: int = 0) -> PIL.Image.Image:
    """A random-noise image of ``mode``; ``"P+t"`` is a palette image with a transparent colour."""
    rng = np.random.default_rng(seed)
    rgba = PIL.Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    if mode.startswith("P"):
        image = rgba.convert("RGB").quantize(colors=64)
        if mode == "P+t":
            image.info["transparency"] = 3
        return image
    return rgba.convert(mode)


def _images() -> list[PIL.Image.Image]:
    """Square and non-square, smaller and larger than the outputs, every common mode."""
    shapes = [(64, 64, "RGB"), (300, 200, "RGB"), (37, 91, "RGBA"), (500, 410, "L"), (120, 33, "P"), (17, 17, "LA"),
              (45, 60, "P+t")]
    return [_image(w, h, mode, seed=i) for i, (w, h, mode) in enumerate(shapes)]


def _assert_matches(reference, tmp_path: Path, images: list[PIL.Image.Image]) -> None:
    reference.save_pretrained(tmp_path)
    ours = ImageProcessor.from_pretrained(tmp_path)
    for image in images:  # one at a time: the reference cannot batch differently-sized CLIP resizes into a tensor
        expected = reference([image], return_tensors="pt")["pixel_values"]
        got = ours([image])
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert got.shape[-2:] == ours.output_size
        assert (got - expected.float()).abs().max().item() < 1e-5, (image.mode, image.size)
    batch = ours(images)
    assert batch.shape == (len(images), 3, *ours.output_size)
    assert torch.equal(batch[1], ours([images[1]])[0])


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"size": {"height": 48, "width": 32}},
        {"size": {"height": 30, "width": 30}, "resample": PIL.Image.Resampling.BILINEAR},
        {"size": {"height": 28, "width": 40}, "resample": PIL.Image.Resampling.NEAREST, "do_normalize": False},
        {"size": {"height": 33, "width": 33}, "resample": PIL.Image.Resampling.LANCZOS,
         "image_mean": [0.1, 0.2, 0.3], "image_std": [0.9, 0.8, 0.7]},
        {"size": {"height": 24, "width": 24}, "do_rescale": False, "do_normalize": False},
        {"size": {"height": 24, "width": 24}, "do_rescale": False},
    ],
    ids=["default", "non-square", "bilinear", "nearest-no-norm", "lanczos-custom-mean", "no-rescale-no-norm", "no-rescale"],
)
def test_siglip_matches_reference(tmp_path: Path, kwargs: dict) -> None:
    _assert_matches(SiglipImageProcessorPil(**kwargs), tmp_path, _images())


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"size": {"shortest_edge": 40}, "crop_size": {"height": 40, "width": 40}},
        {"size": {"shortest_edge": 30}, "crop_size": {"height": 48, "width": 24}},  # crop larger than resize: pads
        {"size": {"shortest_edge": 50}, "crop_size": 32, "resample": PIL.Image.Resampling.BOX},
        {"size": {"shortest_edge": 35}, "crop_size": {"height": 35, "width": 35}, "do_normalize": False,
         "resample": PIL.Image.Resampling.HAMMING},
        {"do_resize": False, "crop_size": {"height": 70, "width": 50}},  # crop only, pads small inputs
    ],
    ids=["default", "small", "pad-crop", "int-crop-box", "hamming-no-norm", "crop-only"],
)
def test_clip_matches_reference(tmp_path: Path, kwargs: dict) -> None:
    _assert_matches(CLIPImageProcessorPil(**kwargs), tmp_path, _images())


def test_without_convert_rgb_rgb_matches_and_other_modes_are_rejected(tmp_path: Path) -> None:
    rgb = [_image(50, 30, "RGB"), _image(20, 20, "RGB", seed=1)]
    _assert_matches(SiglipImageProcessorPil(size={"height": 24, "width": 24}, do_convert_rgb=False), tmp_path, rgb)
    with pytest.raises(InvalidRequestError, match="not RGB"):
        ImageProcessor.from_pretrained(tmp_path)([_image(20, 20, "RGBA")])


def test_empty_batch(tmp_path: Path) -> None:
    out = ImageProcessor.from_pretrained(tmp_path, default_image_size=32)([])
    assert out.shape == (0, 3, 32, 32) and out.dtype == torch.float32


def test_saved_config_records_processor_type(tmp_path: Path) -> None:
    CLIPImageProcessorPil().save_pretrained(tmp_path)
    assert json.loads((tmp_path / "preprocessor_config.json").read_text())["image_processor_type"] == "CLIPImageProcessor"


def test_processor_config_json_with_image_processor_entry(tmp_path: Path) -> None:
    reference = SiglipImageProcessorPil(size={"height": 40, "width": 36})
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": reference.to_dict(), "patch_size": 4}))
    image = _image(50, 70, "RGB")
    got = ImageProcessor.from_pretrained(tmp_path)([image])
    assert torch.allclose(got, reference([image], return_tensors="pt")["pixel_values"], atol=1e-5, rtol=0)


def test_legacy_int_sizes_read_like_reference(tmp_path: Path) -> None:
    """Old CLIP configs say ``"size": 224, "crop_size": 224``: shortest edge, then a square crop."""
    raw = {"image_processor_type": "CLIPImageProcessor", "size": 36, "crop_size": 30, "do_center_crop": True}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(raw))
    reference = CLIPImageProcessorPil(size=36, crop_size=30)
    image = _image(80, 45, "RGB")
    got = ImageProcessor.from_pretrained(tmp_path)([image])
    assert torch.allclose(got, reference([image], return_tensors="pt")["pixel_values"], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("vision_model_type", "reference"),
    [
        ("siglip_vision_model", SiglipImageProcessorPil(size={"height": 56, "width": 56})),
        ("clip_vision_model", CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size=56)),
    ],
    ids=["siglip", "clip"],
)
def test_fallback_defaults_without_config(tmp_path: Path, vision_model_type: str, reference) -> None:
    ours = ImageProcessor.from_pretrained(tmp_path, default_image_size=56, vision_model_type=vision_model_type)
    assert ours.output_size == (56, 56)
    for image in _images()[:3]:
        expected = reference([image], return_tensors="pt")["pixel_values"]
        assert torch.allclose(ours([image]), expected, atol=1e-5, rtol=0)


def test_fallback_rejects_unknown_vision_tower(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError):
        ImageProcessor.from_pretrained(tmp_path, vision_model_type="pixtral")


@pytest.mark.parametrize(
    "content",
    ["{not json", "[1, 2]", json.dumps({"size": {"foo": 3}}), json.dumps({"size": {"height": 8, "width": 8}, "resample": 9}),
     json.dumps({"size": {"shortest_edge": 8}}), json.dumps({"size": {"height": 8, "width": 8}, "image_mean": [0.5, 0.5]})],
    ids=["bad-json", "not-object", "bad-size-keys", "bad-resample", "size-not-fixed", "short-mean"],
)
def test_malformed_config_raises_checkpoint_error(tmp_path: Path, content: str) -> None:
    (tmp_path / "preprocessor_config.json").write_text(content)
    with pytest.raises(CheckpointError):
        ImageProcessor.from_pretrained(tmp_path)


def test_load_image_from_path_bytes_and_image(tmp_path: Path) -> None:
    image = _image(20, 10, "RGBA")
    path = tmp_path / "x.png"
    image.save(path)
    for src in (path, str(path), path.read_bytes(), image):
        loaded = load_image(src)
        assert loaded.size == (20, 10) and loaded.mode == "RGBA"
        assert image_content_hash(loaded) == image_content_hash(image)


def test_load_image_errors(tmp_path: Path) -> None:
    buf = io.BytesIO()
    _image(64, 64, "RGB").save(buf, format="PNG")
    png = buf.getvalue()
    cases = {
        "not found": tmp_path / "missing.png",
        "not a recognised image": b"definitely not an image",
        "truncated": png[: len(png) // 2],
        "cannot read": tmp_path,
    }
    for words, src in cases.items():
        with pytest.raises(ImageDecodeError, match=words) as err:
            load_image(src)
        assert "\n" not in str(err.value)


def test_image_content_hash() -> None:
    a = _image(16, 8, "RGB", seed=3)
    b = PIL.Image.frombytes("RGB", a.size, a.tobytes())
    assert image_content_hash(a) == image_content_hash(b)
    assert len(image_content_hash(a)) == 16
    b.putpixel((5, 5), tuple((v + 1) % 256 for v in b.getpixel((5, 5))))
    assert image_content_hash(a) != image_content_hash(b)
    assert image_content_hash(a) != image_content_hash(a.convert("RGBA"))
    assert image_content_hash(a) != image_content_hash(a.resize((8, 16)))


@pytest.mark.parametrize("rescale,normalize", [(True, True), (True, False), (False, True), (False, False)])
def test_the_pixel_table_gives_the_bits_the_arithmetic_gives(rescale: bool, normalize: bool) -> None:
    """Rescale and normalise by table lookup (``pixel_table``): every uint8 value in every channel, the same float32
    as the reference's operations on the image (float64 multiply then float32; float32 subtract and divide)."""
    from engine.image_processor import lookup_pixels, pixel_table

    mean, std, factor = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711), 1 / 255
    pixels = np.random.default_rng(0).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    pixels[0, :3] = [[0, 0, 0], [255, 255, 255], [128, 1, 254]]
    x = (pixels * np.float64(factor) if rescale else pixels).astype(np.float32)
    if normalize:
        x = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    got = lookup_pixels(pixel_table(rescale, factor, normalize, mean, std), pixels)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), x.view(np.uint32))
