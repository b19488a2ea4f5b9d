"""The engine takes a prompt processed elsewhere (``LLMEngine.add_request`` / ``preallocate`` with a
:class:`ProcessedPrompt`): it is checked (:meth:`InputProcessor.check_processed`), never re-tokenized nor its images
re-decoded, and generates what the raw prompt does. A prompt without pixels can be preallocated but not computed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine import LLMEngine
from engine.config import EngineConfig
from engine.errors import ImageTokenMismatchError, InvalidRequestError, PromptTooLongError, TokenOutOfVocabError
from engine.inputs import InputProcessor, ProcessedPrompt
from tests.conftest import LLM_DEFAULTS, assert_no_leaked_blocks, greedy, make_image, make_request


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine(tiny_model_dir, EngineConfig(**LLM_DEFAULTS))


def run(engine: LLMEngine, prompts: list) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(6))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert_no_leaked_blocks(engine)
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_processed_prompt_generates_what_the_raw_prompt_does_without_tokenizing_or_decoding(engine, monkeypatch):
    raw = [make_request(6, seed=1, images=[make_image(1)]), make_request(5, seed=2)]
    want = run(engine, raw)
    processed = [engine.inputs.process(p) for p in raw]
    processed[0].mm.pixels()  # the front-end's one pass evaluates them
    engine.runner.vision_cache.clear()

    def forbidden(*a, **k):
        raise AssertionError("the engine re-processed a processed prompt")

    monkeypatch.setattr(InputProcessor, "process", forbidden)
    monkeypatch.setattr("engine.inputs.load_image", forbidden)
    monkeypatch.setattr(type(engine.image_processor), "__call__", forbidden)
    assert run(engine, processed) == want


def test_check_processed_rejects_what_process_would(engine):
    good = engine.inputs.process(make_request(6, seed=3, images=[make_image(3)]))
    long = ProcessedPrompt(None, [1] * engine.max_model_len, None)
    oov = ProcessedPrompt(None, [1, 10_000], None)
    no_images = ProcessedPrompt(None, good.token_ids, None)
    moved = dataclasses.replace(good.mm, positions=good.mm.positions + 1)
    rows = dataclasses.replace(good.mm, pixel_values=torch.zeros(2, 3, 28, 28))
    for bad, err in [(long, PromptTooLongError), (oov, TokenOutOfVocabError), (no_images, ImageTokenMismatchError),
                     (ProcessedPrompt(None, good.token_ids, moved), ImageTokenMismatchError),
                     (ProcessedPrompt(None, good.token_ids, rows), InvalidRequestError)]:
        with pytest.raises(err):
            engine.add_request("bad", bad, greedy(2))
        assert not engine.requests
    assert_no_leaked_blocks(engine)


def test_a_prompt_without_pixels_is_preallocated_but_never_computed(engine):
    p = engine.inputs.process(make_request(6, seed=4, images=[make_image(4)]))
    bare = ProcessedPrompt(None, p.token_ids, dataclasses.replace(p.mm, pixel_values=None))
    assert not bare.mm.can_encode
    with pytest.raises(InvalidRequestError, match="no pixels"):
        engine.add_request("bare", bare, greedy(2))
    blocks = engine.preallocate("bare", bare, greedy(2))
    seq = engine.receiving["bare"]
    local = engine._new_sequence("ref", make_request(6, seed=4, images=[make_image(4)]), greedy(2))
    full = len(p.token_ids) // engine.config.block_size
    assert len(blocks) >= full and [seq.block_hash(i) for i in range(full)] == [local.block_hash(i) for i in range(full)]
    assert engine.release_prefill("bare")
    assert_no_leaked_blocks(engine)
    with pytest.raises(RuntimeError, match="no pixels"):
        bare.mm.pixels()
    assert np.array_equal(bare.mm.positions, p.mm.positions)
