"""What a prefill worker keeps per request: one :class:`PrefillRequest`.

The records live in one dict, ``PrefillWorker.requests``: a request's is added by ``submit`` and popped when its
``finish`` frame is sent (``step``) or it is aborted (``abort``, which also ends its transfer); nothing else about a
request is kept beside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.sequence import Sequence
from kv_transfer import KVSender


@dataclass
class PrefillRequest:
    """One request on a prefill worker, from ``submit`` until its ``finish`` frame is sent or it is aborted.

    Written only on the engine's thread (the worker's ``step`` and its KV exporter, which the engine calls in it).
    """

    sender: KVSender  # where its KV goes (the lease of the decode worker that preallocated it)
    seq: Sequence  # the engine's sequence (choice 0; the worker never forks)
    held: list[Callable[[], None]] = field(default_factory=list)  # KV / state sends held until the step ends
    compute_done_s: float | None = None  # wall time the last layer's KV was computed
    compute_done_pc: float | None = None  # the same moment on the engine's clock (time.perf_counter: stages)
    visual: torch.Tensor | None = None  # [num_prompt_tokens] bool, image-token positions; see visual_mask
    export_error: str | None = None  # its KV export raised (engine.isolation.describe): it is dropped after the step

    def visual_mask(self, device: torch.device) -> torch.Tensor:
        """The prompt positions that are image tokens (the codec's mask): built on first use, once per request
        rather than per layer."""
        if self.visual is None:
            self.visual = torch.zeros(self.seq.num_prompt_tokens, dtype=torch.bool, device=device)
            if self.seq.mm is not None:
                self.visual[torch.from_numpy(self.seq.mm.positions).to(device)] = True
        return self.visual

    def stages(self) -> dict[str, float]:
        """Where this worker's time went for the request, in seconds (the hand-off's ``stages``): the vision-tower
        calls it waited for (``vision_encode_s``); the rest of submit -> first scheduled (``prefill_queue_s``) and of
        first scheduled -> last layer computed (``prefill_compute_s``)."""
        m = self.seq.metrics
        start = m.first_scheduled_time if m.first_scheduled_time is not None else m.arrival_time
        done = self.compute_done_pc if self.compute_done_pc is not None else time.perf_counter()
        ahead = m.vision_s if m.vision_ahead else 0.0  # the vision stage ran before it was first scheduled
        return {"prefill_queue_s": max(0.0, start - m.arrival_time - ahead), "vision_encode_s": m.vision_s,
                "prefill_compute_s": max(0.0, done - start - (m.vision_s - ahead))}
