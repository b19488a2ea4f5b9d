"""Ray actor around :class:`PrefillWorker`: a loop thread steps the engine; method calls only enqueue.

Methods take and return msgpack ``bytes`` (:mod:`node_common.messages`). Started by :class:`cluster.control.disagg.DisaggCluster` with
``ray.remote(num_cpus=..., num_gpus=...)`` and ``max_concurrency`` > 1 so calls never wait behind a step.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from engine import EngineConfig
from kv_transfer import ClusterSecret, Lease, get_manager_class
from node_common import messages, prompt_wire
from node_common.core_share import BusyBoard, CoreShare
from node_common.worker_actor import WorkerActorBase
from prefill_node.worker import PrefillWorker

logger = logging.getLogger(__name__)


class PrefillActor(WorkerActorBase):
    role = "prefill"

    def __init__(self, worker_id: str, model_dir: str, engine_config: dict, transport: str, *, num_threads: int = 1,
                 cpus: list[int] | None = None, nice: int = 0, adaptive_threads: bool = False, stream_layers: bool = True,
                 compression: dict | None = None, secret: ClusterSecret | None = None, insecure: bool = False,
                 kv_proxy: str | None = None, busy_board: str | None = None) -> None:
        self._init_common(worker_id, num_threads, cpus, nice)
        # busy_board: the node's board (node_common.core_share.BusyBoard) where this worker says whether it has
        # work, so the decode workers beside it leave it the cores it needs
        self._board = None if busy_board is None else BusyBoard(busy_board, worker_id)
        # adaptive_threads: a worker sharing its cores with decode workers (below them in priority) runs each step on
        # the threads they leave free (node_common.core_share); thread_changes counts the switches
        self.adaptive_threads, self.thread_changes = adaptive_threads and self.num_threads > 1, 0
        self._threads_now = self.num_threads  # the loop thread's OpenMP threads for its current step
        # secret: the cluster's data-plane key, a constructor argument pickled by Ray; without one a cross-process
        # transport refuses to start (MissingSecret) unless insecure (data_plane_auth "off") says so; kv_proxy: the spec's (validated against the transport's dials_through_proxy)
        via = {"proxy": kv_proxy} if kv_proxy else {}
        self.manager = get_manager_class(transport)(worker_id=worker_id, secret=secret, insecure=insecure, **via)
        self._build(lambda: PrefillWorker(model_dir, EngineConfig(**engine_config), stream_layers=stream_layers,
                                          compression=compression))
        self._images = self.worker.engine.image_processor  # resized images on the wire become pixels through it
        self.wake = threading.Event()
        self._start()

    def submit(self, msg: bytes) -> bytes:
        try:
            m = messages.unpack(msg)
            lease = Lease.from_dict(m["lease"])
            with self.lock:
                sender = self.manager.sender(lease, codec=self.worker.codec)
                try:
                    self.worker.submit(m["request_id"], prompt_wire.prompt_from_wire(m["prompt"], self._images),
                                       messages.params_from_dict(m["params"]), sender)
                except BaseException:
                    sender.abort("prefill rejected the request")
                    raise
                report = self.worker.take_report()  # the front-end's prefix index and the requests given up
        except messages.REPLY_ERRORS as e:
            return messages.error_reply(e)
        self.wake.set()
        return messages.pack(ok=True, **report)

    def abort(self, request_id: str) -> bool:
        with self.lock:
            return self.worker.abort(request_id)

    def reset(self, reason: str) -> bytes:
        """A new front-end took this worker over (:mod:`cluster.control.reattach`): every request of the old one
        ends (its transfer aborted, its blocks freed) and nothing it was told is kept. ``{"ended", "epoch"}`` (0:
        nothing polls a prefill worker)."""
        with self.lock:
            ended = self.worker.abort_all(reason)
            self.worker.take_report()
            return messages.pack(ended=ended, epoch=0)

    def report(self) -> bytes:
        """What changed since the last report (a submit reply or this: :meth:`PrefillWorker.take_report`): the
        front-end asks every second, so an eviction reaches its router and a request given up reaches its attempt
        even when no request comes here."""
        with self.lock:
            return messages.pack(**self.worker.take_report())

    def stats(self) -> bytes:
        with self.lock:
            e = self.worker.engine
            kv = e.kv_memory()
            return messages.pack(worker_id=self.worker_id, waiting=len(e.scheduler.waiting),
                                 running=len(e.scheduler.running), max_model_len=e.max_model_len,
                                 prompt_tokens=self.worker.prompt_tokens, cached_tokens=self.worker.cached_tokens,
                                 free_blocks=e.block_manager.num_free_blocks,
                                 kv_pool_bytes=kv.pool_bytes, kv_mirror_bytes=kv.mirror_bytes,
                                 kv_state_bytes=kv.state_bytes, vision_cache_bytes=kv.vision_cache_bytes,
                                 kv_text_bytes=kv.text_kv_bytes, kv_visual_bytes=kv.visual_kv_bytes,
                                 encoder_workspace_bytes=kv.workspace_bytes,
                                 vision_cache_entries=len(e.runner.vision_cache),
                                 prefix_cache_off=e.prefix_caching_off_reason,
                                 kv_refused=self.manager.refused(), kv_links_replaced=getattr(self.manager, "links_replaced", 0),
                                 cpu_s=time.process_time(),  # every thread's: compute, intake, KV sends
                                 threads=self._threads_now, thread_changes=self.thread_changes, nice=self.nice)

    def inject_fault(self, kind: str, value: float) -> None:
        """Tests only: ``layer_delay_s`` (seconds after each layer's compute) or ``corrupt_next`` (count)."""
        with self.lock:
            if kind == "layer_delay_s":
                self.worker.faults.layer_delay_s = float(value)
            elif kind == "corrupt_next":
                self.worker.faults.corrupt_next = int(value)
            else:
                raise ValueError(f"unknown fault {kind!r}")

    def shutdown(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=5)
        self.manager.close()
        if self._board is not None:
            self._board.close()

    def _loop(self) -> None:
        share = CoreShare(self.num_threads) if self.adaptive_threads else None
        while not self.stopped:
            with self.lock:
                busy = self.worker.has_work()
                if self._board is not None:
                    self._board.set(busy)
                if busy:
                    want = self._threads_now if share is None else share.threads()  # what the others left free
                    if want != self._threads_now:
                        self._threads_now = want
                        torch.set_num_threads(want)
                        self.thread_changes += 1
                    try:
                        self.worker.step()
                    except Exception:  # never let one bad step kill the worker; fail what was in flight
                        logger.exception("prefill step failed")
                        for rid in list(self.worker.requests):
                            self.worker.abort(rid, "prefill step failed")
            self.lock.give_way()  # a submit that waited for this step goes before the next one
            if not busy:
                if share is not None:
                    share.idle()
                self.wake.wait(0.05)
                self.wake.clear()
