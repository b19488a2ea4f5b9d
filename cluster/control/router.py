"""Request placement: pure functions over worker load snapshots, plus the front-end's bounded prefix index.

**Prefill** (:func:`pick_prefill`): one load signal per worker, ``queued_tokens`` -- prompt tokens admitted to it and
not yet past their first token (the front-end's only counter of it) -- weighted by its measured speed
``s_per_token``. A prompt is charged only the tokens the worker must compute: its leading blocks already in that
worker's prefix cache (:class:`PrefixIndex`, fed by the workers) are free. Among the workers with room (the caller's
admission cap), the pick minimises the expected time to first token::

    expected_s = (queued_tokens + prompt_tokens - cached_tokens) * s_per_token

A prompt with images counts its image tokens at the vision tower's weight (``prompt_tokens`` in text-token
equivalents, :meth:`cluster.control.admission.PrefillAdmission.cost`); the tower's share of the image tokens inside a
worker's cached prefix is spared there too (``cached_extra``: that worker encoded those images, and keeps their
features), so a repeated image goes back to its worker however much the tower weighs.

A worker whose speed is not measured yet is assumed as fast as the mean of the measured ones (1.0 when none is).
Speeds enter at most ``MAX_SPEED_SPREAD`` (2x) slower than the fastest worker's: the workers of a pool run one model
on one kind of machine, so a larger measured gap is mostly noise (a sample taken while the host was busy), and
without the bound a few such samples starve a worker (a burst of 48 split 37 / 11 on a loaded 2-core machine); a
worker that is really slower still gets at most half the work of a fast one, and one that stops answering is the
healer's to replace. Ties go to fewer queued tokens, then to the lower worker id.

Worked example (block size 4, a 40-token prompt whose first 6 blocks = 24 tokens sit in prefill-1's cache)::

    prefill-0: queued 100, 0.010 s/token, cached 0   -> (100 + 40 - 0)  * 0.010 = 1.40 s
    prefill-1: queued 100, 0.012 s/token, cached 24  -> (100 + 40 - 24) * 0.012 = 1.39 s   <- picked
    prefill-2: queued   0, unmeasured (mean 0.011),  no room under its cap        -> skipped

**Refusal** (:func:`projected_wait_ttft_s`): when no worker has room, the admission projects the prompt's time to
first token over the whole pool, and refuses it at once when that is past its deadline.

**Decode** (:func:`pick_decode`): most free KV blocks among those that can hold the request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MAX_SPEED_SPREAD = 2.0  # placement counts no worker more than this many times slower than the pool's fastest
PREFIX_INDEX_SIZE = 4096  # block hashes remembered per prefill worker (16 bytes each: ~64 KiB a worker)


@dataclass
class WorkerLoad:
    """Decode workers' snapshot (and every worker's liveness)."""

    worker_id: str
    free_blocks: int = 0  # decode: KV blocks free or evictable
    alive: bool = True


@dataclass(frozen=True)
class PrefillLoad:
    """One prefill worker as :func:`pick_prefill` sees it for one prompt."""

    worker_id: str
    queued_tokens: int  # admitted to it and not yet past their first token (charged, i.e. uncached, tokens)
    s_per_token: float | None  # measured seconds from submit to first token per queued token; None until measured
    cached_tokens: int = 0  # leading tokens of this prompt its prefix cache holds (whole blocks)
    has_room: bool = True  # the caller's admission cap lets it take this prompt now
    cached_extra: int = 0  # work beside the tokens that the cached prefix spares here: the vision tower's share
    # (text-token equivalents) of the prompt's image tokens inside it, whose features the worker encoded already


def expected_prefill_s(load: PrefillLoad, prompt_tokens: int, s_per_token: float) -> float:
    """Seconds until ``prompt_tokens`` (``load.cached_tokens`` of them cached, ``load.cached_extra`` more spared)
    get their first token on ``load``."""
    spared = load.cached_tokens + load.cached_extra
    assert prompt_tokens > 0 and 0 <= load.cached_tokens and 0 <= spared < prompt_tokens, (prompt_tokens, load)
    return (load.queued_tokens + prompt_tokens - spared) * s_per_token


def placement_speeds(loads: Sequence[PrefillLoad]) -> list[float]:
    """Each worker's seconds per token as placement counts them (see the module docstring): measured, or the mean of
    the measured ones (1.0 when none is), and at most ``MAX_SPEED_SPREAD`` times the fastest's."""
    measured = [w.s_per_token for w in loads if w.s_per_token is not None]
    default = sum(measured) / len(measured) if measured else 1.0
    slowest = MAX_SPEED_SPREAD * min(measured, default=default)
    return [min(w.s_per_token or default, slowest) for w in loads]


def pick_prefill(loads: Sequence[PrefillLoad], prompt_tokens: int) -> PrefillLoad | None:
    """The worker with room whose expected time to first token is least (see the module docstring), or None when
    none has room (the caller waits for room, then asks again)."""
    open_ = [(w, s) for w, s in zip(loads, placement_speeds(loads), strict=True) if w.has_room]
    if not open_:
        return None
    return min(open_, key=lambda ws: (expected_prefill_s(ws[0], prompt_tokens, ws[1]), ws[0].queued_tokens,
                                      ws[0].worker_id))[0]


def projected_wait_ttft_s(loads: Sequence[PrefillLoad], prompt_tokens: int, waiting_tokens: int) -> float | None:
    """Seconds until a prompt that has to wait for room (none of ``loads`` has any) gets its first token, or None
    when no worker is measured (no basis for a guess). The pool is seen as one queue that its workers drain
    together: everything ahead of the prompt -- the tokens admitted to the workers and ``waiting_tokens`` of the
    prompts waiting at the front-end before it -- and then its own uncached tokens (the best cached prefix in the
    pool), over the pool's speed, the sum of its workers' tokens per second (:func:`placement_speeds`)::

        ttft_s = (sum(queued_tokens) + waiting_tokens + prompt_tokens - max(cached_tokens + cached_extra))
                 / sum(1 / s_per_token)

    On one worker this is its expected time to first token once admitted, as if it had no cap: the wait for room
    (the queue beyond the cap drained) plus its prefill behind a full queue. It assumes perfect balance and no
    newer, cheaper prompt overtaking, so it errs on the short side.

    Worked example (a 150-token prompt, nothing cached, 300 tokens of prompts waiting before it)::

        prefill-0: queued 300, 0.010 s/token -> 100 tokens/s
        prefill-1: queued 150, 0.020 s/token ->  50 tokens/s
        ttft_s = (300 + 150 + 300 + 150) / (100 + 50) = 6.0 s

    A request with 5 s left to its deadline is refused (retry in about 1 s); one with 10 s left waits.
    """
    if all(w.s_per_token is None for w in loads):
        return None
    own = prompt_tokens - max(w.cached_tokens + w.cached_extra for w in loads)
    ahead = sum(w.queued_tokens for w in loads) + waiting_tokens
    return (ahead + own) / sum(1 / s for s in placement_speeds(loads))


def cached_prefix_tokens(held: PrefixIndex, block_hashes: Sequence[bytes], block_size: int,
                         ends: PrefixIndex | None = None) -> int:
    """Tokens in the longest run of leading ``block_hashes`` that ``held`` has (the prefix a worker would reuse); a
    hybrid model's worker (``ends``: the hashes it keeps a GDN state snapshot after) reuses only up to the last block
    of that run with a snapshot."""
    n = 0
    for h in block_hashes:
        if h not in held:
            break
        n += 1
    if ends is not None:
        while n and block_hashes[n - 1] not in ends:
            n -= 1
    return n * block_size


def pick_decode(loads: list[WorkerLoad], blocks_needed: int, *, exclude: frozenset[str] = frozenset()
                ) -> WorkerLoad | None:
    """The live decode worker with the most free blocks, if any can hold ``blocks_needed``."""
    live = [w for w in loads if w.alive and w.worker_id not in exclude and w.free_blocks >= blocks_needed]
    if not live:
        return None
    return max(live, key=lambda w: (w.free_blocks, w.worker_id))


class PrefixIndex:
    """The block hashes one prefill worker's prefix cache holds, as far as the front-end knows: least recently seen
    first, at most ``capacity`` of them (16 bytes each). Fed two ways:

    * :meth:`update` -- the worker's numbered report (:meth:`prefill_node.prefix_feed.PrefixFeed.take`, in each
      submit reply and asked for every second): hashes it registered and hashes it evicted since its previous report.
      Evicted ones are forgotten, so a worker that reused those blocks no longer attracts prompts for that prefix.
      Reports may arrive out of order: a hash keeps the state of the latest report that named it.
    * :meth:`add_predicted` -- the front-end's own prediction when a request placed there gets its first token (its
      prefill registered its blocks), ahead of the report that confirms it. The request was submitted at report
      ``since``; a hash reported evicted by a later report is not added back (the eviction may have come after the
      registration), and a later report's eviction removes what was predicted. Recently evicted hashes are
      remembered for this, at most ``capacity`` of them.

    Still an approximation (a report past the worker's feed bound loses changes; the cost is one placement that
    finds less or more cached than predicted), never a correctness issue.

    Worked example (capacity 2): report 1 registered a, b -> holds a, b; report 3 evicted a -> holds b; report 2
    (late) registered a, c -> holds b, c (a's eviction in report 3 is later). A request submitted at report 3 gets
    its first token after report 4 evicted b: ``add_predicted([b, d], since=3)`` adds only d -> holds c, d.
    """

    def __init__(self, capacity: int = PREFIX_INDEX_SIZE) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, int] = OrderedDict()  # hash -> the report it is known registered at
        self._evicted: OrderedDict[bytes, int] = OrderedDict()  # recently evicted hash -> the report that said so

    def __contains__(self, h: bytes) -> bool:
        return h in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def update(self, seq: int, registered: Iterable[bytes], evicted: Iterable[bytes]) -> None:
        """Apply the worker's report number ``seq`` (>= 1; a hash in at most one of the two lists)."""
        assert seq >= 1, seq
        for h in evicted:
            if self._hashes.get(h, 0) < seq:  # else a later report (or prediction) has it registered
                self._hashes.pop(h, None)
            if self._evicted.get(h, 0) < seq:
                self._evicted[h] = seq
                self._evicted.move_to_end(h)
        _trim(self._evicted, self.capacity)
        self._add((h for h in registered if self._evicted.get(h, 0) < seq), seq)

    def add_predicted(self, hashes: Iterable[bytes], since: int) -> None:
        """Add ``hashes``, just registered by a request submitted at report ``since``, except those a later report
        evicted."""
        self._add((h for h in hashes if self._evicted.get(h, 0) <= since), since)

    def _add(self, hashes: Iterable[bytes], seq: int) -> None:
        for h in hashes:
            self._hashes[h] = max(seq, self._hashes.get(h, 0))
            self._hashes.move_to_end(h)
        _trim(self._hashes, self.capacity)


def _trim(d: OrderedDict, capacity: int) -> None:
    while len(d) > capacity:
        d.popitem(last=False)
