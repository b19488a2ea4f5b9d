"""A prefill and a decode worker in one process, linked by the in-process transport (no Ray).

The full disaggregated data path -- prefill, per-layer export, codec, frames, checksums, receive, commit, decode --
without actors: for tests and for benchmarks that need many runs of the wire (``duet bench kv-codec``). Each prompt is
processed once, as the front-end does, and reaches each worker through its msgpack wire form
(:mod:`node_common.prompt_wire`: pixels to the prefill worker, no image data to the decode worker).
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

from decode_node.expert_tiers import TierConfig
from decode_node.worker import DecodeWorker
from engine import EngineConfig, RequestOutput, SamplingParams
from engine.inputs import InputProcessor, ProcessedPrompt
from kv_transfer import ClusterSecret
from kv_transfer.inproc.manager import Manager as InprocManager
from node_common import messages, prompt_wire
from prefill_node.worker import PrefillWorker


class PairTimeout(TimeoutError):
    """The pair did not finish its requests before the deadline."""


class LocalPair:
    def __init__(self, model_dir: str | Path, config: EngineConfig, *, compression: Any = None,
                 stream_layers: bool = True, expert_tiers: TierConfig | None = None,
                 prefill_config: EngineConfig | None = None) -> None:
        """``config``: both workers' engine settings, or the decode worker's where ``prefill_config`` is given."""
        secret = ClusterSecret.generate()  # the pair's data-plane key, as a cluster's front-end makes one
        self.prefill_manager, self.decode_manager = InprocManager(secret=secret), InprocManager(secret=secret)
        self.prefill = PrefillWorker(model_dir, prefill_config or config, stream_layers=stream_layers,
                                     compression=compression)
        self.decode = DecodeWorker(model_dir, config, self.decode_manager, compression=compression,
                                   expert_tiers=expert_tiers)
        e = self.prefill.engine
        self.inputs = InputProcessor(e.model_config, e.tokenizer, e.image_processor, e.max_model_len)  # front-end's
        self._ids = itertools.count()

    def generate(self, prompts: list[Any], params: SamplingParams | list[SamplingParams], *,
                 timeout_s: float = 600.0, window: int | None = None
                 ) -> tuple[list[RequestOutput | None], dict[str, str]]:
        """Run ``prompts`` to completion; returns the final outputs (None for a failed request, in order) and the
        failures (request id -> reason).

        At most ``window`` requests (default: twice the prefill engine's ``max_num_seqs``) are between allocation
        and their first decoded token at a time, as a front-end would pace them: a lease's deadline runs from its
        allocation, so a request must not sit in a long prefill queue holding one."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        window = window or 2 * self.prefill.engine.config.max_num_seqs
        rids = [f"pair-{next(self._ids)}" for _ in prompts]
        todo = list(zip(rids, prompts, plist, strict=True))[::-1]
        in_prefill: set[str] = set()
        final: dict[str, RequestOutput] = {}
        failed: dict[str, str] = {}
        deadline = time.monotonic() + timeout_s
        while todo or self.prefill.has_work() or self.decode.has_work():
            while todo and len(in_prefill) < window:
                rid, p, sp = todo.pop()
                to_prefill, to_decode = self.wire(p)
                lease = self.decode.allocate(rid, to_decode, sp)
                self.prefill.submit(rid, to_prefill, sp, self.prefill_manager.sender(lease, codec=self.prefill.codec))
                in_prefill.add(rid)
            if time.monotonic() > deadline:
                for rid in rids:
                    self.prefill.abort(rid, "timeout")
                    self.decode.abort(rid, "timeout")
                raise PairTimeout(f"{len(prompts)} requests did not finish in {timeout_s} s")
            self.prefill.step()
            report = self.decode.step()
            failed.update({**report.failed, **report.errors})
            in_prefill.difference_update(failed)
            for out in report.outputs:
                in_prefill.discard(out.request_id)
                if out.finished:
                    final[out.request_id] = out
            if not self.prefill.has_work() and self.decode.receivers:
                next(iter(self.decode.receivers.values())).wait(0.05)
        return [final.get(rid) for rid in rids], failed

    def wire(self, prompt: Any) -> tuple[ProcessedPrompt, ProcessedPrompt]:
        """``prompt`` processed once (the front-end's pass; a :class:`ProcessedPrompt` is taken as it is) and as each
        worker receives it: (prefill's, decode's)."""
        p = prompt if isinstance(prompt, ProcessedPrompt) else self.inputs.process(prompt)
        return tuple(prompt_wire.prompt_from_wire(messages.unpack(messages.pack(
            prompt=prompt_wire.prompt_to_wire(p, for_encoder=enc)))["prompt"], self.prefill.engine.image_processor)
            for enc in (True, False))

    def close(self) -> None:
        if self.decode.tiers is not None:
            self.decode.tiers.close()
        self.prefill_manager.close()
        self.decode_manager.close()

    def check_no_leaks(self) -> None:
        for w in (self.prefill, self.decode):
            w.engine.block_manager.check_no_leaks()
            assert not w.engine.requests, f"requests left: {list(w.engine.requests)}"
