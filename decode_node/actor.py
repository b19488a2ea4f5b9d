"""Ray actor around :class:`DecodeWorker`: a loop thread commits finished transfers and steps the decode batch;
the front-end long-polls :meth:`DecodeActor.poll`, which returns every token produced since the last poll, for all
requests, in one message (never one call per token per request).

Methods take and return msgpack ``bytes`` (:mod:`cluster.messages`).
"""

from __future__ import annotations

import logging
import threading
import time

from cluster import messages
from cluster.worker_actor import WorkerActorBase
from decode_node.worker import DecodeWorker
from engine import EngineConfig
from engine.errors import DuetError
from kv_transfer import get_manager_class

logger = logging.getLogger(__name__)


class DecodeActor(WorkerActorBase):
    role = "decode"

    def __init__(self, worker_id: str, model_dir: str, engine_config: dict, transport: str, *,
                 num_threads: int = 1, lease_base_s: float = 5.0, lease_min_rate_bps: float = 50e6,
                 compression: dict | None = None) -> None:
        self._init_common(worker_id, num_threads)
        self.manager = get_manager_class(transport)(worker_id=worker_id)
        self.worker = DecodeWorker(model_dir, EngineConfig(**engine_config), self.manager, lease_base_s=lease_base_s,
                                   lease_min_rate_bps=lease_min_rate_bps, compression=compression)
        self.cond = threading.Condition()
        self.pending: list[dict] = []  # token deltas and failures not yet polled
        self.sent: dict[str, int] = {}  # tokens already reported per request
        self._start()

    def allocate(self, msg: bytes) -> bytes:
        try:
            m = messages.unpack(msg)
            with self.lock:
                lease = self.worker.allocate(m["request_id"], messages.prompt_from_wire(m["prompt"]),
                                             messages.params_from_dict(m["params"]))
                self.sent[m["request_id"]] = 0
        except (DuetError, ValueError, KeyError) as e:
            return messages.error_reply(e)
        return messages.pack(lease=lease.to_dict(), free_blocks=self.worker.free_blocks)

    def abort(self, request_id: str) -> bool:
        with self.lock:
            self.sent.pop(request_id, None)
            return self.worker.abort(request_id)

    def poll(self, timeout_s: float = 0.05) -> bytes:
        """Everything produced since the last poll: ``{"events": [...], "free_blocks": n}``; waits up to
        ``timeout_s`` for the first event."""
        deadline = time.monotonic() + max(0.0, min(timeout_s, 5.0))
        with self.cond:
            while not self.pending and not self.stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            events, self.pending = self.pending, []
        return messages.pack(events=events, free_blocks=self.worker.free_blocks)

    def stats(self) -> bytes:
        with self.lock:
            e = self.worker.engine
            return messages.pack(worker_id=self.worker_id, free_blocks=self.worker.free_blocks,
                                 receiving=len(self.worker.receivers), running=len(e.scheduler.running))

    def shutdown(self) -> None:
        self.stopped = True
        with self.cond:
            self.cond.notify_all()
        self.thread.join(timeout=5)
        self.manager.close()

    def _loop(self) -> None:
        while not self.stopped:
            with self.lock:
                decoding = self.worker.engine.has_unfinished_requests()
                events = self._step() if decoding or self.worker.receivers else []
            if events:
                with self.cond:
                    self.pending.extend(events)
                    self.cond.notify_all()
            if not decoding:
                # Only transfers in flight (or nothing): poll them every 2 ms instead of spinning, which would
                # starve the transport's receive thread of the GIL and slow every transfer ~100x.
                time.sleep(0.002)

    def _step(self) -> list[dict]:
        try:
            report = self.worker.step()
        except Exception as e:  # fail the batch rather than the worker
            logger.exception("decode step failed")
            failed = list(self.worker.engine.requests)
            for rid in failed:
                self.worker.abort(rid, "decode step failed")
            return [{"request_id": rid, "failed": f"decode step failed: {e}"} for rid in failed]
        events = [{"request_id": rid, "failed": why} for rid, why in report.failed.items()]
        for rid in report.failed:
            self.sent.pop(rid, None)
        for out in report.outputs:
            rid = out.request_id
            ids = out.outputs[0].token_ids
            start = self.sent.get(rid, 0)
            ev = {"request_id": rid, "token_ids": ids[start:], "finished": out.finished,
                  "finish_reason": out.outputs[0].finish_reason}
            if rid in report.routing_hints:
                ev["expert_hist"] = report.routing_hints[rid]
            if rid in report.transfers:
                ev["kv_transfer"] = report.transfers[rid]
            events.append(ev)
            if out.finished:
                self.sent.pop(rid, None)
            else:
                self.sent[rid] = len(ids)
        return events
