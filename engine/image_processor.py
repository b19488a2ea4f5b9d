"""Image decoding and preprocessing for the vision tower.

:class:`ImageProcessor` reproduces transformers' ``SiglipImageProcessorPil`` and ``CLIPImageProcessorPil`` (pixel
values equal within 1e-5) without importing transformers. Per image, in the reference's order:

1. ``do_convert_rgb``: composite any transparency onto white, then convert to RGB (uint8).
2. ``do_resize``: PIL ``Image.resize`` with the configured filter, to exact ``(height, width)`` (SigLIP) or so the
   shortest edge is ``shortest_edge`` and the long edge ``int(shortest_edge * long / short)`` (CLIP).
3. ``do_center_crop``: crop ``crop_size`` from the centre, zero-padding when the image is smaller.
4. ``do_rescale``: ``float32(float64(x) * rescale_factor)``.
5. ``do_normalize``: ``(x - mean) / std`` in float32.

The output size must be fixed (a crop, or an exact resize) because the vision tower takes one resolution.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import PIL.ImageOps
import torch

from engine.errors import CheckpointError, ImageDecodeError, InvalidRequestError, UnsupportedModelError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_RESAMPLE_FILTERS = {int(f) for f in PIL.Image.Resampling}  # NEAREST=0 LANCZOS=1 BILINEAR=2 BICUBIC=3 BOX=4 HAMMING=5


def check_pixel_steps(resample: int, rescale_factor: float, image_mean, image_std) -> None:
    """The resample filter, rescale and normalisation every image processor config shares; CheckpointError when
    unusable."""
    if resample not in _RESAMPLE_FILTERS:
        raise CheckpointError(f"unknown resample filter {resample}")
    if not rescale_factor > 0:
        raise CheckpointError(f"rescale_factor must be positive, got {rescale_factor}")
    if len(image_mean) != 3 or len(image_std) != 3 or 0 in image_std:
        raise CheckpointError(f"image_mean/std need 3 values, std non-zero: {image_mean}, {image_std}")


def pixel_table(do_rescale: bool, rescale_factor: float, do_normalize: bool, image_mean, image_std) -> np.ndarray:
    """``[3, 256]`` float32: what steps 4-5 (rescale, normalise) make of each uint8 value in each channel, computed
    with the reference's operations (float64 multiply, then float32; float32 subtract and divide), so looking a
    pixel up gives the same bits as computing it, at a fraction of the cost (a 1024² image: ~57 ms computed)."""
    values = np.arange(256, dtype=np.uint8)[None, :].repeat(3, axis=0)
    x = (values * np.float64(rescale_factor) if do_rescale else values).astype(np.float32)
    if do_normalize:
        x = (x - np.asarray(image_mean, np.float32)[:, None]) / np.asarray(image_std, np.float32)[:, None]
    return np.ascontiguousarray(x, dtype=np.float32)


def lookup_pixels(table: np.ndarray, pixels: np.ndarray) -> np.ndarray:
    """``[..., 3]`` uint8 -> float32 of the same shape through :func:`pixel_table`."""
    return table[np.arange(3), pixels]


def check_resized(arrays: list, shapes: list[tuple[int, int]]) -> None:
    """InvalidRequestError unless ``arrays`` are uint8 ``[H, W, 3]`` of the given ``(H, W)`` each (images resized
    elsewhere, e.g. by a front-end)."""
    if len(arrays) != len(shapes):
        raise InvalidRequestError(f"{len(arrays)} resized image(s) for {len(shapes)} image(s)")
    for i, (a, (h, w)) in enumerate(zip(arrays, shapes)):
        if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.shape != (h, w, 3):
            got = (a.dtype, a.shape) if isinstance(a, np.ndarray) else type(a).__name__
            raise InvalidRequestError(f"resized image {i} must be uint8 [{h}, {w}, 3], got {got}")


class DeferredPixels:
    """A prompt's pixel values, computed when first needed (``MultiModalInput.pixel_values`` as a function): the
    images resized to uint8 (:meth:`uint8`, what a vision worker is sent: 1/8 of the float32 patches' bytes, and
    Qwen-VL's patches repeat each frame over ``temporal_patch_size``), then the processor's float input from them
    (calling it). ``processor`` has ``resize(images)`` and ``from_uint8(arrays)``."""

    def __init__(self, processor: Any, images: list[PIL.Image.Image] | None = None,
                 resized: list[np.ndarray] | None = None) -> None:
        self.processor, self._images, self._resized = processor, images, resized

    def uint8(self) -> list[np.ndarray]:
        if self._resized is None:
            self._resized, self._images = self.processor.resize(self._images), None
        return self._resized

    def __call__(self) -> torch.Tensor:
        return self.processor.from_uint8(self.uint8())


_REFERENCE_DEFAULT_SIZE = 224  # the size transformers' SigLIP and CLIP processors default to


def load_image(src: str | os.PathLike | bytes | PIL.Image.Image) -> PIL.Image.Image:
    """Open and fully decode an image from a path, raw bytes, or an existing ``PIL.Image``.

    The EXIF orientation is applied (as transformers' ``load_image`` does); the mode is kept, so the processor can
    composite transparency the way the reference does. Raises :class:`ImageDecodeError` with a one-line message
    (missing file, not an image, truncated or corrupt data) instead of a PIL traceback.
    """
    try:
        if isinstance(src, PIL.Image.Image):
            image = src
        elif isinstance(src, (bytes, bytearray, memoryview)):
            image = PIL.Image.open(io.BytesIO(bytes(src)))
        else:
            image = PIL.Image.open(os.fspath(src))
        image.load()
        return PIL.ImageOps.exif_transpose(image)
    except FileNotFoundError:
        raise ImageDecodeError(f"image file not found: {os.fspath(src)!r}") from None
    except (IsADirectoryError, PermissionError) as err:
        raise ImageDecodeError(f"cannot read image file {os.fspath(src)!r}: {err.strerror}") from None
    except PIL.UnidentifiedImageError:
        raise ImageDecodeError("data is not a recognised image format") from None
    except PIL.Image.DecompressionBombError as err:
        raise ImageDecodeError(f"image too large: {err}") from None
    except (OSError, ValueError, SyntaxError) as err:
        raise ImageDecodeError(f"image is truncated or corrupt: {err}") from None


def image_content_hash(image: PIL.Image.Image) -> bytes:
    """16-byte blake2b digest of the mode, size, palette, transparency and pixel bytes of ``image``.

    Equal pixels give equal digests across processes; any change the processor can see changes it. Used as the key
    of prefix caching and of the vision-encoder cache.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode}:{image.width}x{image.height}:{image.info.get('transparency')!r}:".encode())
    if image.mode in ("P", "PA"):
        h.update(bytes(image.getpalette() or []))
    h.update(image.tobytes())
    return h.digest()


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Preprocessing settings, with the names and meaning of the keys in ``preprocessor_config.json``.

    ``size`` is ``{"height": H, "width": W}`` or ``{"shortest_edge": S}``; ``crop_size`` is ``{"height", "width"}``
    or ``None``; ``resample`` is a ``PIL.Image.Resampling`` number. The defaults are SigLIP's at 224 x 224. Raises
    :class:`CheckpointError` when invalid or when the output size would depend on the input.
    """

    do_resize: bool = True
    size: dict[str, int] | None = field(
        default_factory=lambda: {"height": _REFERENCE_DEFAULT_SIZE, "width": _REFERENCE_DEFAULT_SIZE})
    resample: int = int(PIL.Image.Resampling.BICUBIC)
    do_center_crop: bool = False
    crop_size: dict[str, int] | None = None
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        if self.do_resize and not _is_size(self.size, ("height", "width"), ("shortest_edge",)):
            raise CheckpointError(f"image size must be {{height, width}} or {{shortest_edge}}, got {self.size}")
        if self.do_center_crop and not _is_size(self.crop_size, ("height", "width")):
            raise CheckpointError(f"crop_size must be {{height, width}}, got {self.crop_size}")
        if not self.do_center_crop and not (self.do_resize and "height" in self.size):
            raise CheckpointError("image preprocessing must end in a fixed size (exact resize or center crop)")
        check_pixel_steps(self.resample, self.rescale_factor, self.image_mean, self.image_std)

    @classmethod
    def defaults(cls, vision_model_type: str, image_size: int | None = None) -> ImageProcessorConfig:
        """What transformers uses for ``vision_model_type`` (SigLIP or CLIP) at ``image_size`` (default 224)."""
        side = image_size or _REFERENCE_DEFAULT_SIZE
        if "siglip" in vision_model_type:
            return cls(size={"height": side, "width": side})
        if "clip" in vision_model_type:
            return cls(size={"shortest_edge": side}, do_center_crop=True, crop_size={"height": side, "width": side},
                       image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD)
        raise UnsupportedModelError(f"no image preprocessing defaults for vision model type {vision_model_type!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], defaults: ImageProcessorConfig) -> ImageProcessorConfig:
        """Overlay the keys of a saved processor config on ``defaults``; ``None`` means default, as in the reference."""
        values = {f.name: getattr(defaults, f.name) for f in fields(cls)}
        values |= {k: raw[k] for k in values if raw.get(k) is not None}
        try:
            values["size"] = _size_dict(values["size"], square=bool(raw.get("default_to_square", False)))
            values["crop_size"] = _size_dict(values["crop_size"], square=True)
            values["image_mean"] = _triple(values["image_mean"])
            values["image_std"] = _triple(values["image_std"])
            values["resample"] = int(values["resample"])
            values["rescale_factor"] = float(values["rescale_factor"])
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"malformed image processor config: {err}") from None
        return cls(**values)


class ImageProcessor:
    """Turns PIL images into the ``pixel_values`` the vision tower takes."""

    def __init__(self, config: ImageProcessorConfig):
        self.config = config
        self._table = pixel_table(config.do_rescale, config.rescale_factor, config.do_normalize, config.image_mean,
                                  config.image_std)
        final = config.crop_size if config.do_center_crop else config.size
        self._output_size = (final["height"], final["width"])

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, *, default_image_size: int | None = None,
                        vision_model_type: str = "siglip_vision_model") -> ImageProcessor:
        """Load ``preprocessor_config.json`` (or the ``image_processor`` entry of ``processor_config.json``).

        Missing keys take the defaults of the processor type the file names (``SiglipImageProcessor*`` or
        ``CLIPImageProcessor*``), else of ``vision_model_type``. Without either file, use the defaults transformers
        has for ``vision_model_type`` at ``default_image_size``. Raises :class:`CheckpointError` for a malformed
        file and :class:`UnsupportedModelError` for another processor type.
        """
        raw = _read_processor_json(Path(model_dir))
        if raw is None:
            return cls(ImageProcessorConfig.defaults(vision_model_type, default_image_size))
        type_name = str(raw.get("image_processor_type") or raw.get("image_processor_class") or "")
        family = type_name.lower() if type_name else vision_model_type
        if type_name and not type_name.startswith(("SiglipImageProcessor", "CLIPImageProcessor")):
            raise UnsupportedModelError(f"unsupported image processor type {type_name!r}")
        return cls(ImageProcessorConfig.from_dict(raw, ImageProcessorConfig.defaults(family)))

    @property
    def output_size(self) -> tuple[int, int]:
        """``(height, width)`` of every processed image."""
        return self._output_size

    def __call__(self, images: list[PIL.Image.Image]) -> torch.Tensor:
        """Preprocess ``images`` into a ``[N, 3, H, W]`` float32 tensor (``H, W = output_size``).

        Any PIL mode is accepted when ``do_convert_rgb`` is set; otherwise images must already be RGB
        (:class:`InvalidRequestError`).
        """
        return self.from_uint8(self.resize(images))

    def resize(self, images: list[PIL.Image.Image]) -> list[np.ndarray]:
        """Steps 1-3 on each image: ``[H, W, 3]`` uint8 of ``output_size``."""
        return [self._to_uint8(image) for image in images]

    def resized_shapes(self, n: int, grid_thw: Any = None) -> list[tuple[int, int]]:
        """``(H, W)`` of each of ``n`` resized images."""
        return [self.output_size] * n

    def from_uint8(self, arrays: list[np.ndarray]) -> torch.Tensor:
        """Steps 4-5 on resized images (:meth:`resize`): ``[N, 3, H, W]`` float32."""
        if not arrays:
            return torch.zeros((0, 3, *self.output_size))
        x = lookup_pixels(self._table, np.stack(arrays))
        return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))

    def _to_uint8(self, image: PIL.Image.Image) -> np.ndarray:
        """Steps 1-3 on one image: ``[H, W, 3]`` uint8 of ``output_size``."""
        c = self.config
        if c.do_convert_rgb:
            image = _convert_rgb(image)
        elif image.mode != "RGB":
            raise InvalidRequestError(f"image mode {image.mode!r} is not RGB and do_convert_rgb is off")
        if c.do_resize:
            image = image.resize(_resize_wh(image.size, c.size), resample=c.resample)
        pixels = np.asarray(image)
        return _center_crop(pixels, c.crop_size["height"], c.crop_size["width"]) if c.do_center_crop else pixels


def _convert_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """RGB copy of ``image`` with any transparency composited onto white (transformers' ``convert_to_rgb``)."""
    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    white = PIL.Image.new("RGBA", image.size, (255, 255, 255, 255))
    return PIL.Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")


def _resize_wh(in_wh: tuple[int, int], size: dict[str, int]) -> tuple[int, int]:
    """PIL ``(width, height)`` to resize an image of ``in_wh`` to, with the reference's integer truncation."""
    if "height" in size:
        return size["width"], size["height"]
    width, height = in_wh
    short, long = min(width, height), max(width, height)
    new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
    return (new_short, new_long) if width <= height else (new_long, new_short)


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """``[height, width, C]`` from the centre of ``pixels`` ``[H, W, C]``, zero-padded (extra row/column at the
    start, as the reference rounds up) where the image is smaller than the crop."""
    in_h, in_w = pixels.shape[:2]
    pad_h, pad_w = max(height - in_h, 0), max(width - in_w, 0)
    if pad_h or pad_w:
        top_pad, left_pad = -(-pad_h // 2), -(-pad_w // 2)
        pixels = np.pad(pixels, ((top_pad, pad_h - top_pad), (left_pad, pad_w - left_pad), (0, 0)))
    top, left = max((in_h - height) // 2, 0), max((in_w - width) // 2, 0)
    return pixels[top : top + height, left : left + width]


def _read_processor_json(model_dir: Path) -> dict[str, Any] | None:
    """The image-processor dict saved in ``model_dir``, or ``None`` when there is none."""
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"cannot read {path}: {err}") from None
        raw = raw.get(key) if key and isinstance(raw, dict) else raw
        if key and raw is None:
            continue
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: image processor config must be a JSON object")
        return raw
    return None


def _is_size(size: object, *key_sets: tuple[str, ...]) -> bool:
    """Whether ``size`` is a dict with exactly one of ``key_sets`` as keys, all positive ints."""
    return (isinstance(size, dict) and any(set(size) == set(keys) for keys in key_sets)
            and all(isinstance(v, int) and v > 0 for v in size.values()))


def _size_dict(size: int | list[int] | dict[str, int] | None, *, square: bool) -> dict[str, int] | None:
    """Legacy size forms as the reference reads them: an int is a square (``square``) or a shortest edge."""
    if size is None or isinstance(size, dict):
        return size
    if isinstance(size, int):
        return {"height": size, "width": size} if square else {"shortest_edge": size}
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return {"height": int(size[0]), "width": int(size[1])}
    raise ValueError(f"cannot read size {size!r}")


def _triple(value: float | list[float] | tuple[float, ...]) -> tuple[float, ...]:
    """A per-channel tuple from a scalar or a sequence."""
    return (float(value),) * 3 if isinstance(value, (int, float)) else tuple(float(v) for v in value)
