"""The engine loop: ``add_request`` -> ``step()`` (schedule -> run -> postprocess) -> outputs.

Single process, single thread. Node actors in ``prefill_node/`` and ``decode_node/`` drive one engine each.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable
import time
from pathlib import Path
from typing import Any

import torch

from engine.admission import check_local
from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig, parse_device
from engine.cpu_tuning import tune_malloc
from engine.errors import InvalidRequestError
from engine.grammar import GrammarFactory
from engine.hooks import EngineHooks
from engine.inputs import InputProcessor, ProcessedPrompt, image_processor_for
from engine.isolation import describe, edit_rows, non_finite_rows
from engine.kv_budget import KVMemory, plan_pool, state_snapshots
from engine.vision_cache import PoolStore
from engine.model import LlavaModel
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from engine.receive import ReceiveMixin
from engine.penalties import apply_penalties
from engine.sampler import (LogitsProcessor, SampleResult, apply_logits_processors, prompt_token_logprobs, sample,
                            suppress_stop_tokens)
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer
from engine.vision_stage import VisionStage
from engine.workspace import encoder_reserve

logger = logging.getLogger(__name__)


class LLMEngine(ReceiveMixin):
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, *,
                 hooks: EngineHooks | None = None) -> None:
        """``hooks``: what the owner plugs in (:class:`engine.hooks.EngineHooks`), fixed for the engine's life."""
        self.config = config = config or EngineConfig()
        self.hooks = hooks = hooks or EngineHooks()
        self.model_dir = Path(model_dir)
        self.model_config = cfg = ModelConfig.from_pretrained(self.model_dir)
        self.dtype = config.torch_dtype(cfg)
        self.device = parse_device(config.device)
        if self.device.type == "cpu":
            tune_malloc()
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidRequestError("device 'cuda' requested but CUDA is not available")
        self.model = LlavaModel.load(self.model_dir, cfg, self.dtype, self.device, config.cpu_linear, config.vision_tower)
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir) if (self.model_dir / "tokenizer.json").is_file() else None
        self.image_processor = image_processor_for(self.model_dir, cfg)
        self.eos_token_ids = list(cfg.eos_token_ids) or (self.tokenizer.eos_token_ids if self.tokenizer else [])
        self.num_state_slots = (config.max_num_state_slots or config.max_num_seqs) if cfg.text.is_hybrid else 0
        # hybrid models: a prefix hit resumes from a GDN state snapshot (engine.state_cache.Snapshots)
        self.num_snapshots = state_snapshots(config, cfg.text, self.dtype) if cfg.text.is_hybrid else 0
        self.prefix_caching_off_reason = (
            "hybrid model with state_snapshots=0: a prefix hit needs the GDN layers' state after it"
            if cfg.text.is_hybrid and config.enable_prefix_caching and not self.num_snapshots else None)
        if self.prefix_caching_off_reason and config.enable_prefix_caching:
            logger.info("prefix caching off: %s", self.prefix_caching_off_reason)
        self.workspace = encoder_reserve(config, cfg, self.image_processor, self.dtype, self.model.vision)
        pool = plan_pool(config, cfg.text, self.dtype, self.num_state_slots + self.num_snapshots, self.workspace)
        self.max_model_len = max_len = pool.max_model_len
        self.kv_budget_bytes, num_blocks = pool.budget_bytes, pool.num_blocks
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          num_state_slots=self.num_state_slots, on_evict=hooks.on_evict,
                                          num_snapshots=self.num_snapshots,
                                          snapshot_every_blocks=config.state_snapshot_every_blocks,
                                          on_snapshot_drop=hooks.on_snapshot_drop,
                                          visual_floor=int(config.text_kv_floor * num_blocks))
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   policy=config.scheduling_policy, max_wait_s=config.scheduling_max_wait_s)
        self.runner = ModelRunner(self.model, num_blocks=num_blocks, block_size=config.block_size,
                                  max_model_len=max_len, max_num_seqs=config.max_num_seqs, dtype=self.dtype,
                                  device=self.device, vision_cache_size=config.vision_cache_size,
                                  vision_cache_bytes=config.vision_cache_bytes if self.model.vision is not None else 0,
                                  mirror_tokens=pool.mirror_tokens, num_state_slots=self.num_state_slots + self.num_snapshots,
                                  track_routing=hooks.track_routing, query_window=hooks.query_window,
                                  workspace=self.workspace)
        # cached image features live in KV blocks the block manager lends, given back first when KV needs them
        self.runner.vision_cache.store = PoolStore(self.runner.pool, self.block_manager)
        self.block_manager.reclaim = self.runner.vision_cache.reclaim
        self.encoding = VisionStage(self.runner, config.vision_slice_s)  # prompts whose images are being encoded
        self.inputs = InputProcessor(cfg, self.tokenizer, self.image_processor, max_len,
                                     kv_bytes_per_token=self.runner.kv_bytes_per_token)
        self.requests: dict[str, Sequence] = {}
        self._seq_ids = itertools.count()
        self._generator = torch.Generator().manual_seed(config.seed)
        # The per-request logits-processor hook (structured outputs): called once per sequence (each choice) with its
        # params; what it returns edits that sequence's logits before every sample (engine.sampler.LogitsProcessor).
        # Default: structured outputs (engine.grammar: a grammar mask for params with structured_outputs).
        self.logits_processor_factory: Callable[[SamplingParams], LogitsProcessor | None] | None = GrammarFactory(
            self.tokenizer, cfg.text.vocab_size, self.eos_token_ids)
        self.receiving: dict[str, Sequence] = {}
        # ids of requests dropped on preemption (no pixels here to recompute their prompt); the owner drains it
        self.cannot_recompute: list[str] = []

    def kv_memory(self) -> KVMemory:
        """Cache bytes now: the paged pool, the decode mirror (which grows on demand) and GDN state slots."""
        r = self.runner
        return KVMemory(pool_bytes=r.pool_nbytes, mirror_bytes=r.mirror.nbytes, budget_bytes=self.kv_budget_bytes,
                        state_bytes=0 if r.state is None else r.state.nbytes, vision_cache_bytes=r.vision_cache.nbytes,
                        workspace_bytes=self.workspace, **self.block_manager.regions(r.block_bytes))

    # ----------------------------------------------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate and queue a request. Raises InvalidRequestError (subclasses) and changes nothing on bad input.

        ``prompt`` is anything :meth:`InputProcessor.process` takes, or a :class:`ProcessedPrompt` processed once
        elsewhere (a front-end's): that one is only checked (:meth:`InputProcessor.check_processed`), never
        re-tokenized nor its images re-decoded."""
        self.add_sequence(self.make_sequence(request_id, prompt, params, arrival_time))

    def make_sequence(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                      arrival_time: float | None = None) -> Sequence:
        """:meth:`add_request`'s checks and its new sequence, without queueing it (nothing here changes: a caller may
        check a request on another thread than the one that steps, then :meth:`add_sequence` it there). Raises
        InvalidRequestError (subclasses)."""
        seq = self._new_sequence(request_id, prompt, params or SamplingParams(), arrival_time)
        if seq.mm is not None and not seq.mm.can_encode:
            why = "no vision tower here encodes its pixels" if self.model.vision is None else "its images carry no pixels here"
            raise InvalidRequestError(f"request {request_id!r}: {why}, so its prompt cannot be computed (such a "
                                      "prompt can only be preallocated for a transfer)")
        check_local(self, seq)  # its KV (every block plain) and its images' tower workspace fit (engine.admission)
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a sequence from :meth:`make_sequence` (on the stepping thread). Raises InvalidRequestError when its
        request id is taken meanwhile."""
        request_id = seq.request_id
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        self._seed(seq)
        self.requests[request_id] = seq
        # a Qwen3-VL prompt with images joins the scheduler once they are encoded (the vision stage)
        (self.encoding if self.encoding.takes(seq) else self.scheduler).add(seq)

    def _seed(self, seq: Sequence) -> None:
        """Seeded requests: one generator per choice (choice 0's samples every first token of an ``n > 1`` request)."""
        p = seq.params
        if p.seed is not None:
            seq.choice_generators = [torch.Generator().manual_seed(p.choice_seed(i)) for i in range(p.n)]
            seq.generator = seq.choice_generators[0]

    def _new_sequence(self, request_id: str, prompt: Any, params: SamplingParams,
                      arrival_time: float | None = None) -> Sequence:
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        p = self.inputs.check_processed(prompt) if isinstance(prompt, ProcessedPrompt) else self.inputs.process(prompt)
        seq = Sequence(seq_id=next(self._seq_ids), request_id=request_id, token_ids=list(p.token_ids),
                       num_prompt_tokens=len(p.token_ids), params=params, block_size=self.config.block_size,
                       prompt=p.prompt, mm=p.mm, metrics=RequestMetrics(arrival_time or time.perf_counter()),
                       logits=[] if params.return_logits else None,
                       logprobs=[] if params.logprobs is not None else None)
        if seq.mm is not None and seq.mm.features is None and self.model.vision is None:  # nothing here encodes
            seq.mm = dataclasses.replace(seq.mm, pixel_values=None)  # them (a copy: another engine's prompt too)
        seq.logits_processor = self._make_processor(params)
        return seq

    def _make_processor(self, params: SamplingParams) -> LogitsProcessor | None:
        return None if self.logits_processor_factory is None else self.logits_processor_factory(params)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. Returns False if it is unknown or already done."""
        if request_id in self.receiving:
            return self.release_prefill(request_id)
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.encoding.remove(seq)  # if still in the vision stage (no blocks yet)
        for q in seq.group:  # every choice of the request
            if q.finish_reason is None:
                self._finish(q, "abort")
                q.metrics.finished_time = time.perf_counter()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.encoding) or self.scheduler.has_unfinished()

    # --------------------------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One schedule -> run -> postprocess iteration. Returns an output for each request that got a token."""
        if self.encoding.take_turn(self.scheduler):  # a vision slice (engine.vision_stage)
            return []
        sched = self.scheduler.schedule()
        for seq in sched.preempted:
            self.runner.release(seq)
            if seq.mm is not None and not seq.mm.can_encode:
                self._drop_unrecomputable(seq)
        if sched.empty:
            return []
        now = time.perf_counter()
        for s in sched.prefills + sched.decodes:
            s.seq.metrics.first_scheduled_time = s.seq.metrics.first_scheduled_time or now
        logits, sampling = self.runner.execute(sched, self.hooks.kv_exporter)
        for seq, start, chunk in self.runner.prompt_logits:
            self._note_prompt_logprobs(seq, start, chunk)
        seqs = [s.seq for s in sampling]
        faults: dict[int, BaseException] = {}  # row -> its request's fault (engine.isolation)
        hook = self.hooks.request_fault
        with torch.inference_mode():  # the runner's logits are inference tensors: edit them in place only in here
            edit_rows(logits, seqs, self._edit_logits, list(range(len(seqs))) if hook else [
                r for r, q in enumerate(seqs) if q.num_output_tokens < q.params.min_tokens
                or q.logits_processor is not None or q.params.has_penalties], faults)
            non_finite_rows(logits, faults)
            fan = {r: q.params.n if q.needs_choices else 1 for r, q in enumerate(seqs) if r not in faults}
            src = [r for r, k in fan.items() for _ in range(k)]  # n > 1: every choice's first token
            res = sample(logits if src == list(range(len(seqs))) else logits[src], [seqs[r].params for r in src],
                         [g or self._generator for r, k in fan.items() for g in seqs[r].sample_generators(k)],
                         None if hook is None else lambda j: hook("sample", seqs[src[j]]))
        for j, e in res.errors.items():
            faults.setdefault(src[j], e)
        for s in sched.prefills + sched.decodes:
            s.seq.num_computed_tokens += s.num_tokens
            self.block_manager.register_computed(s.seq)
        now = time.perf_counter()
        outputs, first = [], {}
        for j, r in enumerate(src):
            first.setdefault(r, j)
        for r, seq in enumerate(seqs):
            if r not in faults:
                try:
                    outputs.extend(self._advance(seq, res, first[r], fan[r], logits, r, now))
                    continue
                except Exception as e:  # noqa: BLE001 - this request's fault (engine.isolation)
                    faults[r] = e
            if (out := self._fail(seq, faults[r])) is not None:
                outputs.append(out)
        return outputs

    def _edit_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """In place on ``logits`` (row r is ``seqs[r]``'s): ``min_tokens``, logits processors, penalties."""
        rows = [r for r, q in enumerate(seqs) if q.num_output_tokens < q.params.min_tokens]
        suppress_stop_tokens(logits, rows, [self._stop_ids(seqs[r]) for r in rows])
        if self.hooks.request_fault is not None:
            for q in seqs:
                self.hooks.request_fault("logits", q)
        apply_logits_processors(logits, [q.logits_processor for q in seqs])
        apply_penalties(logits, seqs)

    def _advance(self, seq: Sequence, res: SampleResult, j: int, k: int, logits: torch.Tensor, r: int,
                 now: float) -> list[RequestOutput]:
        """``seq``'s sample ``j`` (and its ``k - 1`` other choices' first ones) -> appended, forked, stop-checked;
        its outputs (``logits`` row ``r`` is its). Raises on this request's fault, before the request is forgotten."""
        hook = self.hooks.request_fault
        if hook is not None:
            hook("append", seq)
        row = logits[r].cpu() if seq.logits is not None else None
        self._append(seq, res.tokens[j], res.logprobs[j], row, now)
        choices = [] if k == 1 else [(t, lp, g) for t, lp, g in zip(
            res.tokens[j + 1:j + k], res.logprobs[j + 1:j + k], seq.sample_generators(k)[1:], strict=True)]
        if choices and not self.hooks.fork_choices:  # the owner hands them to the side that forks them
            seq.pending_choices = choices
        forked = self._fork(seq, choices, row) if choices and self.hooks.fork_choices else []
        for q in [seq, *forked]:
            if q.finish_reason is None:
                self._check_stop(q, q.token_ids[-1])
            if q.finish_reason is not None:
                q.metrics.finished_time = now
        if hook is not None:
            hook("output", seq)
        outs = [self.make_output(q) for q in [seq, *forked]]
        if seq.group[0].group_finished:
            self.requests.pop(seq.request_id, None)
        return outs

    def _fail(self, seq: Sequence, e: BaseException) -> RequestOutput | None:
        """End ``seq``'s request after its fault ``e`` in this step: every choice ``"error"``, blocks freed. Its
        output (finished, ``error`` set); None when it had ended already (an abort in the same step)."""
        rid = seq.request_id
        if self.requests.pop(rid, None) is None:
            return None
        logger.error("request %s failed in a step and was ended: %s", rid, describe(e), exc_info=e)
        now = time.perf_counter()
        for q in seq.group:
            if q.finish_reason is None:
                self._finish(q, "error")
                q.metrics.finished_time = now
            q.finish_reason = "error"
        head = seq.group[0]
        outs = [CompletionOutput(q.choice, "", list(q.output_token_ids), "error") for q in seq.group]
        return RequestOutput(rid, seq.prompt, seq.token_ids[: seq.num_prompt_tokens], outs, True, head.metrics,
                             head.num_cached_tokens, error=describe(e))

    @staticmethod
    def _note_prompt_logprobs(seq: Sequence, start: int, chunk: torch.Tensor) -> None:
        """Row j of ``chunk`` (prompt position ``start + j``) gives prompt token ``start + j + 1``'s logprobs."""
        if start == 0 or seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]  # the first prompt token has no position before it
        nxt = seq.token_ids[start + 1: min(start + chunk.shape[0] + 1, seq.num_prompt_tokens)]
        if nxt:
            seq.prompt_logprobs.extend(prompt_token_logprobs(chunk, nxt, seq.params.prompt_logprobs or 0))

    def _append(self, seq: Sequence, tok: int, lp: TokenLogprobs | None, row: torch.Tensor | None,
                now: float) -> None:
        """Append one sampled (or received) token and what goes with it."""
        seq.token_ids.append(int(tok))
        if seq.logits is not None and row is not None:
            seq.logits.append(row)
        if seq.logprobs is not None and lp is not None:
            seq.logprobs.append(lp)
        if seq.logits_processor is not None:
            seq.logits_processor.accept(int(tok))
        seq.metrics.first_token_time = seq.metrics.first_token_time or now

    def _fork(self, parent: Sequence, choices: list[tuple[int, TokenLogprobs | None, torch.Generator | None]],
              row: torch.Tensor | None) -> list[Sequence]:
        """Choices 1..n-1 of ``parent`` (its prompt KV computed, its first token appended): each shares the prompt's
        full blocks (reference counts) and gets a copy of the partial last one, which every choice writes next
        (:meth:`BlockManager.fork`); with no block free for that copy it waits to recompute its prompt (the full
        blocks then come back from the prefix cache where it holds them)."""
        children = []
        n_prompt = parent.num_prompt_tokens
        for tok, lp, gen in choices:
            child = parent.new_choice(next(self._seq_ids), gen)
            child.logits_processor = self._make_processor(parent.params)
            self._append(child, tok, lp, row, parent.metrics.first_token_time or time.perf_counter())
            if self.block_manager.can_fork(parent, n_prompt):
                copy = self.block_manager.fork(parent, child, n_prompt)
                if copy is not None:
                    self.runner.copy_block(*copy)
                if child.state_slot is not None:
                    self.runner.copy_state(parent.state_slot, child.state_slot)
                self.scheduler.add_prefilled(child)
            elif child.mm is None or child.mm.can_encode:
                self.scheduler.add(child)
            children.append(child)
        if any(not q.block_table and q not in self.scheduler.waiting for q in children):
            self._drop_unrecomputable(parent)  # no block for a choice whose image prompt cannot be recomputed here
        return children

    def _drop_unrecomputable(self, seq: Sequence) -> None:
        """A preempted prompt whose images this process has no pixels for cannot be recomputed: end its request
        (``abort``, every choice) and list it in :attr:`cannot_recompute` for the owner to fail (a decode worker
        retries it elsewhere)."""
        if self.requests.pop(seq.request_id, None) is None:
            return  # another choice of the same request was dropped already
        for q in seq.group:
            if q.finish_reason is None:
                self._finish(q, "abort")
                q.metrics.finished_time = time.perf_counter()
        self.cannot_recompute.append(seq.request_id)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.runner.release(seq)

    def _stop_ids(self, seq: Sequence) -> list[int]:
        return list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else self.eos_token_ids)

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if tok in p.stop_token_ids:
                seq.stop_reason = tok
                return self._finish(seq, "stop")
            if not p.ignore_eos and tok in self.eos_token_ids:
                return self._finish(seq, "stop")
        if (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")

    def make_output(self, seq: Sequence) -> RequestOutput:
        """``seq``'s choice so far; once the request is finished, every choice (by index)."""
        finished = seq.group[0].group_finished
        outs = [self._completion(q) for q in (seq.group if finished else [seq])]
        head = seq.group[0]
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, outs, finished,
                             head.metrics, head.num_cached_tokens, head.prompt_logprobs)

    def _completion(self, seq: Sequence) -> CompletionOutput:
        done = seq.finish_reason is not None
        text = self.tokenizer.decode(seq.output_token_ids) if done and self.tokenizer else ""
        return CompletionOutput(seq.choice, text, list(seq.output_token_ids), seq.finish_reason, seq.stop_reason,
                                seq.logits, seq.logprobs)

    # ------------------------------------------------------------------------------------------------------- stats
    def moe_counts(self) -> torch.Tensor:
        """[num_layers, num_experts] tokens routed per (layer, expert) since the last :meth:`reset_moe_counts`."""
        return self.model.text.moe_counts().cpu()

    def reset_moe_counts(self) -> None:
        self.model.text.reset_moe_counts()

    def clear_vision_cache(self) -> int:
        """Forget every cached image encoding (benchmarks replaying the same images); returns how many there were."""
        return self.runner.clear_vision_cache()

