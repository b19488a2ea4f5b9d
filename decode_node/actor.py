"""Ray actor around :class:`DecodeWorker`: a loop thread commits finished transfers and steps the decode batch;
the front-end long-polls :meth:`DecodeActor.poll`, which returns every event produced since the last poll, for all
requests, in one message (never one call per token per request): ``{"events": [wire map, ...], "free_blocks": n}``.
The events are :class:`~node_common.events.TokenEvent` and :class:`~node_common.events.RequestFailed`, typed and
versioned (:mod:`node_common.events` documents the wire; a consumer reads it with ``event_from_wire``).

Methods take and return msgpack ``bytes`` (:mod:`node_common.messages`).

Expert-parallel workers (``expert_parallel`` set) start their loop only once the group is formed: the cluster
(:func:`cluster.control.expert_groups.form_group`) calls :meth:`DecodeActor.ep_host` on rank 0, then
:meth:`DecodeActor.ep_join` on every rank at once. Their loop runs one group tick per iteration
(:meth:`decode_node.worker.DecodeWorker.group_step`); a shutdown of any rank stops the whole group at the same tick.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from decode_node.expert_group import ExpertGroup, host_store
from decode_node.expert_parallel import ExpertParallelConfig
from decode_node.expert_slots import SlotTable
from decode_node.expert_tiers import TierConfig
from decode_node.worker import DecodeWorker
from engine import EngineConfig
from engine.errors import DuetError
from kv_transfer import DEFAULT_LEASE, ClusterSecret, LeasePolicy, get_manager_class
from node_common import messages, prompt_wire
from node_common.core_share import BusyBoard, CoreShare
from node_common.events import DecodeEvent, RequestFailed, TokenEvent
from node_common.lane import LaneServer
from node_common.worker_actor import WorkerActorBase

logger = logging.getLogger(__name__)

HANDOFF_S = 0.02  # the longest a step keeps to num_threads while an urgent event is on its way to the front-end
PICKUP_S = 0.002  # the longest the loop waits for a waiting poll to take an urgent event before its next step


class DecodeActor(WorkerActorBase):
    role = "decode"

    def __init__(self, worker_id: str, model_dir: str, engine_config: dict, transport: str, *,
                 num_threads: int = 1, cpus: list[int] | None = None, lease_base_s: float = DEFAULT_LEASE.base_s,
                 lease_min_rate_bps: float = DEFAULT_LEASE.min_rate_bps,
                 compression: dict | None = None, expert_parallel: dict | None = None,
                 expert_tiers: dict | None = None, secret: ClusterSecret | None = None,
                 insecure: bool = False, max_threads: int = 0, busy_board: str | None = None) -> None:
        self._init_common(worker_id, num_threads, cpus)
        # max_threads > num_threads (a node whose cores the workers share): a step may take up to that many threads,
        # as many as the rest of the machine leaves free (node_common.core_share) -- a step that prefills a prompt
        # admitted here (admit_local) always, a decode step while no prefill worker on busy_board (a directory:
        # node_common.core_share.BusyBoard) has work, so a prefill never waits for cores decode took; else
        # num_threads, like every step
        self.max_threads = max_threads
        self._board = None if busy_board is None else BusyBoard(busy_board)
        self.local_steps = 0  # steps that prefilled a prompt admitted here
        self.wide_steps = 0  # steps run on more than num_threads threads
        # secret: the cluster's data-plane key, a constructor argument pickled by Ray; without one a cross-process
        # transport refuses to start (MissingSecret) unless insecure (data_plane_auth "off") says so
        self.manager = get_manager_class(transport)(worker_id=worker_id, secret=secret, insecure=insecure)
        ep = None if expert_parallel is None else ExpertParallelConfig(**expert_parallel)
        self._build(lambda: DecodeWorker(model_dir, EngineConfig(**engine_config), self.manager,
                                         lease=LeasePolicy(lease_base_s, lease_min_rate_bps), compression=compression,
                                         expert_parallel=ep,
                                         expert_tiers=None if expert_tiers is None else TierConfig(**expert_tiers)))
        self.cond = threading.Condition()
        self.wake = threading.Event()  # set by allocate: an idle loop sleeps on it instead of polling
        self.worker.on_transfer_done = lambda: self.wake.set()  # ... and by a transfer that landed (commit it now)
        self.pending: list[DecodeEvent] = []  # token deltas and failures not yet polled
        self._urgent = False  # pending holds an event a poll returns at once (see poll's coalesce_s)
        self._intake: list = []  # requests admit_local checked, for the loop to add before its next step
        self._intake_lock = threading.Lock()
        self._replied_at = 0.0  # when the last poll replied (time.monotonic())
        # until when (time.monotonic()) steps keep to num_threads: an urgent event (a first token, an end) is on its way
        # to the front-end, whose process needs a core to take it; set on publishing one, cleared when the front-end
        # polls again (it has taken it). Served text TTFT, 2 cores, serve-peer text workload: 33.9 -> 31.7 ms.
        self._handoff_until = 0.0
        self._handed = False  # the last reply carried an urgent event
        self._pickup_due = False  # an urgent event was published since the loop last waited for a poll to take one
        self.epoch = 0  # the front-end generation served (reset); polls of another get nothing
        self._store = None  # rank 0 of an expert-parallel group hosts the rendezvous store
        self._lane: LaneServer | None = None  # the front-end's loopback lane (lane), opened on its first ask
        self._lane_lock = threading.Lock()
        if ep is None:
            self._start()

    # ------------------------------------------------------------------------------------ expert-parallel group
    def ep_host(self, host: str = "127.0.0.1") -> bytes:
        """Rank 0: host the group's rendezvous store on a free port of ``host`` ("auto": this node's IP); returns
        ``{"host", "port"}``."""
        if host == "auto":
            import ray

            host = ray.util.get_node_ip_address()
        self._store = host_store(host, self.worker.ep.config.timeout_s)
        return messages.pack(host=host, port=self._store.port)

    def ep_join(self, host: str, port: int, group_key: str) -> bytes:
        """Join the group (returns once every rank joined, or an error reply at the deadline), then start the loop."""
        ep = self.worker.ep
        bind = host
        if not host.startswith("127."):  # another node's store: this rank's sockets bind its own address
            import ray

            bind = ray.util.get_node_ip_address()
        try:
            group = ExpertGroup(host=host, port=port, rank=ep.rank, world=ep.config.world, group_key=group_key,
                                device=self.worker.engine.device, timeout_s=ep.config.timeout_s, bind=bind)
        except DuetError as e:
            return messages.error_reply(e)
        ep.join(group)
        self._start()
        return messages.pack(rank=ep.rank)

    def apply_placement(self, msg: bytes) -> bytes:
        """Stage a new placement (``{"placement": SlotTable wire map}``); the group switches once all ranks staged
        it. Returns at once with ``{"staged_version"}`` (the version loaded so far)."""
        try:
            table = SlotTable.from_wire(messages.unpack(msg)["placement"])
            with self.lock:
                self.worker.ep.apply_placement(table)
        except messages.REPLY_ERRORS as e:
            return messages.error_reply(e)
        return messages.pack(staged_version=self.worker.ep.shard.staged_version)

    def allocate(self, msg: bytes) -> bytes:
        """``{request_id, prompt, params, start_by_s?}`` -> ``{lease, free_blocks}`` (``start_by_s``: the request's
        deadline, wall time; the lease's clock then starts with the transfer: :mod:`kv_transfer.lease`)."""
        try:
            m = messages.unpack(msg)
            with self.lock:
                lease = self.worker.allocate(m["request_id"], prompt_wire.prompt_from_wire(m["prompt"]),
                                             messages.params_from_dict(m["params"]), start_by_s=m.get("start_by_s"))
        except messages.REPLY_ERRORS as e:
            return messages.error_reply(e)
        self.wake.set()
        return messages.pack(lease=lease.to_dict(), free_blocks=self.worker.free_blocks)

    def admit_local(self, msg: bytes) -> bytes:
        """``{request_id, prompt, params}`` -> ``{free_blocks}``: prefill this text prompt here and decode it
        (:meth:`decode_node.worker.DecodeWorker.admit_local`); a typed error reply leaves nothing behind. The request
        is checked here, on the caller's thread, and joins the batch before the loop's next step: the reply does not
        wait for the step in progress (a local prefill's step is tens of ms on a small host)."""
        try:
            m = messages.unpack(msg)
            seq = self.worker.check_local(m["request_id"], prompt_wire.prompt_from_wire(m["prompt"]),
                                          messages.params_from_dict(m["params"]))
        except messages.REPLY_ERRORS as e:
            return messages.error_reply(e)
        with self._intake_lock:
            self._intake.append(seq)
        self.wake.set()
        return messages.pack(free_blocks=self.worker.free_blocks)

    def abort(self, request_id: str) -> bool:
        with self._intake_lock:  # not yet in the batch: it never joins it
            kept = [q for q in self._intake if q.request_id != request_id]
            dropped, self._intake = len(kept) < len(self._intake), kept
        if dropped:
            return True
        with self.lock:
            return self.worker.abort(request_id)

    def _take_intake(self) -> None:
        """Requests admitted since the last step join the batch (loop thread, under the lock); one that cannot (its
        id taken meanwhile) fails as its own fault."""
        with self._intake_lock:
            seqs, self._intake = self._intake, []
        for seq in seqs:
            try:
                self.worker.add_local(seq)
            except DuetError as e:
                self._publish([RequestFailed(seq.request_id, f"{type(e).__name__}: {e}", retryable=False)])

    def reset(self, reason: str) -> bytes:
        """A new front-end took this worker over (:mod:`cluster.control.reattach`): every request of the old one
        ends (its blocks freed), the events nobody polled are dropped, and the epoch polls must carry moves on (a
        poll the old front-end left in flight returns empty). ``{"ended", "epoch"}``."""
        with self._intake_lock:
            self._intake = []
        with self.lock:
            ended = len(self.worker.fail_all(reason).events)
            with self.cond:
                self.pending = []
                self.epoch += 1
                self.cond.notify_all()
            return messages.pack(ended=ended, epoch=self.epoch)

    def poll(self, timeout_s: float = 0.05, epoch: int = 0, coalesce_s: float = 0.0) -> bytes:
        """Everything produced since the last poll: ``{"events": [event wire map, ...], "free_blocks": n}``
        (:mod:`node_common.events`); waits up to ``timeout_s`` for the first event. ``epoch``: the poller's front-end
        generation (:meth:`reset`); a poll of an older one gets no events. ``coalesce_s``: when what is pending is
        only further tokens of running requests, the reply waits until that long after the previous poll's reply, so
        one reply carries several steps' tokens (a first token, an end or a failure goes at once): a poll per decode
        step costs the step itself, on a host where the front-end and the decode worker share the cores (a 2.3 ms
        step took 4.4 ms polled per step, 2.7 ms polled every 20 ms)."""
        deadline = time.monotonic() + max(0.0, min(timeout_s, 5.0))
        with self.cond:
            if self._handed and not self._urgent:  # the front-end is back: it has what the last reply carried
                self._handoff_until = 0.0
            self._handed = False
            while not self.pending and not self.stopped and epoch == self.epoch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            hold = self._replied_at + min(max(0.0, coalesce_s), 0.1)
            while self.pending and not self._urgent and not self.stopped and epoch == self.epoch:
                left = hold - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            events = []
            if epoch == self.epoch:
                self._handed = self._urgent
                events, self.pending, self._urgent = self.pending, [], False
            self._replied_at = time.monotonic()
        return messages.pack(events=[ev.to_wire() for ev in events], free_blocks=self.worker.free_blocks)

    def lane(self) -> bytes:
        """Open (once) this worker's loopback lane (:mod:`node_common.lane`): ``{host, port, token, node_ip}``. Over
        it the front-end receives what :meth:`poll` returns, pushed as it is produced, and calls :meth:`admit_local`
        and :meth:`allocate`;
        a front-end on another node (``node_ip`` not its own) keeps to Ray."""
        import ray

        with self._lane_lock:
            if self._lane is None:
                self._lane = LaneServer(self._lane_events, {"admit_local": self.admit_local,
                                                            "allocate": self.allocate})
            lane = self._lane
        return messages.pack(host=lane.host, port=lane.port, token=lane.token,
                             node_ip=ray.util.get_node_ip_address())

    def _lane_events(self, hello: dict) -> bytes | None:
        """The lane's next push: a poll of the hello's epoch, or None once that generation is over."""
        epoch = hello.get("epoch", 0)
        if self.stopped or epoch != self.epoch:
            return None
        return self.poll(float(hello.get("poll_s", 1.0)), epoch, float(hello.get("coalesce_s", 0.0)))

    def stats(self) -> bytes:
        with self.lock:
            e = self.worker.engine
            experts = None if self.worker.ep is None else self.worker.ep.stats()
            tiers = None if self.worker.tiers is None else self.worker.tiers.summary()
            kv = e.kv_memory()
            return messages.pack(worker_id=self.worker_id, free_blocks=self.worker.free_blocks,
                                 max_model_len=e.max_model_len, receiving=self.worker.receiving,
                                 kv_pool_bytes=kv.pool_bytes, kv_mirror_bytes=kv.mirror_bytes,
                                 kv_state_bytes=kv.state_bytes, running=len(e.scheduler.running),
                                 kv_text_bytes=kv.text_kv_bytes, kv_visual_bytes=kv.visual_kv_bytes,
                                 step_s=self.worker.step_s, cpu_s=time.process_time(),
                                 local_steps=self.local_steps, wide_steps=self.wide_steps, nice=self.nice,
                                 experts=experts, expert_tiers=tiers, kv_refused=self.manager.refused(),
                                 kv_endpoint=self.manager.endpoint, stopped=self.stopped)

    def shutdown(self) -> None:
        self.stopped = True
        self.wake.set()
        with self.cond:
            self.cond.notify_all()
        self._go.set()  # a group member stopped before it joined: its loop thread ends without looping
        self.thread.join(timeout=5)
        if self._lane is not None:
            self._lane.close()
        if self.worker.tiers is not None:
            self.worker.tiers.close()
        self.manager.close()

    def _loop(self) -> None:
        if self.worker.ep is not None:
            return self._group_loop()
        # with a board: every step widens while no prefill worker on it has work (what they say they need, not what
        # they managed to run: a prefill worker below decode in priority looks idle when decode took its cores);
        # without one, only a step that prefills a prompt admitted here, on the cores the others left free lately
        widen = self.max_threads > self.num_threads
        share = CoreShare(self.max_threads) if widen and self._board is None else None
        threads = self.num_threads
        while not self.stopped:
            with self.lock:
                if self._intake:
                    self._take_intake()
                decoding = self.worker.engine.has_unfinished_requests()
                local = decoding and self.worker.local_prefilling
                self.local_steps += local
                if widen and decoding:
                    if self._board is not None:
                        want = self.num_threads if self._board.any_busy() else self.max_threads
                    else:
                        free = share.threads()  # read every decoding turn: the window is the last few steps
                        want = max(self.num_threads, free) if local else self.num_threads
                    if want > self.num_threads and time.monotonic() < self._handoff_until:
                        want = self.num_threads
                    if want != threads:
                        threads = want
                        torch.set_num_threads(want)
                    self.wide_steps += threads > self.num_threads
                events = self._step() if decoding or self.worker.receiving else []
                # a transfer this step committed is decoding now: the loop must not sleep as if it were idle (it
                # slept up to 50 ms before a received request's second decode step)
                decoding = self.worker.engine.has_unfinished_requests()
            self._publish(events)
            self.lock.give_way()  # an allocate or abort that waited for this step goes before the next one
            self._await_pickup()
            if not decoding and self.worker.receiving:
                # Only transfers in flight: poll them every 2 ms instead of spinning, which would starve the
                # transport's receive thread of the GIL and slow every transfer ~100x; one that lands wakes it.
                self.wake.wait(0.002)
                self.wake.clear()
            elif not decoding:  # nothing at all: sleep until a request is allocated (2.5% of a core polling)
                self.wake.wait(0.05)
                self.wake.clear()

    def _await_pickup(self) -> None:
        """An urgent event just published goes to the poll waiting for it before the next step starts: that poll's
        thread needs the interpreter lock, which the step's Python holds between kernels (served text TTFT, 2 cores:
        35.1 against 37.0 ms without). At most :data:`PICKUP_S`: a front-end that is not polling does not stall
        decoding."""
        if not self._pickup_due:  # read without the lock (set under it by _publish, cleared only here)
            return
        with self.cond:
            self._pickup_due = False
            if self._urgent:
                self.cond.wait_for(lambda: not self._urgent or self.stopped, timeout=PICKUP_S)

    def _group_loop(self) -> None:
        """One group tick per iteration until the group agrees to stop (any rank's shutdown)."""
        while True:
            with self.lock:
                report, plan = self.worker.group_step(stop=self.stopped)
                events = report.events
            self._publish(events)
            self.lock.give_way()
            if plan is not None and plan.stop:
                break
            if plan is None and self.stopped:
                break
            if plan is None or not plan.any_work:
                time.sleep(0.002)  # nothing to decode anywhere: poll transfers, do not spin (see _loop)
        self.stopped = True
        with self.cond:
            self.cond.notify_all()

    def _publish(self, events: list[DecodeEvent]) -> None:
        if events:
            with self.cond:
                self.pending.extend(events)
                if any(_urgent(ev) for ev in events):
                    self._handoff_until = time.monotonic() + HANDOFF_S
                    self._urgent = self._pickup_due = True
                self.cond.notify_all()

    def _step(self) -> list[DecodeEvent]:
        try:
            return self.worker.step(publish=self._publish).events  # first tokens go out before the step
        except Exception as e:  # fail the batch rather than the worker
            logger.exception("decode step failed")
            return self.worker.fail_all(f"decode step failed: {e}").events


def _urgent(ev: DecodeEvent) -> bool:
    """An event a poll never holds back: a failure, a request's end, or its first token (the one that carries
    ``kv_transfer``; a request admitted here reports it too)."""
    return not isinstance(ev, TokenEvent) or ev.finished or ev.kv_transfer is not None
