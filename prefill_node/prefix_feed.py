"""What a prefill worker tells the front-end's router about its prefix cache
(:class:`cluster.control.router.PrefixIndex`): the block hashes it registered and those it evicted since its previous
report, each hash once with its latest state (a hash registered, evicted and registered again is reported registered),
each report numbered (``seq``, from 1) so the front-end can apply reports that reach it out of order (a submit reply
and a periodic report in flight together: :meth:`cluster.control.router.PrefixIndex.update`). Bounded: past ``capacity`` changes the oldest are dropped
(a front-end that stops asking loses only hints; its index is an approximation either way).

A hybrid model's worker (``hybrid``) also reports where a hit can end: the block hashes whose GDN state snapshot it
keeps (``ends_registered``) or dropped (``ends_dropped``), since its prefix cache resumes only from a snapshot."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

FEED_MAX = 4096  # changes kept for the next report (the front-end's index holds as many hashes)


class PrefixFeed:
    def __init__(self, capacity: int = FEED_MAX) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._changes: OrderedDict[bytes, bool] = OrderedDict()  # hash -> registered (True) / evicted (False)
        self._ends: OrderedDict[bytes, bool] = OrderedDict()  # hybrid: snapshot hash -> kept / dropped
        self.hybrid = False  # set by the worker once its engine is built
        self.seq = 0  # reports taken

    def registered(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self._note(h, True)

    def evicted(self, h: bytes) -> None:
        """The engine's ``on_evict`` hook (:class:`engine.hooks.EngineHooks`)."""
        self._note(h, False)

    def ends_registered(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            _record(self._ends, h, True, self.capacity)

    def ends_dropped(self, h: bytes) -> None:
        """The engine's ``on_snapshot_drop`` hook."""
        _record(self._ends, h, False, self.capacity)

    def take(self) -> dict:
        """The next report: ``{"prefix_seq", "registered", "evicted"}`` -- the changes since the previous one (oldest
        first) -- and forget them. Its fields go into the worker's reply as they are."""
        changes, self._changes = self._changes, OrderedDict()
        self.seq += 1
        out = {"prefix_seq": self.seq, "registered": [h for h, r in changes.items() if r],
               "evicted": [h for h, r in changes.items() if not r]}
        if self.hybrid:
            ends, self._ends = self._ends, OrderedDict()
            out |= {"ends_registered": [h for h, r in ends.items() if r],
                    "ends_dropped": [h for h, r in ends.items() if not r]}
        return out

    def _note(self, h: bytes, registered: bool) -> None:
        _record(self._changes, h, registered, self.capacity)


def _record(changes: OrderedDict[bytes, bool], h: bytes, registered: bool, capacity: int) -> None:
    changes[h] = registered
    changes.move_to_end(h)
    while len(changes) > capacity:
        changes.popitem(last=False)
