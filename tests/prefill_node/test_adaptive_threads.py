"""A prefill actor whose threads grow and shrink (``adaptive_threads``): it steps on what
:class:`node_common.core_share.CoreShare` answers and reports it in its stats."""

from __future__ import annotations

import time

from node_common import messages
from prefill_node import actor as prefill_actor
from prefill_node.actor import PrefillActor


def test_a_prefill_actor_reports_its_threads(tiny_model_dir, monkeypatch):
    """An adaptive prefill actor steps on what :class:`CoreShare` answers and says so in its stats (``threads``,
    ``thread_changes``); a fixed one never switches."""
    monkeypatch.setattr(prefill_actor.CoreShare, "threads", lambda self: 1)  # the others hold every core but one
    cfg = dict(dtype="float32", num_kv_blocks=32, block_size=4, max_num_seqs=4, max_model_len=64)
    adaptive = PrefillActor("adaptive", str(tiny_model_dir), cfg, "grpc", insecure=True, num_threads=2,
                            adaptive_threads=True)
    fixed = PrefillActor("fixed", str(tiny_model_dir), cfg, "grpc", insecure=True, num_threads=2)
    try:
        stats = messages.unpack(fixed.stats())
        assert stats["threads"] == 2 and stats["thread_changes"] == 0 and not fixed.adaptive_threads
        assert adaptive.adaptive_threads and messages.unpack(adaptive.stats())["thread_changes"] == 0
        adaptive.worker.has_work = lambda: True  # one step's worth: the loop asks CoreShare before it
        adaptive.worker.step = lambda: []
        adaptive.wake.set()
        deadline = time.monotonic() + 10
        while adaptive.thread_changes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = messages.unpack(adaptive.stats())
        assert stats["threads"] == 1 and stats["thread_changes"] == 1
    finally:
        adaptive.shutdown()
        fixed.shutdown()
