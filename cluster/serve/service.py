"""The serving core behind both APIs (gRPC ``duet.v1`` and OpenAI-compatible HTTP).

A request moves through: admission (:class:`~cluster.serve.limits.Admission`: over the cap it is refused at once)
-> id registered (for Abort) -> prompt built on a thread (model name, image caps read from headers, chat template)
-> :meth:`DisaggCluster.prepare` on a thread (tokenize, decode and resize images, context check) -> ``max_tokens``
resolved against the context -> :meth:`DisaggCluster.stream` -> detokenized, stop strings applied -> zero or more
:class:`DeltaEvent` then one :class:`FinalEvent`. Leaving early (client cancel, stop string, Abort, drain) cancels
the cluster stream, which aborts the request on its prefill and decode workers. Errors are the typed
:class:`~engine.errors.DuetError` subclasses; :mod:`cluster.serve.errors` maps them to status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cluster.control.delta import Delta
from cluster.control.errors import ClusterUnavailableError
from cluster.control.timeline import RequestClock
from cluster.serve.chat import render_chat
from cluster.serve.errors import (
    DuplicateRequestIdError,
    ModelNotFoundError,
    ServerDrainingError,
    classify,
)
from cluster.serve.expert_load import ExpertLoad, placement_summary
from cluster.serve.limits import (
    Admission,
    Limits,
    check_visual_tokens,
    image_size,
    resolve_max_tokens,
    visual_token_counts,
)
from cluster.serve.metrics import Metrics
from cluster.serve.schema import (
    ChoiceEnd,
    DeltaEvent,
    FinalEvent,
    GenerateInput,
    GenerationDefaults,
    SamplingOptions,
)
from cluster.serve.stop_strings import StopMatcher
from engine import SamplingParams
from engine.errors import DuetError, InvalidRequestError, PromptTooLongError
from engine.outputs import TokenLogprobs
from engine.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_REQUEST_ID_LEN = 128


_ABORT = object()
_END = object()


class _Choice:
    """One choice's stream state: detokenizer, stop strings, tokens so far, how it ended."""

    def __init__(self, tok: Any, prompt_ids: list[int], stops: list[str]) -> None:
        self.detok = IncrementalDetokenizer(tok, prompt_ids) if tok is not None else None
        self.prompt_ids = prompt_ids
        self.stopper = StopMatcher(stops)
        self.n_out = 0
        self.finish: str | None = None

    def push(self, item: Delta, index: int) -> DeltaEvent | None:
        ids = list(item.token_ids)
        self.n_out += len(ids)
        detok, stopper = self.detok, self.stopper
        text = stopper.push(detok.push(ids)) if detok is not None else ""
        done = item.choice_finished or item.finished
        if done and detok is not None and stopper.matched is None:
            text += stopper.push(detok.finish()) + stopper.flush()
        if stopper.matched is not None:
            self.finish = "stop"
        elif done:
            self.finish = item.finish_reason or "stop"
        lps, plps = item.logprobs, item.prompt_logprobs
        if not (ids or text):
            return None
        return DeltaEvent(ids, text, index, None if lps is None else [TokenLogprobs.from_wire(w) for w in lps],
                          None if plps is None else self.prompt_ids,
                          None if plps is None else [None if w is None else TokenLogprobs.from_wire(w) for w in plps])


class InferenceService:
    """Serves requests on a :class:`~cluster.control.disagg.DisaggCluster` (which it does not own)."""

    def __init__(self, cluster: Any, limits: Limits, model_name: str) -> None:
        self.cluster = cluster
        self.model_name = model_name
        self.limits = limits
        self.max_model_len = cluster.inputs.max_model_len
        self.max_prompt_tokens = min(limits.max_prompt_tokens or self.max_model_len - 1, self.max_model_len - 1)
        self.max_tokens_cap = limits.max_tokens or self.max_model_len
        self.defaults = GenerationDefaults.from_model_dir(cluster.spec.model_dir)
        self.admission = Admission(limits.max_concurrent)
        self.expert_load = ExpertLoad()
        self.metrics = Metrics(self._kv_blocks, lambda: self.admission.in_flight)
        self.draining = False
        # why new requests are refused with ClusterUnavailableError (the Ray head is gone or being replaced:
        # cluster.serve.head_watch sets and clears it); None while the cluster serves
        self.unavailable: str | None = None
        self.requests_served = 0
        self._running: dict[str, asyncio.Queue] = {}
        self._tag = secrets.token_hex(3)  # keeps client-chosen ids of two front-ends on one cluster apart
        self._calls = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="duet-preprocess")
        self._pool.submit(self._warm_up)

    def _warm_up(self) -> None:
        """Pay a first request's one-time front-end costs at start, on a preprocessing thread: the chat template
        compiled, the tokenizer's and the prompt checks' first calls (a served first request spent ~25 ms more in
        the front-end than the next ones, 2-core AMD EPYC). Best effort: a failure here is the first request's."""
        with contextlib.suppress(Exception):
            tok = self.cluster.tokenizer
            text = render_chat(tok, self.cluster.inputs.cfg, [{"role": "user", "content": "Hello"}]) if tok else None
            self.cluster.prepare({"prompt": text or "Hello"})

    # ------------------------------------------------------------------------------------------------ generate
    async def generate(self, req: GenerateInput, *, api: str) -> AsyncIterator[DeltaEvent | FinalEvent]:
        """Stream one request's events; raises typed errors (before any event for a bad request)."""
        clock = RequestClock(arrival=time.monotonic())
        outcome = "error"
        try:
            if self.draining:
                raise ServerDrainingError("server is shutting down and takes no new requests")
            if self.unavailable is not None:
                raise ClusterUnavailableError(self.unavailable)
            self.admission.enter()
        except DuetError as e:
            self.metrics.requests.labels(api, self._failed(e)).inc()
            raise
        rid = req.request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        registered = False
        pump: asyncio.Task | None = None
        try:
            self._check_request_id(rid)
            self._running[rid], registered = queue, True
            loop = asyncio.get_running_loop()
            # one trip to a preprocessing thread: each hop between threads costs a woken thread (~0.3 ms, 2 cores)
            prepared = await loop.run_in_executor(self._pool, lambda: self.cluster.prepare(self._build_prompt(req)))
            clock.preprocess_s = time.monotonic() - clock.arrival
            prompt_ids = prepared[0].token_ids
            if len(prompt_ids) > self.max_prompt_tokens:
                raise PromptTooLongError(f"prompt has {len(prompt_ids)} tokens; this server takes at most "
                                         f"{self.max_prompt_tokens}")
            params = self._params(req.sampling, len(prompt_ids))
            # the cluster's id is new for every call: a client may reuse an id the moment its request ended, while
            # the workers may still be releasing the old one (an abort, a lease not yet expired)
            pump = asyncio.create_task(self._pump(prepared, params, f"{self._tag}-{rid}-{next(self._calls)}", queue))
            async for event in self._events(rid, queue, prompt_ids, req.sampling.stop, params.n, clock):
                if isinstance(event, FinalEvent):
                    outcome = "aborted" if event.finish_reason == "abort" else "ok"
                    self.metrics.observe_finished(event.timeline, event.prompt_tokens, event.completion_tokens)
                    self.requests_served += 1
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            if outcome not in ("ok", "aborted"):  # closed after its final event (read to its end): it was served
                outcome = "cancelled"
            raise
        except Exception as e:
            outcome = self._failed(e)
            raise
        finally:
            if pump is not None:
                pump.cancel()  # aborts the request on its workers if it is still running
                with contextlib.suppress(asyncio.CancelledError):
                    await pump
            if registered:
                self._running.pop(rid, None)
            self.admission.leave()
            self.metrics.requests.labels(api, outcome).inc()

    def _failed(self, e: BaseException) -> str:
        """The metric outcome of a request that failed with ``e`` (a refusal also counts under its reason)."""
        info = classify(e)
        self.metrics.observe_error(info)
        return info.outcome

    async def _pump(self, prepared: Any, params: SamplingParams, cluster_rid: str, queue: asyncio.Queue) -> None:
        try:
            async for item in self.cluster.stream(prepared, params, request_id=cluster_rid):
                queue.put_nowait(item)
            queue.put_nowait(_END)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(e)

    async def _events(self, rid: str, queue: asyncio.Queue, prompt_ids: list[int], stops: list[str], n: int,
                      clock: RequestClock) -> AsyncIterator[DeltaEvent | FinalEvent]:
        """Worker token events -> deltas per choice (detokenized, stop strings applied), then the final event once
        every choice ended (its worker's finish, or a stop string here)."""
        choices = [_Choice(self.cluster.tokenizer, prompt_ids, stops) for _ in range(n)]
        kv, attempts = None, 1
        while not all(c.finish for c in choices):
            item = await queue.get()
            if item is _ABORT:
                break
            if isinstance(item, BaseException):
                raise item
            if item is _END:
                raise DuetError("the request's stream ended without finishing")
            clock.observe(item)
            kv, attempts = item.kv_transfer or kv, item.attempt
            if item.expert_hist:
                self.expert_load.add(item.expert_hist)
            index = item.index
            if not 0 <= index < n or choices[index].finish:
                continue  # a choice a stop string ended here: the rest of its tokens are dropped
            delta = choices[index].push(item, index)
            if delta is not None:
                yield delta
        for c in choices:
            c.finish = c.finish or "abort"
        timeline = {**clock.timeline(kv, attempts=attempts), "kv_transfer": kv or {}}
        ends = [ChoiceEnd(i, c.finish, c.stopper.matched or "", c.n_out) for i, c in enumerate(choices)]
        yield FinalEvent(rid, ends[0].finish_reason, ends[0].stop, len(prompt_ids), sum(e.completion_tokens for e in ends),
                         timeline, ends)

    # ------------------------------------------------------------------------------------------- validation
    def _check_request_id(self, rid: str) -> None:
        if len(rid) > MAX_REQUEST_ID_LEN or not rid.isprintable():
            raise InvalidRequestError(f"request_id must be at most {MAX_REQUEST_ID_LEN} printable characters")
        if rid in self._running:
            raise DuplicateRequestIdError(f"a request with id {rid!r} is already running")

    def _build_prompt(self, req: GenerateInput) -> dict:
        """The engine's prompt dict (runs on a thread: applies the chat template, reads image headers)."""
        if req.model and req.model != self.model_name:
            raise ModelNotFoundError(f"model {req.model!r} is not served here (this server serves "
                                     f"{self.model_name!r})")
        if len(req.images) > self.limits.max_images:
            raise InvalidRequestError(f"{len(req.images)} images is over the limit of {self.limits.max_images}")
        sizes = [image_size(im.data, im.mime_type, self.limits, i) for i, im in enumerate(req.images)]
        inputs = self.cluster.inputs
        check_visual_tokens(visual_token_counts(inputs.cfg, inputs.image_processor, sizes),
                            self.limits.max_visual_tokens)
        images = [im.data for im in req.images]
        if req.prompt_token_ids is not None:
            prompt: dict = {"prompt_token_ids": list(req.prompt_token_ids)}
        elif req.messages is not None:
            prompt = {"prompt": self._render_chat(req.messages, req.tools.rendered if req.tools else None)}
        else:
            text = req.prompt or ""
            if not text.strip():
                raise InvalidRequestError("the prompt is empty")
            tok = self.cluster.tokenizer
            if not req.raw_prompt and tok is not None:
                text = render_chat(tok, self.cluster.inputs.cfg, [{"role": "user", "content": text}]) or text
            prompt = {"prompt": text}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        return prompt

    def _render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        if not messages:
            raise InvalidRequestError("messages is empty")
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise InvalidRequestError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                                          f"got {m.get('role')!r}")
            if not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"messages[{i}].content must be text")
        if not any(m["content"].strip() for m in messages):
            raise InvalidRequestError("the prompt is empty")
        tok = self.cluster.tokenizer
        text = render_chat(tok, self.cluster.inputs.cfg, messages, tools) if tok is not None else None
        if text is None:
            raise InvalidRequestError("this model has no chat template; send a raw prompt (/v1/completions, or "
                                      "prompt with raw_prompt)")
        return text

    def _params(self, s: SamplingOptions, prompt_tokens: int) -> SamplingParams:
        d = self.defaults
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(s, name)
            if v is not None and not math.isfinite(v):
                raise InvalidRequestError(f"{name} must be a finite number, got {v}")
        max_tokens = resolve_max_tokens(s.max_tokens, d.max_tokens, prompt_tokens, self.max_model_len,
                                        self.max_tokens_cap)
        return SamplingParams(
            temperature=d.temperature if s.temperature is None else s.temperature,
            top_p=d.top_p if s.top_p is None else s.top_p,
            top_k=d.top_k if s.top_k is None else s.top_k,
            max_tokens=max_tokens, min_tokens=s.min_tokens, stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos, seed=s.seed, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty, logprobs=s.logprobs,
            prompt_logprobs=s.prompt_logprobs, n=s.n, structured_outputs=s.structured_outputs)

    # ------------------------------------------------------------------------------------------- the rest
    def abort(self, request_id: str) -> bool:
        queue = self._running.get(request_id)
        if queue is None:
            return False
        queue.put_nowait(_ABORT)
        return True

    def model_info(self) -> dict:
        """What ``ListModels`` reports. ``architecture`` is ``<family>/<text model>`` (``llava/qwen3_moe``,
        ``qwen3_vl/qwen3_vl_moe_text``) or the bare text model; ``tokens_per_image`` is 0 where it varies with the
        image (Qwen-VL: grid / merge², with ``patch_size`` and ``merge_size`` to compute it)."""
        cfg = self.cluster.inputs.cfg
        v = cfg.vision
        arch = cfg.text.model_type if v is None else f"{cfg.family}/{cfg.text.model_type}"
        qwen = v is not None and cfg.is_qwen_vl
        return {"id": self.model_name, "architecture": arch, "max_model_len": self.max_model_len,
                "max_prompt_tokens": self.max_prompt_tokens, "max_tokens": self.max_tokens_cap,
                "vision": v is not None, "tokens_per_image": cfg.tokens_per_image if v is not None and not qwen else 0,
                "max_image_bytes": self.limits.max_image_bytes, "max_image_pixels": self.limits.max_image_pixels,
                "max_images": self.limits.max_images, "max_visual_tokens": self.limits.max_visual_tokens,
                "patch_size": v.patch_size if qwen else 0, "merge_size": v.spatial_merge_size if qwen else 0}

    async def status(self) -> dict:
        if self.unavailable is not None:  # the workers cannot be asked: say why at once, not after each one's timeout
            raise ClusterUnavailableError(self.unavailable)
        workers = await asyncio.get_running_loop().run_in_executor(None, self.cluster.status)
        decode = [w for w in workers if w["role"] == "decode" and w["alive"]]
        total = sum(w["total_blocks"] for w in decode)
        used = sum(w["total_blocks"] - w.get("free_blocks", 0) for w in decode)
        return {"model": self.model_name, "transport": self.cluster.spec.transport, "workers": workers,
                "in_flight": self.admission.in_flight, "max_concurrent": self.admission.limit,
                "kv_usage": used / total if total else 0.0,
                "experts": {**self.expert_load.summary(), "placement": placement_summary(decode)},
                "requests_served": self.requests_served, "draining": self.draining,
                "prefix_cache": self.cluster.prefix_summary(workers),
                "kv_memory": self.cluster.kv_memory_summary(workers), "healing": self.cluster.healing()}

    def healthy(self) -> bool:
        return not self.draining and self.unavailable is None and any(w.load.alive for w in self.cluster.decodes) and \
            any(w.load.alive for w in self.cluster.prefills)

    async def drain(self, timeout_s: float, force: asyncio.Event | None = None) -> None:
        """Refuse new requests, let in-flight ones finish for up to ``timeout_s`` (or until ``force`` is set), then
        abort the rest."""
        self.draining = True
        end = time.monotonic() + timeout_s
        while self.admission.in_flight and time.monotonic() < end and not (force and force.is_set()):
            await asyncio.sleep(0.05)
        if self.admission.in_flight:
            logger.warning("aborting %d request(s) still running after %.0f s", self.admission.in_flight, timeout_s)
            for queue in list(self._running.values()):
                queue.put_nowait(_ABORT)
            end = time.monotonic() + 5.0
            while self.admission.in_flight and time.monotonic() < end:
                await asyncio.sleep(0.05)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _kv_blocks(self):
        for w in self.cluster.decodes:
            yield w.load.worker_id, w.load.free_blocks, self.cluster.total_blocks.get(w.load.worker_id, 0)
