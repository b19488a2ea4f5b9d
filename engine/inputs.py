"""Turn user prompts into validated token sequences with their images.

A prompt is a string (tokenized; each ``<image>`` expands to the image's placeholder tokens) or a dict with
``"prompt"`` or ``"prompt_token_ids"`` (ids exactly as transformers' ``LlavaForConditionalGeneration`` takes them,
placeholders already expanded) and optional ``"multi_modal_data": {"image": Image | list[Image]}``. Every problem
raises a typed :class:`~engine.errors.InvalidRequestError` subclass before anything is admitted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image

from engine.config import ModelConfig
from engine.errors import ImageTokenMismatchError, InvalidRequestError, PromptTooLongError, TokenOutOfVocabError
from engine.image_processor import ImageProcessor, image_content_hash, load_image
from engine.sequence import MultiModalInput
from engine.tokenizer import Tokenizer

IMAGE_TOKEN = "<image>"
_IMAGE_SOURCES = (PIL.Image.Image, bytes, bytearray, memoryview, str, os.PathLike)


@dataclass
class ProcessedPrompt:
    prompt: str | None
    token_ids: list[int]
    mm: MultiModalInput | None


class InputProcessor:
    def __init__(self, cfg: ModelConfig, tokenizer: Tokenizer | None, image_processor: ImageProcessor | None,
                 max_model_len: int) -> None:
        self.cfg, self.tokenizer, self.image_processor = cfg, tokenizer, image_processor
        self.max_model_len = max_model_len

    def process(self, prompt: Any) -> ProcessedPrompt:
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if not isinstance(prompt, dict):
            raise InvalidRequestError(f"a prompt must be a str or a dict, got {type(prompt).__name__}")
        images = self._images(prompt.get("multi_modal_data") or {})
        text = prompt.get("prompt")
        if "prompt_token_ids" in prompt:
            ids = self._check_ids(prompt["prompt_token_ids"])
        elif isinstance(text, str):
            ids = self._tokenize(text, len(images))
        else:
            raise InvalidRequestError("a prompt dict needs 'prompt' (str) or 'prompt_token_ids' (list of int)")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the context holds {self.max_model_len} (prompt plus generated tokens)")
        return ProcessedPrompt(text if isinstance(text, str) else None, ids, self._mm(ids, images))

    def _images(self, mm_data: dict) -> list:
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

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, list | tuple) or not all(isinstance(t, int | np.integer) for t in ids):
            raise InvalidRequestError("prompt_token_ids must be a list of int")
        ids = [int(t) for t in ids]
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
        return MultiModalInput(pixel_values=lambda: processor(images),
                               image_hashes=[image_content_hash(im) for im in images],
                               positions=positions.astype(np.int64), tokens_per_image=tpi)
