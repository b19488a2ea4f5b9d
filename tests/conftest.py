"""Shared fixtures and helpers for the whole test tree.

Fixtures:

* ``tiny_ckpt(spec=None, **overrides) -> Path`` (session): writes the tiny random-weight checkpoint of
  ``dataclasses.replace(spec or TinySpec(), **overrides)`` once per session and returns its directory. Treat the
  directory as read-only (copy it with ``shutil.copytree`` before editing files).
* ``tiny_model_dir`` (session): ``tiny_ckpt()`` — the default spec (SigLIP + Qwen3-MoE, vocab 256,
  ``tokens_per_image(DEFAULT_SPEC) == 3``, ids: ``<image>`` 255, ``</s>`` 254, ``<s>`` 253, ``<pad>`` 252).
* ``make_llm(model_dir=None, **llm_kwargs) -> LLM`` (function): an ``LLM`` with small test defaults
  (:data:`LLM_DEFAULTS`); at teardown every engine it made must hold no request and no KV block.

Helpers (plain functions, ``from tests.conftest import ...``): :func:`make_request`, :func:`make_image`,
:func:`greedy`, :func:`assert_no_leaked_blocks`, :func:`tokens_per_image`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from engine import LLM, LLMEngine, SamplingParams
from duet_testing.checkpoints import TinySpec, image_tokens_per_image, make_tiny_checkpoint

# Every process of the suite (Ray workers included) measures its kernel choices afresh: tests that check a choice is
# measured at load stay meaningful, and nothing is written to the user's cache (tests of the cache set their own).
os.environ.setdefault("DUET_TUNING_CACHE", "off")

# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine torch's thread pool spinning against
# other processes makes each step many times slower; one thread keeps the suite fast and its timing stable.
torch.set_num_threads(1)

DEFAULT_SPEC = TinySpec()
LLM_DEFAULTS = dict(dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128)


def tokens_per_image(spec: TinySpec = DEFAULT_SPEC) -> int:
    return image_tokens_per_image(spec)


def make_image(seed: int = 0, size: tuple[int, int] = (33, 47)) -> PIL.Image.Image:
    """A random RGB image (``size`` = (height, width)); the same seed gives the same pixels."""
    rng = np.random.default_rng(seed)
    return PIL.Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def make_request(num_text_tokens: int = 8, *, seed: int = 0, images: list[PIL.Image.Image] | None = None,
                 image_at: int = 1, spec: TinySpec = DEFAULT_SPEC) -> dict:
    """A prompt dict ``{"prompt_token_ids": [<s>, text..., <image> x n per image, text...], ...}``.

    Text ids are random (from ``seed``) below the special ids. All images' placeholders are inserted together
    before text position ``image_at`` (counting ``<s>``), and ``multi_modal_data`` is set only when images are given.
    """
    rng = np.random.default_rng(seed)
    specials = spec.special_token_ids
    text = [specials["<s>"], *rng.integers(0, spec.vocab_size - len(specials), num_text_tokens).tolist()]
    images = list(images or [])
    ids = text[:image_at] + [spec.image_token_id] * (image_tokens_per_image(spec) * len(images)) + text[image_at:]
    prompt: dict = {"prompt_token_ids": ids}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    return prompt


def greedy(max_tokens: int = 8, **kwargs) -> SamplingParams:
    """Greedy params that run to ``max_tokens`` (EOS ignored) unless overridden."""
    return SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **kwargs})


def assert_no_leaked_blocks(engine: LLMEngine | LLM) -> None:
    """The engine is idle: no queued or running sequence, no live request, every KV block unreferenced."""
    if isinstance(engine, LLM):
        engine = engine.engine
    assert not engine.scheduler.waiting, f"waiting: {[s.request_id for s in engine.scheduler.waiting]}"
    assert not engine.scheduler.running, f"running: {[s.request_id for s in engine.scheduler.running]}"
    assert not engine.requests, f"live requests: {list(engine.requests)}"
    engine.block_manager.check_no_leaks()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[TinySpec, Path] = {}

    def make(spec: TinySpec | None = None, **overrides) -> Path:
        spec = dataclasses.replace(spec or DEFAULT_SPEC, **overrides)
        if spec not in cache:
            cache[spec] = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ckpt") / "ckpt", spec)
        return cache[spec]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_ckpt: Callable[..., Path]) -> Path:
    return tiny_ckpt()


@pytest.fixture
def make_llm(tiny_model_dir: Path) -> Iterator[Callable[..., LLM]]:
    made: list[LLM] = []

    def make(model_dir: str | Path | None = None, **kwargs) -> LLM:
        llm = LLM(model_dir or tiny_model_dir, **{**LLM_DEFAULTS, **kwargs})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert_no_leaked_blocks(llm)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One local Ray cluster for the whole test session (started only by tests that ask for it)."""
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_qwen_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``tiny_qwen_ckpt(**overrides) -> Path`` (session): the tiny random-weight Qwen3-VL(-MoE) checkpoint of
    ``QwenTinySpec(**overrides)`` (default: 3 MoE text layers, 8 experts top-2, patch 16, merge 2, "hf" layout),
    written once per session. Treat the directory as read-only."""
    from duet_testing.qwen_checkpoints import QwenTinySpec, make_tiny_qwen_checkpoint

    cache: dict[QwenTinySpec, Path] = {}

    def make(**overrides) -> Path:
        spec = QwenTinySpec(**overrides)
        if spec not in cache:
            cache[spec] = make_tiny_qwen_checkpoint(tmp_path_factory.mktemp("tiny-qwen") / "ckpt", spec)
        return cache[spec]

    return make
