"""Turn user prompts into validated token sequences with their images.

A prompt is a string (tokenized; each ``<image>`` expands to the image's placeholder tokens) or a dict with
``"prompt"`` or ``"prompt_token_ids"`` (ids exactly as transformers' ``LlavaForConditionalGeneration`` /
``Qwen3VLMoeForConditionalGeneration`` take them, placeholders already expanded) and optional
``"multi_modal_data": {"image": Image | list[Image]}``. Every problem raises a typed
:class:`~engine.errors.InvalidRequestError` subclass before anything is admitted.

Qwen3-VL checkpoints: a prompt's text may name an image as ``<image>`` (written as
``<|vision_start|><|image_pad|><|vision_end|>``) or with the checkpoint's own markers; each ``<|image_pad|>`` becomes
that image's visual-token count (its grid / merge², as transformers' processor expands it). With token ids, every
run of ``<|image_pad|>`` ids must hold exactly one image's count, in order. Grids come from the images' sizes alone,
so validation and M-RoPE positions never touch pixels.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch

from engine.config import ModelConfig, model_family
from engine.errors import (
    ImageTokenMismatchError,
    InvalidRequestError,
    PromptTooLongError,
    TokenOutOfVocabError,
    UnsupportedInputError,
)
from engine.image_processor import DeferredPixels, ImageProcessor, image_content_hash, load_image
from engine.models.qwen3_vl.image_processor import QwenVLImageProcessor
from engine.mrope import rope_index
from engine.sequence import MultiModalInput
from engine.tokenizer import Tokenizer

IMAGE_TOKEN = "<image>"
QWEN_IMAGE_PAD, QWEN_VISION = "<|image_pad|>", "<|vision_start|><|image_pad|><|vision_end|>"
_IMAGE_SOURCES = (PIL.Image.Image, bytes, bytearray, memoryview, str, os.PathLike)


@dataclass
class ProcessedPrompt:
    """A validated prompt: its token ids (placeholders expanded) and images (:class:`MultiModalInput`). The engine
    takes one as it is (``LLMEngine.add_request`` / ``preallocate``, checked by :meth:`InputProcessor.check_processed`),
    so a prompt processed once elsewhere is neither re-tokenized nor its images re-decoded."""

    prompt: str | None
    token_ids: list[int]
    mm: MultiModalInput | None

    @property
    def num_visual_tokens(self) -> int:
        return 0 if self.mm is None else len(self.mm.positions)


def image_processor_for(model_dir: str | os.PathLike, cfg: ModelConfig) -> ImageProcessor | QwenVLImageProcessor | None:
    """The image processor of a checkpoint (None for a text-only model), as its model family makes it."""
    if cfg.vision is None:
        return None
    return model_family(cfg.model_type).image_processor(Path(model_dir), cfg)


class InputProcessor:
    def __init__(self, cfg: ModelConfig, tokenizer: Tokenizer | None,
                 image_processor: ImageProcessor | QwenVLImageProcessor | None, max_model_len: int,
                 kv_bytes_per_token: int | None = None) -> None:
        """``kv_bytes_per_token`` (an engine's): a prompt over the context is refused naming its KV bytes too."""
        self.cfg, self.tokenizer, self.image_processor = cfg, tokenizer, image_processor
        self.max_model_len = max_model_len
        self.kv_bytes_per_token = kv_bytes_per_token

    def _too_long(self, n: int) -> PromptTooLongError:
        msg = f"prompt has {n} tokens; the context holds {self.max_model_len} (prompt plus generated tokens)"
        b = self.kv_bytes_per_token
        if b:
            msg += (f": its KV would take {n * b / 2**20:.1f} MiB ({b} bytes a token), this worker holds "
                    f"{self.max_model_len * b / 2**20:.1f} MiB for one sequence")
        return PromptTooLongError(msg)

    def process(self, prompt: Any) -> ProcessedPrompt:
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if not isinstance(prompt, dict):
            raise InvalidRequestError(f"a prompt must be a str or a dict, got {type(prompt).__name__}")
        images = self._images(prompt.get("multi_modal_data") or {})
        counts = self._visual_token_counts(images)
        text = prompt.get("prompt")
        if "prompt_token_ids" in prompt:
            ids = self._check_ids(prompt["prompt_token_ids"])
        elif isinstance(text, str):
            ids = self._tokenize(text, len(images)) if counts is None else self._tokenize_qwen(text, counts)
        else:
            raise InvalidRequestError("a prompt dict needs 'prompt' (str) or 'prompt_token_ids' (list of int)")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise self._too_long(len(ids))
        mm = self._mm(ids, images) if counts is None else self._mm_qwen(ids, images, counts)
        return ProcessedPrompt(text if isinstance(text, str) else None, ids, mm)

    def check_processed(self, p: ProcessedPrompt) -> ProcessedPrompt:
        """Check a prompt processed elsewhere against this engine (context length, vocabulary, placeholders vs the
        images' positions, counts and grids, pixel shapes); O(prompt length), no tokenizing, no pixel work. Raises
        the same typed :class:`InvalidRequestError` subclasses as :meth:`process`."""
        ids = self._check_ids(p.token_ids)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise self._too_long(len(ids))
        is_img = np.asarray(ids, dtype=np.int64) == self.cfg.image_token_index
        mm = p.mm
        if mm is None:
            if self.cfg.vision is not None and is_img.any():
                raise ImageTokenMismatchError(f"prompt has {int(is_img.sum())} image tokens but no images")
            return ProcessedPrompt(p.prompt, ids, None)
        if self.cfg.vision is None:
            raise InvalidRequestError("this model has no vision tower; it cannot take images")
        counts = list(mm.token_counts or [])
        if (len(counts) != len(mm.image_hashes) or not np.array_equal(mm.positions, np.flatnonzero(is_img))
                or sum(counts) != len(mm.positions)):
            raise ImageTokenMismatchError(f"the prompt's {int(is_img.sum())} image tokens do not match its "
                                          f"{len(mm.image_hashes)} image(s) of {counts} tokens")
        if self.cfg.is_qwen_vl:
            self._check_qwen_mm(mm, counts, len(ids))
        elif counts != [self.cfg.tokens_per_image] * len(counts):
            raise ImageTokenMismatchError(f"images of {counts} tokens; this model takes {self.cfg.tokens_per_image} each")
        pixels = mm.pixel_values
        if isinstance(pixels, torch.Tensor):
            rows = len(counts) if mm.grid_thw is None else int(mm.grid_thw.prod(axis=1).sum())
            if pixels.shape[0] != rows:
                raise InvalidRequestError(f"pixel values hold {pixels.shape[0]} rows for images that need {rows}")
        return ProcessedPrompt(p.prompt, ids, mm)

    def _check_qwen_mm(self, mm: MultiModalInput, counts: list[int], n: int) -> None:
        processor = self.image_processor
        assert isinstance(processor, QwenVLImageProcessor)
        grid = None if mm.grid_thw is None else np.asarray(mm.grid_thw)
        if grid is None or grid.shape != (len(counts), 3) or (grid.prod(axis=1) // processor.merge_size**2).tolist() != counts:
            raise ImageTokenMismatchError(f"image grids {None if grid is None else grid.tolist()} do not give the "
                                          f"prompt's {counts} visual tokens")
        if mm.mrope is not None and tuple(mm.mrope.shape) != (3, n):
            raise InvalidRequestError(f"M-RoPE positions of shape {tuple(mm.mrope.shape)} for a {n}-token prompt")
        if mm.mrope is None and mm.pixel_values is not None:
            raise InvalidRequestError("a prompt with pixels to encode needs its M-RoPE positions")

    def _images(self, mm_data: dict) -> list:
        if isinstance(mm_data, dict) and "video" in mm_data:
            raise UnsupportedInputError("video inputs are not supported yet (images only)")
        if not isinstance(mm_data, dict) or set(mm_data) - {"image"}:
            raise InvalidRequestError("multi_modal_data supports only the key 'image'")
        raw = mm_data.get("image")
        items = [] if raw is None else raw if isinstance(raw, list | tuple) else [raw]
        if items and self.cfg.vision is None:
            raise InvalidRequestError("this model has no vision tower; it cannot take images")
        bad = [type(x).__name__ for x in items if not isinstance(x, _IMAGE_SOURCES)]
        if bad:  # load_image would raise a bare TypeError
            raise InvalidRequestError(f"an image must be a PIL image, bytes or a file path, got {bad[0]}")
        return [load_image(x) for x in items]

    def _visual_token_counts(self, images: list) -> list[int] | None:
        """Qwen3-VL: each image's visual-token count from its size (no pixel work); None for LLaVA."""
        if not self.cfg.is_qwen_vl:
            return None
        assert isinstance(self.image_processor, QwenVLImageProcessor)
        return [self.image_processor.num_visual_tokens(im.height, im.width) for im in images]

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, list | tuple) or not all(isinstance(t, int | np.integer) for t in ids):
            raise InvalidRequestError("prompt_token_ids must be a list of int")
        ids = [int(t) for t in ids]
        if self.cfg.video_token_id is not None and self.cfg.video_token_id in ids:
            raise UnsupportedInputError("video inputs are not supported yet (the prompt holds video placeholders)")
        vocab = self.cfg.text.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab and t != self.cfg.image_token_index]
        if bad:
            raise TokenOutOfVocabError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    def _tokenize(self, text: str, num_images: int) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this checkpoint has no tokenizer.json; pass prompt_token_ids instead")
        if self.cfg.vision is None:
            return self.tokenizer.encode(text)
        ids, found = self.tokenizer.encode_with_images(
            text, image_token=IMAGE_TOKEN, image_token_id=int(self.cfg.image_token_index),
            tokens_per_image=self.cfg.tokens_per_image)
        if found != num_images:
            raise ImageTokenMismatchError(f"prompt has {found} {IMAGE_TOKEN} placeholder(s) but {num_images} image(s) were given")
        return self._check_ids(ids)

    def _tokenize_qwen(self, text: str, counts: list[int]) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this checkpoint has no tokenizer.json; pass prompt_token_ids instead")
        if "<|video_pad|>" in text:
            raise UnsupportedInputError("video inputs are not supported yet (the prompt holds <|video_pad|>)")
        text = text.replace(IMAGE_TOKEN, QWEN_VISION)
        pad = int(self.cfg.image_token_index)
        encoded = self.tokenizer.encode(text)
        found = encoded.count(pad)
        if found != len(counts):
            raise ImageTokenMismatchError(
                f"prompt has {found} image placeholder(s) ({IMAGE_TOKEN} or {QWEN_IMAGE_PAD}) but {len(counts)} "
                f"image(s) were given")
        ids: list[int] = []
        it = iter(counts)
        for t in encoded:
            ids.extend([pad] * next(it) if t == pad else (t,))
        return self._check_ids(ids)

    def _mm_qwen(self, ids: list[int], images: list, counts: list[int]) -> MultiModalInput | None:
        arr = np.asarray(ids, dtype=np.int64)
        is_img = arr == self.cfg.image_token_index
        positions = np.flatnonzero(is_img)
        starts = np.flatnonzero(is_img & ~np.r_[False, is_img[:-1]])
        ends = np.flatnonzero(is_img & ~np.r_[is_img[1:], False]) + 1
        runs = (ends - starts).tolist()
        if runs != counts:
            raise ImageTokenMismatchError(
                f"the prompt's image placeholder runs hold {runs} tokens but the image(s) need {counts} "
                "(one run per image, in order, each its grid / merge^2)")
        if not images:
            return None
        processor = self.image_processor
        assert isinstance(processor, QwenVLImageProcessor)
        grids = np.asarray([processor.grid_thw(im.height, im.width) for im in images], dtype=np.int64)
        mrope, delta = rope_index(arr, int(self.cfg.image_token_index), grids, processor.merge_size)
        # deferred like LLaVA's: only a worker that runs the vision tower resizes and patches the images
        return MultiModalInput(pixel_values=DeferredPixels(processor, images),
                               image_hashes=[image_content_hash(im) for im in images],
                               positions=positions.astype(np.int64), tokens_per_image=0, token_counts=counts,
                               grid_thw=grids, mrope=mrope, mrope_delta=delta)

    def _mm(self, ids: list[int], images: list) -> MultiModalInput | None:
        if self.cfg.vision is None:
            return None
        positions = np.flatnonzero(np.asarray(ids, dtype=np.int64) == self.cfg.image_token_index)
        tpi = self.cfg.tokens_per_image
        if len(positions) != len(images) * tpi:
            raise ImageTokenMismatchError(
                f"prompt has {len(positions)} image tokens but {len(images)} image(s) need {len(images) * tpi} "
                f"({tpi} each)")
        if not images:
            return None
        assert self.image_processor is not None
        processor = self.image_processor
        # deferred: the vision tower is the only reader, and a decode worker (KV from a prefill worker) never runs it
        return MultiModalInput(pixel_values=DeferredPixels(processor, images),
                               image_hashes=[image_content_hash(im) for im in images],
                               positions=positions.astype(np.int64), tokens_per_image=tpi)
