"""Request limits of the serving front-end: image checks before decoding, token budgets, and admission.

All pure or tiny: :func:`check_image` / :func:`image_size` read only an image's header (a decompression bomb is
refused before a pixel is decoded), :func:`check_visual_tokens` counts a request's visual tokens from those sizes
(before any pixel work), :func:`resolve_max_tokens` is arithmetic on the context, :class:`Admission` counts requests
in flight and says how long a refused client should wait.
"""

from __future__ import annotations

import io
import re
import time
from collections import deque
from dataclasses import dataclass

import PIL.Image

from engine.config import ModelConfig
from engine.errors import DuetError, ImageDecodeError, InvalidRequestError
from engine.image_processor import ImageProcessor
from engine.models.qwen3_vl.image_processor import QwenVLImageProcessor


class VisualTokenLimitError(InvalidRequestError):
    """A request's images need more visual tokens than ``limits.max_visual_tokens``."""


class Overloaded(DuetError):
    """Over the concurrency cap (or out of KV space): try again after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Limits:
    """Caps on what one request may ask for (``None``: derived from the model's context when the server starts)."""

    max_concurrent: int = 64  # requests in flight; more get RESOURCE_EXHAUSTED / 429
    max_message_bytes: int = 32 * 1024 * 1024  # one gRPC message or HTTP body
    max_image_bytes: int = 8 * 1024 * 1024  # one encoded image
    max_image_pixels: int = 4096 * 4096  # width * height, read from the header before decoding
    max_images: int = 8  # per request
    max_visual_tokens: int = 16384  # per request, all images together (counted from their sizes before decoding)
    max_prompt_tokens: int | None = None  # default: the context length minus one
    max_tokens: int | None = None  # cap on max_tokens; default: the context length

    def __post_init__(self) -> None:
        for name in ("max_concurrent", "max_message_bytes", "max_image_bytes", "max_image_pixels", "max_images",
                     "max_visual_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InvalidRequestError(f"limits.{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("max_prompt_tokens", "max_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise InvalidRequestError(f"limits.{name} must be a positive integer or null, got {v!r}")


def check_image(data: bytes, mime_type: str, limits: Limits, index: int = 0) -> bytes:
    """``data`` if it is an image within the caps (:func:`image_size`)."""
    image_size(data, mime_type, limits, index)
    return data


def image_size(data: bytes, mime_type: str, limits: Limits, index: int = 0) -> tuple[int, int]:
    """``(width, height)`` of an image within the byte and pixel caps; reads the header only. Raises
    :class:`ImageDecodeError` naming the image (``index``) and the problem."""
    where = f"image {index}"
    if mime_type and not mime_type.lower().startswith("image/"):
        raise ImageDecodeError(f"{where}: MIME type {mime_type!r} is not an image type")
    if not data:
        raise ImageDecodeError(f"{where}: no image data")
    if len(data) > limits.max_image_bytes:
        raise ImageDecodeError(f"{where}: {len(data)} bytes is over the limit of {limits.max_image_bytes} bytes")
    try:
        with PIL.Image.open(io.BytesIO(data)) as im:  # lazy: parses the header, decodes nothing
            width, height = im.size
    except PIL.Image.DecompressionBombError as e:  # PIL's own, far higher cap tripped while opening
        m = re.search(r"\((\d+) pixels\)", str(e))
        size = f"{m.group(1)} pixels" if m else "the image"
        raise ImageDecodeError(f"{where}: {size} is over the limit of {limits.max_image_pixels} pixels") from None
    except (PIL.UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise ImageDecodeError(f"{where}: data is not a recognised image format") from None
    if width * height > limits.max_image_pixels:
        raise ImageDecodeError(f"{where}: {width}x{height} = {width * height} pixels is over the limit of "
                               f"{limits.max_image_pixels} pixels")
    return width, height


def visual_token_counts(cfg: ModelConfig, processor: ImageProcessor | QwenVLImageProcessor | None,
                        sizes: list[tuple[int, int]]) -> list[int]:
    """Prompt tokens each image of ``(width, height)`` takes: LLaVA's fixed count, or a Qwen-VL image's grid /
    merge² (from its size alone; an unusable size raises :class:`~engine.models.qwen3_vl.image_processor.ImageSizeError`)."""
    if cfg.vision is None:  # a text-only model takes no images (the engine says so)
        return [0] * len(sizes)
    if cfg.is_qwen_vl:
        assert isinstance(processor, QwenVLImageProcessor)
        return [processor.num_visual_tokens(h, w) for w, h in sizes]
    return [cfg.tokens_per_image] * len(sizes)


def check_visual_tokens(counts: list[int], limit: int) -> None:
    """Raises :class:`VisualTokenLimitError` when the images' visual tokens together exceed ``limit``: two Qwen-VL
    images of 6 and 20 tokens pass ``limit=26`` and are refused at ``limit=25`` ("the images need 26 visual tokens
    ([6, 20]); max_visual_tokens is 25")."""
    if sum(counts) > limit:
        raise VisualTokenLimitError(f"the images need {sum(counts)} visual tokens ({counts}); max_visual_tokens "
                                    f"is {limit}")


def resolve_max_tokens(requested: int | None, default: int, prompt_tokens: int, max_model_len: int,
                       cap: int) -> int:
    """The request's ``max_tokens``: the default (clipped to what the context has left) when unset; an explicit
    value must be in ``[1, cap]`` and fit the context with the prompt.

    >>> resolve_max_tokens(None, 48, prompt_tokens=1000, max_model_len=1024, cap=1024)
    24
    """
    room = max_model_len - prompt_tokens
    if requested is None:
        return max(1, min(default, room, cap))
    if requested < 1:
        raise InvalidRequestError(f"max_tokens must be at least 1, got {requested}")
    if requested > cap:
        raise InvalidRequestError(f"max_tokens {requested} is over this server's limit of {cap}")
    if requested > room:
        raise InvalidRequestError(f"max_tokens {requested} does not fit the context: the prompt has {prompt_tokens} "
                                  f"tokens and the context holds {max_model_len} (at most {room} more)")
    return requested


def retry_after_s(finish_times: list[float] | deque[float], now: float, floor: float = 0.1,
                  ceiling: float = 30.0) -> float:
    """How long a refused client should wait: the mean gap between recent completions (a slot frees about that
    often), clipped to ``[floor, ceiling]``; 1 s with no history.

    >>> retry_after_s([10.0, 10.5, 11.0], now=11.0)
    0.5
    """
    if len(finish_times) < 2:
        return 1.0
    span = max(now, finish_times[-1]) - finish_times[0]
    return min(ceiling, max(floor, span / (len(finish_times) - 1)))


class Admission:
    """Counts requests in flight against ``limit``; over it, :meth:`enter` raises :class:`Overloaded` at once (a
    refused client retries later, it never waits in a hidden queue)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._finished: deque[float] = deque(maxlen=32)

    def enter(self) -> None:
        if self.in_flight >= self.limit:
            wait = retry_after_s(self._finished, time.monotonic())
            raise Overloaded(f"server is at its limit of {self.limit} concurrent requests; retry in {wait:.1f} s",
                             wait)
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        self._finished.append(time.monotonic())
