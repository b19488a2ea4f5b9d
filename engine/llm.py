"""Offline batch API shaped like vLLM's ``LLM``::

    from engine import LLM, SamplingParams
    llm = LLM("path/to/llava-checkpoint", dtype="float32")
    outs = llm.generate([{"prompt": "<image>What color is the triangle?", "multi_modal_data": {"image": img}}],
                        SamplingParams(temperature=0, max_tokens=16))
    outs[0].outputs[0].text
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.hooks import EngineHooks
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | Path, *, dtype: str = "auto", device: str = "cpu", max_num_seqs: int = 64,
                 num_kv_blocks: int | None = None, block_size: int = 16, max_num_batched_tokens: int = 4096,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True, seed: int = 0,
                 hooks: EngineHooks | None = None, **kwargs: Any) -> None:
        """The keyword arguments are :class:`EngineConfig` fields except ``hooks``, the engine's
        (:class:`engine.hooks.EngineHooks`), for callers that instrument it (benchmarks)."""
        cfg = EngineConfig(dtype=dtype, device=device, max_num_seqs=max_num_seqs, num_kv_blocks=num_kv_blocks,
                           block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                           max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching, seed=seed, **kwargs)
        self.engine = LLMEngine(model, cfg, hooks=hooks)
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Any, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        All prompts are validated before any is queued, so one bad prompt raises and leaves the engine idle.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if not isinstance(prompts, list | tuple):
            raise InvalidRequestError(f"prompts must be a str, a dict or a list of them, got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        for p in prompts:  # validate everything first: a bad prompt must not leave others half-run
            self.engine.inputs.process(p)
        ids = []
        try:
            for p, sp in zip(prompts, params, strict=True):
                rid = f"gen-{self._counter}"
                self._counter += 1
                self.engine.add_request(rid, p, sp)
                ids.append(rid)
            done: dict[str, RequestOutput] = {}
            bar = _progress(len(ids)) if use_tqdm else None
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
            if bar is not None:
                bar.close()
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [done[r] for r in ids]


def _progress(total: int):
    try:
        from tqdm import tqdm  # optional: not a runtime dependency
    except ImportError:
        return None

    return tqdm(total=total, desc="generate")
