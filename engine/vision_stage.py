"""The vision stage (``EngineConfig.vision_slice_s``): prompts whose images are still being encoded, ahead of the
scheduler.

:meth:`LLMEngine.add_request <engine.llm_engine.LLMEngine.add_request>` puts a Qwen3-VL prompt with images here
instead of in the scheduler; at the start of each step :meth:`VisionStage.advance` runs the vision tower for about one
slice (whole tower blocks, at least one: :meth:`ModelRunner.advance_vision
<engine.model_runner.ModelRunner.advance_vision>`), oldest prompt first, and each prompt whose images are all encoded
joins the scheduler. A prompt without images to encode never waits here, so it passes the images being encoded.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence


class VisionStage:
    """Prompts waiting for their image encodings, oldest first (see the module docstring)."""

    def __init__(self, runner: ModelRunner, slice_s: float | None) -> None:
        self.runner, self.slice_s = runner, slice_s
        self.queue: deque[Sequence] = deque()

    def __bool__(self) -> bool:
        return bool(self.queue)

    def __len__(self) -> int:
        return len(self.queue)

    def takes(self, seq: Sequence, is_qwen_vl: bool) -> bool:
        """Whether ``seq`` waits here: slicing is on and it is a Qwen3-VL prompt with images."""
        return self.slice_s is not None and seq.mm is not None and is_qwen_vl

    def add(self, seq: Sequence) -> None:
        seq.metrics.vision_ahead = True
        self.queue.append(seq)

    def remove(self, seq: Sequence) -> bool:
        """Take ``seq`` out (an abort) and drop its tower call in progress; False when it is not here."""
        if seq not in self.queue:
            return False
        self.queue.remove(seq)
        self.runner.drop_vision(seq)
        return True

    def advance(self, scheduler: Scheduler) -> None:
        """Encode for about one slice, oldest prompt first; the prompts done join ``scheduler``."""
        deadline = time.perf_counter() + self.slice_s
        while self.queue:
            seq = self.queue[0]
            if not self.runner.advance_vision(seq, deadline):
                return
            self.queue.popleft()
            scheduler.add(seq)
            if time.perf_counter() >= deadline:
                return
