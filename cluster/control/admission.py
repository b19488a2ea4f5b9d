"""Where one request runs: prefill admission and decode placement over the front-end's
:class:`~cluster.control.worker.Worker` s.

:class:`DisaggCluster <cluster.control.disagg.DisaggCluster>` asks this module for a pair, in this order (all on the
front-end's event loop):

1. :meth:`PrefillAdmission.admit` -- wait until a prefill worker has room for the prompt, then charge it the prompt's
   uncached tokens (:func:`cluster.control.router.pick_prefill`: least expected time to first token, the prefix its
   cache holds free), an image token counting as :attr:`PrefillAdmission.visual_weight` text tokens (learnt from
   the prefill workers' measured stages: the vision tower's time per image token against the language model's per
   token). Requests queue here, not in a prefill worker's queue: a lease's deadline runs from its
   allocation, so no decode blocks are reserved before admission. A prompt that would wait is first refused at
   once (:class:`~cluster.control.errors.PrefillOverloadedError`, with a retry hint) when the pool could not get to
   it before its deadline (:meth:`PrefillAdmission.check_reachable`; ``ClusterSpec.refuse_when_overloaded``).
2. :func:`pick_decode_worker` -- the live decode worker with most free blocks (after the admission wait: free blocks
   may have changed while it waited).
3. :meth:`PrefillAdmission.release` at the first token or the attempt's end, whichever comes first (the charge given
   back exactly once by the attempt's :class:`~cluster.control.worker.Assignment`; waiters wake and ask again).

Each worker's :class:`~cluster.control.router.PrefixIndex` follows its prefix cache from the worker's reports
(:func:`apply_prefix_report`): one comes in every submit reply, and :meth:`PrefillAdmission.reports` asks
for one every ``PREFIX_REPORT_S``, so an eviction is learnt even when no request goes there.

The pure algorithms are in :mod:`cluster.control.router`; the counters they read are the workers' own
(:mod:`cluster.control.worker`).
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.control.bounded import bounded
from cluster.control.errors import PrefillOverloadedError, RequestTimeoutError, TransferFailedError
from cluster.control.router import (
    PrefillLoad,
    PrefixIndex,
    cached_prefix_tokens,
    pick_decode,
    pick_prefill,
    projected_wait_ttft_s,
)
from cluster.control.spec import ClusterSpec
from cluster.control.worker import Worker
from engine import SamplingParams
from engine.config import ModelConfig
from engine.errors import OutOfBlocksError
from engine.sequence import Sequence
from node_common import messages

VISUAL_WEIGHT_EWMA = 0.2  # weight of the newest sample in PrefillAdmission.visual_weight
MAX_VISUAL_WEIGHT = 64.0  # a sample beyond this is a measurement gone wrong (a tiny compute time), not a cost
PREFIX_REPORT_S = 1.0  # how often each prefill worker is asked for its prefix-cache changes (evictions included)
PREFILL_QUEUE_LEASE_FRACTION = 0.5  # a prefill worker's admitted work, in measured seconds, vs lease_base_s
# a refused request's retry hint: at least 1 s (HTTP's Retry-After counts whole seconds), at most a minute (a longer
# projection is mostly a burst that will have changed by then)
REFUSAL_RETRY_MIN_S, REFUSAL_RETRY_MAX_S = 1.0, 60.0


@dataclass(eq=False)
class _Waiter:
    """A request waiting at the front-end for prefill room: woken by :meth:`PrefillAdmission.release`."""

    woken: asyncio.Future
    tokens: int  # its prompt tokens: work ahead of every request that comes to wait after it


class PrefillAdmission:
    """Admits prompts to prefill workers under each worker's cap (see the module docstring). Front-end loop only."""

    def __init__(self, spec: ClusterSpec, local_prefill: int = 0) -> None:
        self.block_size = spec.block_size
        self.prefix_caching = bool(spec.extra_engine.get("enable_prefix_caching", True))
        self._lease_base_s = spec.lease_base_s
        self._request_timeout_s = spec.request_timeout_s
        self._static_cap = spec.max_prefill_queue_tokens or 4 * spec.max_num_batched_tokens
        self._adaptive_cap = spec.max_prefill_queue_tokens is None  # default: also bounded by measured time
        self._refuse_when_overloaded = spec.refuse_when_overloaded
        self._room_waiters: list[_Waiter] = []  # requests waiting for prefill room, in arrival order
        # an image token's prefill work in text tokens (vision tower + language model), learnt from the workers'
        # reported stages (observe_stages); one value for the pool: its workers run one model on one kind of machine
        self.visual_weight = 1.0
        # prefill workers run a vision stage (Qwen3-VL, spec.vision_slice): a prompt without images passes image
        # prompts there, so image prompts do not take its room (load_of)
        self.text_lane = (spec.vision_slice(local_prefill) is not None
                          and ModelConfig.from_pretrained(spec.model_dir).is_qwen_vl)

    async def admit(self, live: Callable[[], list[Worker]], n_prompt: int, hashes: list[bytes], rid: str,
                    deadline: float, exclude: frozenset[str], n_visual: int = 0,
                    visual_positions: Sequence[int] = ()) -> tuple[Worker, int]:
        """Place the prompt on a prefill worker once one has room for it. ``live()`` gives the workers that take
        requests now (asked again after every wait); those in ``exclude`` (tried already) are used only when no
        other is live. A prompt larger than a worker's cap is admitted to it alone. Returns the worker and the
        tokens charged to it (give them back with :meth:`release`). Its ``n_visual`` image tokens count as
        :attr:`visual_weight` text tokens each (:meth:`cost`); ``visual_positions`` (sorted) says where they are, so
        a worker whose cached prefix holds some of them is charged no tower work for those (:meth:`load_of`).

        Before each wait for room, :meth:`check_reachable` may refuse the prompt at once
        (:class:`~cluster.control.errors.PrefillOverloadedError`); a wait that reaches ``deadline`` raises
        :class:`~cluster.control.errors.RequestTimeoutError`. Either way nothing is charged and the request leaves
        no waiter behind."""
        loop = asyncio.get_running_loop()
        tokens = n_prompt
        while True:
            # in text-token equivalents, at the tower weight of now: the weight learnt while this prompt waited is the
            # one load_of spares cached images at (one weight for both, so no worker is spared more than it is charged)
            extra = self.cost(tokens, n_visual) - tokens
            n_prompt = tokens + extra
            workers = live()
            pool = [w for w in workers if w.worker_id not in exclude] or workers
            if not pool:
                raise TransferFailedError("no live prefill worker")
            unmeasured_s = max((w.s_per_token for w in workers if w.s_per_token is not None), default=None)
            loads = [self.load_of(w, n_prompt, hashes, unmeasured_s, images=n_visual > 0,
                                  visual_positions=visual_positions) for w in pool]
            pick = pick_prefill(loads, n_prompt)
            if pick is not None:
                break
            self.check_reachable(loads, n_prompt, rid, deadline)
            waiter = _Waiter(loop.create_future(), n_prompt)
            self._room_waiters.append(waiter)
            try:
                await bounded(waiter.woken, timeout=max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise RequestTimeoutError(f"request {rid} waited {self._request_timeout_s:.0f} s for prefill "
                                          f"capacity") from None
            finally:  # gone (timed out, cancelled) before a release woke it: no longer work ahead of anyone
                if waiter in self._room_waiters:
                    self._room_waiters.remove(waiter)
        pw = next(w for w in pool if w.worker_id == pick.worker_id)
        return pw, pw.charge(tokens, pick.cached_tokens, extra - pick.cached_extra, images=n_visual > 0)

    def queued_ahead(self, w: Worker, images: bool) -> int:
        """The charged tokens a prompt on ``w`` waits behind: all, or with :attr:`text_lane` and no images, only
        the text prompts' (what its speed sample is taken over)."""
        return w.prefill_tokens if images or not self.text_lane else w.prefill_tokens - w.image_tokens

    def cost(self, n_prompt: int, n_visual: int) -> int:
        """A prompt's prefill work in text-token equivalents: each of its ``n_visual`` image tokens counts
        :attr:`visual_weight` (>= 1: the vision tower's share on top of the language model's)."""
        return n_prompt + round((self.visual_weight - 1.0) * n_visual)

    def observe_stages(self, n_prompt: int, n_visual: int, stages: dict | None) -> None:
        """Learn :attr:`visual_weight` from one request's prefill stages (the hand-off's ``stages``, measured by
        its prefill worker): the vision tower's seconds per image token over the language model's seconds per
        prompt token, plus one. A text prompt, or an image found in the worker's vision cache (no tower time), says
        nothing about it. Worked example: a 1,088-token prompt with 1,024 image tokens, 2.0 s in the tower and
        1.1 s of compute -> (2.0 / 1024) / (1.1 / 1088) + 1 = 2.93. The compute of a step shared with other prompts
        counts their tokens too, so the weight is learnt low rather than high."""
        if n_visual <= 0 or not stages:
            return
        vision, compute = float(stages.get("vision_encode_s", 0.0)), float(stages.get("prefill_compute_s", 0.0))
        if vision <= 0 or compute <= 0:
            return
        sample = min(MAX_VISUAL_WEIGHT, 1.0 + (vision / n_visual) / (compute / n_prompt))
        self.visual_weight = (1 - VISUAL_WEIGHT_EWMA) * self.visual_weight + VISUAL_WEIGHT_EWMA * sample

    @property
    def waiting_tokens(self) -> int:
        """Prompt tokens of the requests waiting for room now."""
        return sum(w.tokens for w in self._room_waiters)

    def check_reachable(self, loads: list[PrefillLoad], n_prompt: int, rid: str, deadline: float) -> None:
        """Raise :class:`~cluster.control.errors.PrefillOverloadedError` when a prompt of ``n_prompt`` tokens about
        to wait for room on ``loads`` (none has any) would get its first token after ``deadline``
        (:func:`~cluster.control.router.projected_wait_ttft_s`, with the prompts already waiting ahead of it). No
        refusal when ``refuse_when_overloaded`` is off or no worker is measured. The retry hint is the projected
        wait beyond what the request could wait, within ``[REFUSAL_RETRY_MIN_S, REFUSAL_RETRY_MAX_S]``: by then
        the pool should have drained what stood in its way, if no more came."""
        if not self._refuse_when_overloaded:
            return
        ttft_s = projected_wait_ttft_s(loads, n_prompt, self.waiting_tokens)
        left_s = deadline - time.monotonic()
        if ttft_s is None or ttft_s <= left_s:
            return
        retry_s = min(REFUSAL_RETRY_MAX_S, max(REFUSAL_RETRY_MIN_S, ttft_s - left_s))
        raise PrefillOverloadedError(f"request {rid}: the prefill workers would get to its first token in about "
                                     f"{ttft_s:.1f} s, past its timeout ({max(0.0, left_s):.1f} s left); retry in "
                                     f"{retry_s:.0f} s", retry_after_s=retry_s)

    async def reports(self, live: Callable[[], list[Worker]], apply: Callable[[Worker, dict], Any], *,
                      timeout_s: float = 10.0) -> None:
        """Forever (a task on the front-end loop; cancel it): every ``PREFIX_REPORT_S`` ask each of ``live()`` for
        its report (``PrefillActor.report``: prefix-cache changes, requests given up) and hand it to ``apply``. A
        worker that does not answer is skipped (its death is the healer's to see)."""

        async def ask(w: Worker) -> None:
            async def call() -> bytes:
                return await w.actor.report.remote()

            apply(w, messages.unpack(await bounded(call(), timeout=timeout_s)))

        while True:
            await asyncio.sleep(PREFIX_REPORT_S)
            await asyncio.gather(*(ask(w) for w in live()), return_exceptions=True)

    def load_of(self, w: Worker, n_prompt: int, hashes: list[bytes],
                unmeasured_s_per_token: float | None = None, *, images: bool = False,
                visual_positions: Sequence[int] = ()) -> PrefillLoad:
        """``w`` as :func:`~cluster.control.router.pick_prefill` sees it for a prompt of ``n_prompt`` tokens
        (``unmeasured_s_per_token``: see :meth:`cap`). With a vision stage on the workers (:attr:`text_lane`), a
        prompt without images has room beside the image prompts admitted there: it passes them in the worker's
        vision stage, so only the text prompts ahead count against its cap. The image tokens among
        ``visual_positions`` inside the cached prefix cost no tower work there (``cached_extra``)."""
        cached = cached_prefix_tokens(w.prefix, hashes, self.block_size, w.prefix_ends)
        extra = min(self.cost(0, bisect.bisect_left(visual_positions, cached)), n_prompt - 1 - cached) if cached else 0
        held = self.queued_ahead(w, images)
        room = not held or held + n_prompt - cached - extra <= self.cap(w, unmeasured_s_per_token)
        return PrefillLoad(w.worker_id, w.prefill_tokens, w.s_per_token, cached, room, extra)

    def cap(self, pw: Worker, unmeasured_s_per_token: float | None = None) -> float:
        """Prompt tokens ``pw`` may hold between decode allocation and first token: ``max_prefill_queue_tokens``
        when configured; by default 4 x ``max_num_batched_tokens`` and no more than the worker gets through in half
        a lease (``lease_base_s``) at its measured speed, so a queue on a slow worker (a CPU, a long prompt mix) never
        outlives the leases its requests hold. A worker not measured yet is assumed as slow as
        ``unmeasured_s_per_token`` (:meth:`admit` passes the slowest measured worker of the pool); with no
        measurement at all, one prompt at a time. (Holding an unmeasured worker to one prompt while a measured one
        takes the rest hands a whole burst to whichever worker answered first: a fresh worker's first prompt is
        slow.)"""
        if not self._adaptive_cap:
            return self._static_cap
        s_per_token = pw.s_per_token if pw.s_per_token is not None else unmeasured_s_per_token
        if s_per_token is None:
            return 0
        return min(self._static_cap, PREFILL_QUEUE_LEASE_FRACTION * self._lease_base_s / s_per_token)

    def block_hashes(self, p: Any) -> list[bytes]:
        """The prompt's block hashes a prefill worker's prefix cache would look up (the engine's own
        :meth:`~engine.sequence.Sequence.block_hash`, image content included; the last token is always computed)."""
        if not self.prefix_caching:
            return []
        seq = Sequence(0, "", list(p.token_ids), len(p.token_ids), SamplingParams(), self.block_size, mm=p.mm)
        return [seq.block_hash(i) for i in range((len(p.token_ids) - 1) // self.block_size)]

    def release(self, pw: Worker, tokens: int, *, images: bool = False) -> None:
        """Give back admitted prompt tokens and wake the waiters (:class:`~cluster.control.worker.Assignment` calls
        it, once per admission)."""
        pw.discharge(tokens, images=images)
        waiters, self._room_waiters = self._room_waiters, []
        for w in waiters:
            if not w.woken.done():
                w.woken.set_result(None)


def apply_prefix_report(w: Worker, report: dict) -> int:
    """Fold a prefill worker's prefix report (``prefix_seq, registered, evicted``: a submit reply or a ``report``
    reply) into its index; returns the report's number."""
    w.prefix.update(report["prefix_seq"], report["registered"], report["evicted"])
    if "ends_registered" in report:  # a hybrid model's worker: where its hits can end
        if w.prefix_ends is None:
            w.prefix_ends = PrefixIndex()
        w.prefix_ends.update(report["prefix_seq"], report["ends_registered"], report["ends_dropped"])
    return report["prefix_seq"]


def pick_decode_worker(decodes: list[Worker], blocks: int, *, draining: Any,
                       exclude: frozenset[str] = frozenset()) -> Worker:
    """The live decode worker, not draining, with the most free blocks that can hold ``blocks`` (one outside
    ``exclude`` when any can); raises :class:`~engine.errors.OutOfBlocksError` when none can."""
    loads = [w.load for w in decodes if w.worker_id not in draining]
    load = pick_decode(loads, blocks, exclude=exclude) or pick_decode(loads, blocks)
    if load is None:
        raise OutOfBlocksError(f"no live decode worker has {blocks} free KV blocks")
    return next(w for w in decodes if w.load is load)


# a decode worker's pending local prefills (pick_local_decode_worker): up to this many prompts of the new one's
# length, which share its next step (two 262-token prompts arriving together, 2 req/s text on 2 cores: the second went
# to the prefill worker and took twice the first one's time to its first token)
LOCAL_PENDING_PROMPTS = 2
LOCAL_PENDING_MIN_TOKENS = 512  # ... counting a shorter prompt as this long


def pick_local_decode_worker(decodes: list[Worker], tokens: int, limit: int, block_size: int, *, draining: Any,
                             exclude: frozenset[str] = frozenset()) -> Worker | None:
    """The decode worker to prefill a text prompt of ``tokens`` tokens itself (``ClusterSpec.local_prefill_tokens``
    = ``limit``): one outside ``exclude`` whose pending local prompt tokens, this prompt's included, stay within
    ``LOCAL_PENDING_PROMPTS`` prompts of its length (``LOCAL_PENDING_MIN_TOKENS`` at least), the most free blocks
    first; None when the prompt is too long or no worker has room (it then goes to a prefill worker, which runs beside
    the decode worker's queue instead of behind it)."""
    if tokens > limit:
        return None
    pending = LOCAL_PENDING_PROMPTS * max(tokens, LOCAL_PENDING_MIN_TOKENS)
    room = [w for w in decodes if w.worker_id not in exclude and w.local_tokens + tokens <= pending]
    try:
        return pick_decode_worker(room, -(-tokens // block_size), draining=draining)
    except OutOfBlocksError:
        return None
