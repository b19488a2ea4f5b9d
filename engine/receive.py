"""The decode side of disaggregation, as :class:`engine.llm_engine.LLMEngine` methods: reserve blocks for a prompt
whose KV another worker computes (:meth:`ReceiveMixin.preallocate`), store its layers and GDN state as they arrive,
then commit it into the running batch with the first tokens prefill sampled, or release it.

A receiving request sits in ``LLMEngine.receiving`` (not scheduled) from ``preallocate`` until ``commit_prefilled`` or
``release_prefill``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from engine.admission import check_fits, plan_received
from engine.errors import InvalidRequestError, OutOfBlocksError
from engine.outputs import RequestOutput, TokenLogprobs
from engine.sampler import generator_at
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceStatus


class ReceiveMixin:
    """Decode-side receive (see the module docstring); mixed into :class:`~engine.llm_engine.LLMEngine`, whose
    state (``receiving``, ``requests``, ``block_manager``, ``runner``, ``scheduler``) it uses."""

    def preallocate(self, request_id: str, prompt: Any, params: SamplingParams | None = None) -> list[int]:
        """Reserve blocks for a prompt whose KV another worker computes; returns the block ids (in order; ``-1`` at
        image blocks kept coded, ``visual_kv_cache="int8"``: :mod:`engine.coded_kv`).

        The request waits in ``receiving`` (not scheduled) until :meth:`commit_prefilled` or
        :meth:`release_prefill`. Raises RequestTooLargeError when the pool could never hold it and OutOfBlocksError
        when it cannot now (nothing reserved either way). ``prompt`` may be a :class:`ProcessedPrompt` (see
        :meth:`add_request`), with or without pixels.
        """
        seq = self._new_sequence(request_id, prompt, params or SamplingParams())
        # n > 1: room for each other choice's copy of the partial last block too, so the fork rarely runs short
        extra = (seq.params.n - 1) * self.config.block_size if seq.num_tokens % self.config.block_size else 0
        bm = self.block_manager
        coded, pages = plan_received(self.config.visual_kv_cache, self.runner.page_capacity, seq)
        check_fits(bm, self.runner.block_bytes, seq, seq.num_tokens + extra, coded, pages)
        if not bm.allocate_received(seq, coded, seq.num_tokens, pages, spare_tokens=extra):
            raise OutOfBlocksError(f"{seq.num_tokens}-token prompt does not fit the free KV blocks now")
        seq.status = SequenceStatus.RECEIVING
        self.requests[request_id] = seq
        self.receiving[request_id] = seq
        return list(seq.block_table)

    def write_layer(self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor,
                    dropped: torch.Tensor | None = None) -> None:
        """Store one received layer of a receiving request's KV (``[num_blocks, block_size, kvh, d]`` each, for
        every block of its table, coded ones included). ``dropped``: prompt positions the sender left out of this
        layer; decoding gives them no attention."""
        seq = self.receiving[request_id]
        self.runner.write_layer(seq.block_table, layer, k, v, seq.coded)
        if dropped is not None and dropped.numel():
            if seq.kv_dropped is None:
                seq.kv_dropped = {}
            kv_layer = self.runner.kv_index[layer]  # the decode mirror counts KV layers only
            if seq.coded is not None:  # coded tokens are masked in their pages, the rest at their mirror index
                in_pages, plain = seq.coded.split(dropped.cpu().numpy())
                seq.coded.dropped[kv_layer] = in_pages
                dropped = torch.from_numpy(plain)
            seq.kv_dropped[kv_layer] = dropped

    def write_state(self, request_id: str, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        """Store one received GDN layer's state of a receiving request (hybrid models; ``layer`` is the decoder
        layer, ``tensors`` as :meth:`ModelRunner.gather_state` gives them)."""
        seq = self.receiving[request_id]
        assert seq.state_slot is not None, "preallocate gave every receiving request of a hybrid model a state slot"
        self.runner.write_state(seq.state_slot, layer, tensors)

    def commit_prefilled(self, request_id: str, first_token: int, generator_state: torch.Tensor | None = None,
                         *, lossy: bool = False, first_logprobs: TokenLogprobs | None = None,
                         choices: Seq[tuple[int, TokenLogprobs | None, torch.Tensor | None]] = (),
                         prompt_logprobs: list[TokenLogprobs | None] | None = None) -> list[RequestOutput]:
        """All layers arrived and verified: the request joins the running batch with its first token (sampled by
        the prefill worker, with its logprobs when asked). ``choices``: an ``n > 1`` request's other first tokens
        ``(token, logprobs, generator state)`` for choices 1..n-1, forked here onto the prompt's blocks
        (:meth:`_fork`). Returns one output per choice after its first token (finished if it already ended).
        ``lossy``: the KV was compressed on the wire, so its blocks are not published to the prefix cache (a later
        prompt must never reuse approximate KV as if it were exact)."""
        seq = self.receiving.pop(request_id)
        if len(choices) != seq.params.n - 1:
            self.requests.pop(request_id, None)
            self.block_manager.free(seq)
            raise InvalidRequestError(f"request {request_id}: {len(choices) + 1} first tokens for n={seq.params.n}")
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.kv_lossy = lossy or seq.coded is not None
        seq.prompt_logprobs = prompt_logprobs
        self.block_manager.register_computed(seq)
        seeded = seq.params.seed is not None
        seq.generator = generator_at(generator_state) if seeded else None
        now = time.perf_counter()
        self._append(seq, first_token, first_logprobs, None, now)
        self.scheduler.add_prefilled(seq)
        forked = self._fork(seq, [(t, lp, generator_at(g) if seeded else None) for t, lp, g in choices], None)
        for q in [seq, *forked]:
            if q.finish_reason is None:
                self._check_stop(q, q.token_ids[-1])
            if q.finish_reason is not None:
                q.metrics.finished_time = now
        if seq.group_finished:
            self.requests.pop(request_id, None)
        return [self.make_output(q) for q in [seq, *forked]]

    def release_prefill(self, request_id: str) -> bool:
        """Give back the blocks of a receiving request (transfer failed, expired or aborted)."""
        seq = self.receiving.pop(request_id, None)
        if seq is None:
            return False
        self.requests.pop(request_id, None)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        return True
