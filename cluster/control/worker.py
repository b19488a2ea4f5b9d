"""One worker actor as the front-end sees it, and the one owner of each worker's load.

Every change to a worker's load goes through this module (all on the front-end's event loop):

* :class:`Worker` -- the actor handle and its counters. Its methods are the only writers: :meth:`Worker.charge` /
  :meth:`Worker.discharge` (the prefill admission charge, called by
  :class:`~cluster.control.admission.PrefillAdmission`), :meth:`Worker.observe_speed` (a prefill worker's measured
  speed) and :meth:`Worker.mark_dead` (the one way a worker is marked dead, whoever noticed: a request's failed
  call, the decode poller, the pool healer, a drain).
* :class:`Assignment` -- one attempt's hold on its (prefill, decode) pair, a context manager that gives back what it
  holds exactly once, however the attempt ends::

      pw, charge = await admission.admit(...)          # pw charged `charge` prompt tokens
      with Assignment(admission, pw, charge, hashes) as a:
          a.bind(decode)                               # the request counts in flight on both workers
          a.submitted(prefix_seq)                      # the prefill worker took it
          a.first_token()                              # speed observed, charge released, prefix predicted
      # exit: the charge released if no first token came, the in-flight counts dropped

Also :func:`await_ref` and :func:`call`: a Ray call as a coroutine with a deadline.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster.control.bounded import bounded
from cluster.control.errors import AttemptFailed
from cluster.control.router import PrefixIndex, WorkerLoad
from engine.errors import DuetError, is_retryable
from node_common.lane import LaneClosed

SPEED_EWMA = 0.2  # weight of the newest submit-to-first-token sample in a prefill worker's speed


@dataclass
class Worker:
    """One worker actor as the front-end sees it. Read the fields; change them only through the methods."""

    load: WorkerLoad  # id, liveness and (decode) free blocks: what the pure placement reads
    actor: Any
    inflight: int = 0  # requests placed on this worker and not yet finished (a drain waits for 0)
    # prefill workers: THE load signal (cluster.control.router): prompt tokens admitted and not yet past their first
    # token, less those predicted to come from its prefix cache
    prefill_tokens: int = 0
    image_tokens: int = 0  # prefill workers: the part of prefill_tokens charged for prompts with images
    s_per_token: float | None = None  # prefill workers: measured seconds from submit to first token per token queued
    prefix: PrefixIndex = field(default_factory=PrefixIndex)  # prefill workers: block hashes its cache holds
    # hybrid models' prefill workers: the block hashes a hit can end at (a GDN state snapshot kept after them)
    prefix_ends: PrefixIndex | None = None
    placed_tokens: int = 0  # prefill workers: prompt tokens placed here, and those predicted cached (hit rate)
    predicted_cached_tokens: int = 0
    # decode workers: prompt tokens of the requests it prefills itself (ClusterSpec.local_prefill_tokens) that have
    # not had their first token yet
    local_tokens: int = 0
    dead_reason: str | None = None  # why it was marked dead (None while alive)
    # decode workers: the front-end generation it serves (cluster.control.reattach): polls carry it, so a poll a
    # dead front-end left in flight takes no event of its successor's
    epoch: int = 0
    # decode workers: the loopback lane its poller opened (cluster.control.lane_client.Lane), None over Ray
    lane: Any = None

    @property
    def worker_id(self) -> str:
        return self.load.worker_id

    @property
    def alive(self) -> bool:
        return self.load.alive

    def mark_dead(self, reason: str) -> bool:
        """Take the worker out of placement for good (a replacement is a new :class:`Worker`). Returns True for the
        call that marked it, False when it was dead already (the first reason is kept)."""
        if not self.load.alive:
            return False
        self.load.alive = False
        self.dead_reason = reason
        return True

    def charge(self, n_prompt: int, cached_tokens: int, extra: int = 0, *, images: bool = False) -> int:
        """Admit a prompt of ``n_prompt`` tokens, ``cached_tokens`` of them predicted from the prefix cache, and
        ``extra`` tokens' worth of work beside them (its images' vision tower); returns the tokens charged (give them
        back with :meth:`discharge`, with the same ``images``)."""
        charge = n_prompt + extra - cached_tokens
        self.prefill_tokens += charge
        self.image_tokens += charge if images else 0
        self.placed_tokens += n_prompt
        self.predicted_cached_tokens += cached_tokens
        return charge

    def discharge(self, tokens: int, *, images: bool = False) -> None:
        self.prefill_tokens -= tokens
        self.image_tokens -= tokens if images else 0

    def observe_speed(self, elapsed_s: float, queued_tokens: int) -> None:
        """Fold one request's submit-to-first-token time over the tokens queued with it into the speed."""
        if queued_tokens <= 0 or elapsed_s <= 0:
            return
        sample = elapsed_s / queued_tokens
        self.s_per_token = sample if self.s_per_token is None else \
            (1 - SPEED_EWMA) * self.s_per_token + SPEED_EWMA * sample


class ChargeReleaser(Protocol):
    """Who takes an admission charge back (:class:`~cluster.control.admission.PrefillAdmission`)."""

    def release(self, pw: Worker, tokens: int, *, images: bool = False) -> None: ...


class Assignment:
    """One attempt's hold on its workers (see the module docstring): the prefill charge ``admission.admit`` took,
    and, once bound, the request's in-flight count on both workers. Front-end loop only."""

    def __init__(self, admission: ChargeReleaser, prefill: Worker, charge: int, hashes: list[bytes], *,
                 images: bool = False) -> None:
        self.admission, self.prefill, self.hashes, self.images = admission, prefill, hashes, images
        self.decode: Worker | None = None
        self._charge: int | None = charge  # None once given back
        self._submitted: tuple[float, int, int] | None = None  # (monotonic time, tokens queued, prefix report)
        self._first_token = False

    def __enter__(self) -> Assignment:
        return self

    def __exit__(self, *exc: object) -> None:
        self._release()
        if self.decode is not None:
            self.decode.inflight -= 1
            self.prefill.inflight -= 1

    def bind(self, decode: Worker) -> Worker:
        """Place the request on ``decode`` too; both workers count it in flight until the exit."""
        assert self.decode is None, "an assignment binds one decode worker"
        self.decode = decode
        decode.inflight += 1
        self.prefill.inflight += 1
        return decode

    def submitted(self, prefix_seq: int, queued: int | None = None) -> None:
        """The prefill worker took the request; its reply carried prefix report ``prefix_seq``. ``queued``: the
        charged tokens it waits behind, its own included (default: all the worker's)."""
        self._submitted = (time.monotonic(), self.prefill.prefill_tokens if queued is None else queued, prefix_seq)

    def first_token(self) -> None:
        """The request's first tokens arrived (later calls do nothing): the prefill worker's speed is observed, the
        charge given back, and the blocks it registered predicted in its prefix index."""
        if self._first_token:
            return
        self._first_token = True
        assert self._submitted is not None, "first token before submit"
        at, queued, seq = self._submitted
        self.prefill.observe_speed(time.monotonic() - at, queued)
        self._release()
        self.prefill.prefix.add_predicted(self.hashes, seq)  # registered (the next report confirms)
        if self.prefill.prefix_ends is not None and self.hashes:  # a snapshot after the last block a repeat hits
            self.prefill.prefix_ends.add_predicted(self.hashes[-1:], seq)

    def prefill_gone(self) -> str | None:
        """Why the request cannot get its first token any more (its prefill worker is dead and has not handed the
        prompt off), or None."""
        if self._first_token or self.prefill.alive:
            return None  # first token in: the prefill worker's part is done
        return f"prefill worker {self.prefill.worker_id} is gone ({self.prefill.dead_reason or 'unresponsive'})"

    def abort(self, rid: str) -> None:
        """Ask the live workers of the pair to drop ``rid`` (fire and forget)."""
        for w in (self.decode, self.prefill):
            if w is not None and w.alive:
                w.actor.abort.remote(rid)

    def _release(self) -> None:
        if self._charge is not None:
            charge, self._charge = self._charge, None
            self.admission.release(self.prefill, charge, images=self.images)


class LocalHold:
    """An attempt's hold on the one decode worker that prefills its prompt itself
    (:meth:`~cluster.control.worker_pool.WorkerPool.pick_local_decode`): the request counts in flight there, and
    its prompt tokens as pending local prefill until its first token. The same calls as :class:`Assignment`."""

    def __init__(self, decode: Worker, tokens: int) -> None:
        self.decode, self._tokens = decode, tokens  # _tokens: 0 once given back

    def __enter__(self) -> LocalHold:
        self.decode.inflight += 1
        self.decode.local_tokens += self._tokens
        return self

    def __exit__(self, *exc: object) -> None:
        self.first_token()
        self.decode.inflight -= 1

    def first_token(self) -> None:
        """The prefill is done: its tokens leave the worker's pending local prefill (later calls do nothing)."""
        self.decode.local_tokens -= self._tokens
        self._tokens = 0

    def prefill_gone(self) -> str | None:
        return None  # the decode worker is its own prefill worker: its death ends the stream as a decode failure

    def abort(self, rid: str) -> None:
        if self.decode.alive:
            self.decode.actor.abort.remote(rid)


async def await_ref(ref: Any) -> Any:
    """A Ray ObjectRef as a coroutine (so :func:`~cluster.control.bounded.bounded` can bound it)."""
    return await ref


async def call(method: Any, payload: bytes, deadline: float) -> bytes:
    """``method.remote(payload)``, bounded by ``deadline`` (``time.monotonic()``; at least 0.1 s)."""
    left = max(0.1, deadline - time.monotonic())
    return await bounded(await_ref(method.remote(payload)), timeout=left)


def call_decode(w: Worker, method: str, msg: bytes, deadline: float) -> Any:
    """``method(msg)`` on decode worker ``w`` (an awaitable of the reply), bounded by ``deadline``: over its poller's
    loopback lane where it has one (:mod:`cluster.control.lane_client`), else as :func:`call`."""
    lane = w.lane
    return lane.call(method, msg, deadline) if lane is not None else call(getattr(w.actor, method), msg, deadline)


def call_failure(e: Exception, role: str, w: Worker, pair: dict[str, str]) -> BaseException:
    """What a failed ``allocate`` / ``submit`` on ``w`` becomes: :class:`AttemptFailed` for a dead worker (marked
    dead) or a retryable typed error (another pair may avoid it), else ``e`` itself."""
    import ray

    if isinstance(e, LaneClosed):  # the poller, reading the same lane, decides whether the worker is gone
        return AttemptFailed(f"{role} worker {w.worker_id}'s lane closed", **pair)
    if isinstance(e, ray.exceptions.RayActorError):
        w.mark_dead(f"{type(e).__name__} on a call")
        return AttemptFailed(f"{role} worker {w.worker_id} is gone", **pair)
    if is_retryable(e):
        return AttemptFailed(f"{type(e).__name__}: {e}", error=e if isinstance(e, DuetError) else None, **pair)
    return e
