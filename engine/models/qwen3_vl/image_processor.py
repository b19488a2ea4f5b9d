"""Dynamic-resolution image preprocessing for Qwen-VL vision towers (Qwen2-VL, Qwen3-VL, Qwen3-VL-MoE).

:class:`QwenVLImageProcessor` reproduces transformers' ``Qwen2VLImageProcessorPil`` (pixel values equal within 1e-5,
grids exactly) without importing transformers. Per image, in the reference's order:

1. ``do_convert_rgb``: composite any transparency onto white, then convert to RGB (uint8).
2. ``do_resize``: PIL ``Image.resize`` with ``resample`` to :func:`smart_resize`'s size: both sides multiples of
   ``factor = patch_size * merge_size``, area within ``[min_pixels, max_pixels]``, aspect ratio kept.
3. ``do_rescale``: ``float32(float64(x) * rescale_factor)``.
4. ``do_normalize``: ``(x - mean) / std`` in float32.
5. Patchify: the ``[C, H, W]`` image becomes ``[gh/m, m, P, gw/m, m, P]`` blocks (``m = merge_size``), ordered
   ``(gh/m, gw/m, m, m, C, T, P, P)`` with the still image repeated over ``T = temporal_patch_size``, and flattened to
   ``[gh * gw, C * T * P * P]``, so the ``m x m`` patches that the merger fuses into one token are adjacent rows.

Images are concatenated in order; ``image_grid_thw`` row ``i`` is ``(1, gh_i, gw_i)`` with ``gh = H // P``.
Worked example (defaults, P=16, m=2): a 100 x 61 image resizes to 96 x 64, grid (1, 6, 4), 24 patch rows of
3*2*16*16 = 1536 values, 6 visual tokens.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch

from engine.errors import CheckpointError, InvalidRequestError, UnsupportedModelError
# one definition of the compositing rule and of where a checkpoint keeps its processor config
from engine.image_processor import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    _convert_rgb,
    _read_processor_json,
    check_pixel_steps,
    lookup_pixels,
    pixel_table,
)

MAX_ASPECT_RATIO = 200  # smart_resize rejects images whose long side is more than this many times the short side
_SUPPORTED_TYPE_PREFIX = "Qwen2VLImageProcessor"  # ...Fast / ...Pil: Qwen3-VL checkpoints name the Qwen2-VL class


class ImageSizeError(InvalidRequestError):
    """An image is empty, too elongated for the Qwen-VL resize, or (without resizing) not a multiple of the factor."""

    code = "image_size"


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """``(height, width)`` the reference resizes an image of ``height x width`` to (its ``smart_resize``).

    Raises :class:`ImageSizeError` for an empty image or an aspect ratio over :data:`MAX_ASPECT_RATIO`. Images smaller
    than ``factor`` are not rejected: like the reference, they are scaled up to at least ``min_pixels``.
    """
    if height <= 0 or width <= 0:
        raise ImageSizeError(f"image is empty ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageSizeError(f"image {width}x{height} has an aspect ratio over {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenVLImageProcessor:
    """Turns PIL images into the ``(pixel_values, image_grid_thw)`` a Qwen-VL vision tower takes.

    Field names and meaning follow ``preprocessor_config.json``; ``min_pixels`` / ``max_pixels`` are the reference's
    ``size["shortest_edge"]`` / ``size["longest_edge"]`` (areas, not edges). Defaults are the reference class's,
    except ``patch_size`` (16, Qwen3-VL's; the reference class defaults to Qwen2-VL's 14). Raises
    :class:`CheckpointError` when a value is invalid.
    """

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    do_resize: bool = True
    resample: int = int(PIL.Image.Resampling.BICUBIC)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        ints = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels")
        if not all(isinstance(getattr(self, k), int) and getattr(self, k) > 0 for k in ints):
            raise CheckpointError(f"{', '.join(ints)} must be positive ints, got {[getattr(self, k) for k in ints]}")
        if self.min_pixels > self.max_pixels:
            raise CheckpointError(f"min_pixels {self.min_pixels} is above max_pixels {self.max_pixels}")
        check_pixel_steps(self.resample, self.rescale_factor, self.image_mean, self.image_std)
        # not a field: the per-channel lookup of steps 4-5 (from_uint8), made once
        object.__setattr__(self, "_table", pixel_table(self.do_rescale, self.rescale_factor, self.do_normalize,
                                                       self.image_mean, self.image_std))

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> QwenVLImageProcessor:
        """Load ``preprocessor_config.json`` (or the ``image_processor`` entry of ``processor_config.json``).

        Without either file, the defaults. Raises :class:`CheckpointError` for a malformed file or one that configures
        only a video processor, and :class:`UnsupportedModelError` for another image processor type.
        """
        raw = _read_processor_json(Path(model_dir))
        if raw is None:
            return cls()
        type_name = str(raw.get("image_processor_type") or "")
        if not type_name and raw.get("video_processor_type"):
            raise CheckpointError(f"{model_dir}: processor config is for video ({raw['video_processor_type']!r}) only")
        if type_name and not type_name.startswith(_SUPPORTED_TYPE_PREFIX):
            raise UnsupportedModelError(f"unsupported image processor type {type_name!r} for a Qwen-VL model")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QwenVLImageProcessor:
        """Read a saved processor config; unknown keys are ignored and ``None`` means default, as in the reference.

        Area bounds come from ``size: {shortest_edge, longest_edge}`` (transformers 5) and/or the older top-level
        ``min_pixels`` / ``max_pixels``, which win when both are given (the reference's ``__init__`` rule).
        """
        names = {f.name for f in fields(cls)} - {"min_pixels", "max_pixels"}
        values = {k: d[k] for k in names if d.get(k) is not None}
        size = d.get("size")
        if size is not None and not isinstance(size, dict):
            raise CheckpointError(f"Qwen-VL image size must be {{shortest_edge, longest_edge}}, got {size!r}")
        bounds = dict(size) if size is not None else {"shortest_edge": cls.min_pixels, "longest_edge": cls.max_pixels}
        bounds |= {edge: d[key] for edge, key in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels"))
                   if d.get(key) is not None}
        if not bounds.get("shortest_edge") or not bounds.get("longest_edge"):
            raise CheckpointError(f"Qwen-VL image size needs both shortest_edge and longest_edge, got {bounds}")
        try:
            values["min_pixels"], values["max_pixels"] = int(bounds["shortest_edge"]), int(bounds["longest_edge"])
            for key in ("image_mean", "image_std"):
                if key in values:
                    v = values[key]
                    values[key] = (float(v),) * 3 if isinstance(v, (int, float)) else tuple(float(x) for x in v)
            for key in ("patch_size", "temporal_patch_size", "merge_size", "resample"):
                if key in values:
                    values[key] = int(values[key])
            if "rescale_factor" in values:
                values["rescale_factor"] = float(values["rescale_factor"])
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"malformed Qwen-VL image processor config: {err}") from None
        return cls(**values)

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: ``patch_size * merge_size``."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per ``pixel_values`` row: ``3 * temporal_patch_size * patch_size ** 2``."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """``(height, width)`` an image of this size is processed at; raises :class:`ImageSizeError`."""
        if self.do_resize:
            return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        if height <= 0 or width <= 0 or height % self.factor or width % self.factor:
            raise ImageSizeError(f"image {width}x{height} is not a non-empty multiple of {self.factor} and "
                                 "do_resize is off")
        return height, width

    def grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        """``(t, h, w)`` patch grid of a still image of ``height x width`` (t = 1), without touching pixels."""
        return self._grid(self.resized_size(height, width))

    def num_visual_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens the image takes in the prompt: ``t * h * w // merge_size ** 2``."""
        t, h, w = self.grid_thw(height, width)
        return t * h * w // self.merge_size**2

    def __call__(self, images: list[PIL.Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """Preprocess ``images`` into ``(pixel_values, image_grid_thw)``.

        ``pixel_values`` is float32 ``[sum of t*h*w, patch_dim]``, the images' patches concatenated in order;
        ``image_grid_thw`` is int64 ``[len(images), 3]``. Any PIL mode is accepted when ``do_convert_rgb`` is set,
        otherwise images must be RGB (:class:`InvalidRequestError`); bad sizes raise :class:`ImageSizeError`.
        """
        resized = self.resize(images)  # every size checked before pixel work
        grids = [self._grid(a.shape[:2]) for a in resized]
        return self.from_uint8(resized), torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)

    def resize(self, images: list[PIL.Image.Image]) -> list[np.ndarray]:
        """Steps 1-3 on each image: ``[H, W, 3]`` uint8 at its :meth:`resized_size`."""
        sizes = [self.resized_size(image.height, image.width) for image in images]
        return [self._to_uint8(image, size) for image, size in zip(images, sizes)]

    def resized_shapes(self, n: int, grid_thw: Any = None) -> list[tuple[int, int]]:
        """``(H, W)`` of each resized image, from its patch grid."""
        grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        if len(grid) != n:
            raise InvalidRequestError(f"{len(grid)} image grid(s) for {n} image(s)")
        return [(int(h) * self.patch_size, int(w) * self.patch_size) for _, h, w in grid]

    def from_uint8(self, arrays: list[np.ndarray]) -> torch.Tensor:
        """Steps 4-5 on resized images (:meth:`resize`): float32 patches ``[sum t*h*w, patch_dim]``."""
        patches = [self._patchify(lookup_pixels(self._table, a)) for a in arrays]
        return torch.from_numpy(np.concatenate(patches) if patches else np.zeros((0, self.patch_dim), np.float32))

    def _grid(self, resized: tuple[int, int]) -> tuple[int, int, int]:
        return 1, resized[0] // self.patch_size, resized[1] // self.patch_size

    def _to_uint8(self, image: PIL.Image.Image, size: tuple[int, int]) -> np.ndarray:
        """Steps 1-3 on one image: ``[H, W, 3]`` uint8 at ``size`` (height, width)."""
        if self.do_convert_rgb:
            image = _convert_rgb(image)
        elif image.mode != "RGB":
            raise InvalidRequestError(f"image mode {image.mode!r} is not RGB and do_convert_rgb is off")
        if self.do_resize:
            image = image.resize((size[1], size[0]), resample=self.resample)
        return np.asarray(image)

    def _patchify(self, x: np.ndarray) -> np.ndarray:
        """Step 5: ``[H, W, C]`` to ``[gh * gw, C * T * P * P]`` rows in the reference's order."""
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        height, width, channels = x.shape
        gh, gw = height // p, width // p
        blocks = x.reshape(gh // m, m, p, gw // m, m, p, channels).transpose(0, 3, 1, 4, 6, 2, 5)
        # (gh/m, gw/m, m, m, C, P, P) -> repeat the still frame over T after C
        blocks = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
        return blocks.reshape(gh * gw, channels * t * p * p)
