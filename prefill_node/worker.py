"""The prefill worker: runs prompts (vision encoding + chunked prefill) and streams each request's KV, layer by
layer, to the decode worker that holds its lease.

Queues a request moves through: ``submit`` -> engine waiting (admission) -> engine running (prefill chunks; after the
final chunk's layer i, layer i's blocks are gathered and handed to the request's :class:`KVSender`) -> first token
sampled -> ``finish`` frame (the :class:`~kv_transfer.handoff.Handoff`: first token and its logprobs, an ``n > 1``
request's other choices' first tokens, M-RoPE delta, routing hints, sampler state) -> blocks freed. The worker never
decodes past the first token. Transfers overlap compute: ``send_layer`` only enqueues.

Per request the worker keeps one :class:`~prefill_node.request_state.PrefillRequest` in :attr:`PrefillWorker.requests`
(sender, sequence, held sends, compute time, visual mask), added by ``submit`` and dropped when its ``finish`` frame
goes or it is aborted. The engine is configured once, at construction, by its :class:`~engine.hooks.EngineHooks`:
the KV exporter (:meth:`PrefillWorker._export`), no forking of ``n > 1`` choices (decode forks them), routing
hints (MoE models), query capture when the compression policy scores KV, and the prefix feed's eviction hook.

Not thread-safe by itself: the actor wrapper serialises calls (``submit``/``abort`` and ``step`` under one lock), and
the engine calls the hooks on the thread running ``step``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Any

import torch

from engine import EngineConfig, EngineHooks, LLMEngine, SamplingParams
from engine.isolation import describe
from engine.kv_importance import kv_importance
from engine.sequence import Sequence
from kv_transfer import KVPoll, KVSender
from kv_transfer.compression import (
    CodecContext,
    CompressionPolicy,
    codec_for,
    needs_scores,
    resolve_policy,
)
from kv_transfer.handoff import Handoff, generator_to_state
from prefill_node.prefix_feed import PrefixFeed
from prefill_node.request_state import PrefillRequest

logger = logging.getLogger(__name__)


QUERY_WINDOW = 32  # the prompt's last queries that score KV channels and tokens for pruning


class PrefillWorker:
    def __init__(self, model_dir: str | Path, config: EngineConfig, *, stream_layers: bool = True,
                 compression: str | dict | CompressionPolicy | None = None) -> None:
        self.stream_layers = stream_layers
        self.compression = resolve_policy(compression)
        self.codec = codec_for(self.compression)  # the senders' codec (identity without a policy)
        self._score = self.compression is not None and needs_scores(self.compression)
        self.requests: dict[str, PrefillRequest] = {}  # request id -> its record, from submit to finish / abort
        self.faults = Faults()
        # prefix-cache feed for the front-end's router (cluster.control.router.PrefixIndex): block hashes this worker
        # registered and evicted since the last submit reply
        self.prefix_feed = PrefixFeed()
        self._dropped: list[tuple[str, str]] = []  # (request id, why) given up since the last report (take_report)
        self._handed_off: dict[str, KVSender] = {}  # finish sent, not yet confirmed by the decode side
        self.engine = LLMEngine(model_dir, config, hooks=EngineHooks(
            kv_exporter=self._export,
            fork_choices=False,  # n > 1: the choices' first tokens go in the hand-off, decode forks them
            track_routing=True,  # routing hints for the decode side's experts; a dense model has none to track
            query_window=QUERY_WINDOW if self._score else 0,
            on_evict=self.prefix_feed.evicted, on_snapshot_drop=self.prefix_feed.ends_dropped))
        self.prefix_feed.hybrid = self.engine.block_manager.snapshots is not None
        self.prompt_tokens = 0  # prompts finished here, and their tokens found in the prefix cache (hit rate)
        self.cached_tokens = 0

    # ----------------------------------------------------------------------------------------------------- requests
    def submit(self, request_id: str, prompt: Any, params: SamplingParams, sender: KVSender) -> None:
        """Queue a prompt; its KV goes to ``sender``. ``prompt`` is the front-end's processed prompt
        (:mod:`node_common.prompt_wire`: token ids, hashes, preprocessed pixels; neither re-tokenized nor re-decoded
        here) or anything the engine takes. Raises the engine's typed errors (nothing queued)."""
        first_only = dataclasses.replace(params, max_tokens=None, return_logits=False)
        self.engine.add_request(request_id, prompt, first_only)
        if self.faults.corrupt_next > 0:
            self.faults.corrupt_next -= 1
            sender.tamper = _flip_first_byte
        self.requests[request_id] = PrefillRequest(sender, self.engine.requests[request_id])

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        req = self.requests.pop(request_id, None)
        sender = req.sender if req is not None else self._handed_off.pop(request_id, None)
        if sender is not None:
            sender.abort(reason)
        return self.engine.abort_request(request_id)

    def abort_all(self, reason: str) -> int:
        """Abort every request, handed off or not (a new front-end took the worker over); returns how many."""
        return sum(self.abort(rid, reason) or True for rid in [*self.requests, *self._handed_off])

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    # --------------------------------------------------------------------------------------------------------- step
    def step(self) -> list[str]:
        """One engine step; returns the ids of requests whose prefill finished (their ``finish`` frame is sent)."""
        for rid, req in list(self.requests.items()):
            if req.sender.poll() == KVPoll.FAILED:  # the decode side went away: stop spending compute on it
                logger.warning("transfer for %s failed (%s); dropping its prefill", rid,
                               req.sender.failure_exception())
                self.abort(rid, "transfer failed")
                self._dropped.append((rid, f"transfer failed: {req.sender.failure_exception()}"))
        self._sweep_handed_off()
        done = []
        for out in self.engine.step():
            rid = out.request_id
            req = self.requests.get(rid)
            if req is None or req.export_error is not None:
                continue
            del self.requests[rid]
            for send in req.held:
                send()
            computed = time.time() if req.compute_done_s is None else req.compute_done_s
            if out.error is not None:  # its step failed after the forward: the KV is whole, the hand-off says why
                handoff = Handoff(0, compute_done_s=computed, error=out.error)
            else:
                handoff = self._handoff(out.outputs[0].token_ids[0], req.seq, computed)
                self._note_prefix(req.seq)
            req.sender.finish(dataclasses.replace(handoff, stages=req.stages()).to_meta())
            self._handed_off[rid] = req.sender  # until the decode side confirmed it (_sweep_handed_off)
            if not out.finished:
                self.engine.abort_request(rid)
            done.append(rid)
        for rid, req in list(self.requests.items()):
            if req.export_error is not None:  # KV cannot be delivered whole: another pair may do better
                self.abort(rid, "KV export failed")
                self._dropped.append((rid, f"KV export failed: {req.export_error}"))
        return done

    def _sweep_handed_off(self) -> None:
        """Forget handed-off transfers that ended; one that failed (its frames never arrived: a stalled link, a
        receiver gone) is reported dropped like one that failed before its hand-off."""
        for rid, sender in list(self._handed_off.items()):
            state = sender.poll()
            if state is KVPoll.FAILED:
                self._dropped.append((rid, f"transfer failed after the hand-off: {sender.failure_exception()}"))
            if state in (KVPoll.FAILED, KVPoll.SUCCESS):
                del self._handed_off[rid]

    def take_report(self) -> dict:
        """What the front-end learns since the last call: the block hashes registered in / evicted from the prefix
        cache (:meth:`prefill_node.prefix_feed.PrefixFeed.take`) and ``dropped``: ``[[request id, reason], ...]``,
        the requests this worker gave up on because their transfer failed (the decode side may not know: a receiver
        whose lease waits for its transfer to start would wait for the request's deadline)."""
        self._sweep_handed_off()
        dropped, self._dropped = self._dropped, []
        return {**self.prefix_feed.take(), "dropped": [[rid, why] for rid, why in dropped]}

    def _note_prefix(self, seq: Sequence) -> None:
        """Count ``seq``'s prefix-cache hit and remember the hashes of its full prompt blocks, which the engine has
        just registered (the same :meth:`Sequence.block_hash` the front-end computes from the processed prompt)."""
        self.prompt_tokens += seq.num_prompt_tokens
        self.cached_tokens += seq.num_cached_tokens
        bm = self.engine.block_manager
        if bm.enable_prefix_caching:
            hashes = [seq.block_hash(i) for i in range(seq.num_prompt_tokens // seq.block_size)]
            self.prefix_feed.registered(hashes)
            if bm.snapshots is not None:  # a hybrid model's hit ends only where the GDN state was kept
                self.prefix_feed.ends_registered(h for h in hashes if bm.snapshots.holds(h))

    def _export(self, layer: int, seqs: list[Sequence]) -> None:
        last = layer == self.engine.model_config.text.num_layers - 1
        if self.faults.layer_delay_s:
            time.sleep(self.faults.layer_delay_s)
        for seq in seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.export_error is not None:
                continue
            try:
                self._export_one(layer, seq, req, last)
            except Exception as e:  # noqa: BLE001 - this request's KV only: the step goes on for the others
                logger.error("request %s: KV export of layer %d failed: %s", seq.request_id, layer, describe(e),
                             exc_info=e)
                req.export_error = describe(e)

    def _export_one(self, layer: int, seq: Sequence, req: PrefillRequest, last: bool) -> None:
        if self.engine.hooks.request_fault is not None:
            self.engine.hooks.request_fault("export", seq)
        runner = self.engine.runner
        if layer in runner.state_index:  # a GDN layer: its final state is one state frame, always raw
            send = functools.partial(req.sender.send_state, runner.state_index[layer], runner.gather_state(seq, layer))
        else:
            k, v = runner.gather_layer(seq, layer)
            ctx = None if self.compression is None else self._codec_context(seq, k, v)
            send = functools.partial(req.sender.send_layer, runner.kv_index[layer], k, v, ctx)
        if last:
            req.compute_done_s, req.compute_done_pc = time.time(), time.perf_counter()
        if self.stream_layers:
            send()
        else:
            req.held.append(send)

    def _codec_context(self, seq: Sequence, k: torch.Tensor, v: torch.Tensor) -> CodecContext:
        """What the codec needs to know about this layer of ``seq``'s prompt: which tokens are visual and, when the
        policy prunes, the importance scores from the prompt's last queries (:mod:`engine.kv_importance`)."""
        n = seq.num_prompt_tokens
        visual = self.requests[seq.request_id].visual_mask(k.device)
        ctx = CodecContext(num_tokens=n, visual=visual)
        q = self.engine.runner.captured_queries.get(seq.seq_id) if self._score else None
        if q is not None:
            kk, vv = k.flatten(0, 1)[:n], v.flatten(0, 1)[:n]
            imp = kv_importance(q, kk, vv, scale=self.engine.model_config.text.head_dim ** -0.5,
                                query_is_text=~visual[n - q.shape[0]:])
            ctx.k_channel_score, ctx.v_channel_score, ctx.token_score = imp.k_channel, imp.v_channel, imp.token
        return ctx

    @staticmethod
    def _handoff(first_token: int, seq: Sequence, compute_done_s: float) -> Handoff:
        """What the decode side needs beside the KV (:mod:`kv_transfer.handoff`)."""
        choices = [{"token": int(tok), **({} if g is None else {"generator_state": generator_to_state(g)}),
                    **({} if lp is None else {"logprobs": lp.to_wire()})}
                   for tok, lp, g in seq.pending_choices or []]
        return Handoff(int(first_token), mrope_delta=0 if seq.mm is None else int(seq.mm.mrope_delta),
                       expert_hist=None if seq.expert_hist is None else seq.expert_hist.tolist(),
                       generator_state=None if seq.generator is None else generator_to_state(seq.generator),
                       compute_done_s=compute_done_s,
                       first_logprobs=seq.logprobs[0].to_wire() if seq.logprobs else None, choices=choices,
                       prompt_logprobs=None if seq.prompt_logprobs is None else
                       [None if x is None else x.to_wire() for x in seq.prompt_logprobs])


@dataclasses.dataclass
class Faults:
    """Fault injection for tests (set through the actor's ``inject_fault``): a pause after every layer's compute
    (a slow prefill) and corruption of the next N transfers' first payload byte."""

    layer_delay_s: float = 0.0
    corrupt_next: int = 0


def _flip_first_byte(header: dict, payload: torch.Tensor) -> None:
    payload[0] ^= 0xFF
