"""Continuous batching with chunked prefill and preemption.

Queues a request moves through: ``waiting`` (admitted, no blocks) -> ``running`` (holds blocks; prefilling in
chunks, then decoding one token per step) -> finished (blocks released). A request whose prompt KV another worker
computed (disaggregated decode) waits in ``prefilled`` (holding its blocks) until ``running`` has room: at most
``max_num_seqs`` sequences run at once, however many transfers complete together. Under block pressure the most recently
admitted running sequence is preempted: its blocks are freed (their hashes stay cached) and it returns to the front
of ``waiting`` to be recomputed, prompt plus tokens generated so far.

Each step spends at most ``max_num_batched_tokens``: running sequences first (decodes cost one token, a pending
prefill chunk as much as the budget allows), then new admissions. ``policy`` orders the admissions:

- ``fcfs``: arrival order.
- ``shortest``: fewest prompt tokens left first, and a prompt joins a step only if it is at most twice as long as
  the prompt tokens already in it. Every prompt of a step gets its first token at the step's end, so a short prompt
  batched with a long one waits for the long one; this policy gives short prompts steps of their own (meant for
  prefill workers, whose TTFT is their whole latency; a prompt that has waited ``max_wait_s`` goes first, in
  arrival order, so long prompts are never starved).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus

POLICIES = ("fcfs", "shortest")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens computed this step

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the sequence's tokens, so its next token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        """One token that samples (a one-token chunk in the middle of a prompt is a prefill)."""
        return self.num_tokens == 1 and self.samples


@dataclass
class SchedulerOutput:
    prefills: list[ScheduledSeq]  # prompt chunks: more than one token, or one token that does not sample
    decodes: list[ScheduledSeq]  # exactly one token each, and it samples (the runner gives every decode a logit row)
    preempted: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", max_wait_s: float = 10.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {list(POLICIES)}, got {policy!r}")
        self.bm = block_manager
        self.policy, self.max_wait_s = policy, max_wait_s
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefilled: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_prefilled(self, seq: Sequence) -> None:
        """A sequence that already holds its blocks and computed prompt; it joins ``running`` when there is room."""
        seq.status = SequenceStatus.RUNNING
        self.prefilled.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilled)

    def schedule(self) -> SchedulerOutput:
        while self.prefilled and len(self.running) < self.max_num_seqs:
            self.running.append(self.prefilled.popleft())
        budget = self.max_num_batched_tokens
        chosen: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.append_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                chosen.append(ScheduledSeq(seq, n))
                if seq.num_computed_tokens < seq.num_prompt_tokens:
                    self.bm.plan_snapshots(seq, n)
                budget -= n
                i += 1
        shortest = self.policy == "shortest"
        step_tokens = 0  # "shortest": prompt tokens already in the step
        if shortest and self.waiting:
            if len(self.waiting) > 1:
                self._order_shortest()
            step_tokens = sum(c.num_tokens for c in chosen if not c.is_decode)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            hits = self.bm.lookup_prefix(seq)
            n = min(seq.num_tokens - len(hits) * self.bm.block_size, budget)
            if shortest:
                if step_tokens and n > 2 * step_tokens:
                    break  # a much longer prompt: the shorter ones already in the step get it to themselves
                step_tokens += n
            if not self.bm.can_allocate(seq, hits, n):
                break
            self.waiting.popleft()
            self.bm.allocate_prefix(seq, hits)
            if not seq.metrics.first_scheduled_time:
                seq.num_cached_tokens = seq.num_computed_tokens
            ok = self.bm.append_slots(seq, n)
            assert ok, "can_allocate promised the blocks"
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen.append(ScheduledSeq(seq, n))
            self.bm.plan_snapshots(seq, n)
            budget -= n
        # A one-token chunk in the middle of a prompt (budget nearly spent) is a prefill: it must not sample.
        decodes = [s for s in chosen if s.is_decode]
        return SchedulerOutput(prefills=[s for s in chosen if not s.is_decode],
                               decodes=decodes, preempted=preempted)

    def _order_shortest(self) -> None:
        """Waiting sequences by prompt tokens left; those waiting ``max_wait_s`` or longer first, oldest first."""
        now = time.perf_counter()

        def key(q: Sequence) -> tuple[int, float]:
            if now - q.metrics.arrival_time >= self.max_wait_s:
                return 0, q.metrics.arrival_time
            return 1, q.num_tokens - q.num_computed_tokens

        self.waiting = deque(sorted(self.waiting, key=key))

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished and release its blocks; works in any queue."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.prefilled:
            self.prefilled.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
