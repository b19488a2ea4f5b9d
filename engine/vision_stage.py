"""The vision stage (``EngineConfig.vision_slice_s``): prompts whose images are still being encoded, ahead of the
scheduler.

:meth:`LLMEngine.add_request <engine.llm_engine.LLMEngine.add_request>` puts a Qwen3-VL prompt with images here
instead of in the scheduler; every other engine step (:meth:`VisionStage.take_turn`; every step when the scheduler has
nothing to do) runs the vision tower for about one slice, oldest prompt first, and each prompt whose images are all
encoded joins the scheduler. A prompt without images
to encode never waits here, so it passes the images being encoded.

The tower runs in pieces of ``VISION_SLICE_ROWS`` output rows of one block (:meth:`QwenVisionTower.advance
<engine.models.qwen3_vl.vision.QwenVisionTower.advance>`: a block's keys and values first, then its rows), at least one
piece per step, until the slice's time is spent. A 1024x1024 image (4,096 patches) takes ~0.3 s a block on one core
of this kind, so a slice is ~40 ms of work rather than a whole block.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from engine.workspace import VISION_SLICE_ROWS, workspace_groups

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner
    from engine.scheduler import Scheduler
    from engine.sequence import Sequence



class VisionStage:
    """Prompts waiting for their image encodings, oldest first (see the module docstring)."""

    def __init__(self, runner: ModelRunner, slice_s: float | None) -> None:
        self.runner, self.slice_s = runner, slice_s
        self.queue: deque[Sequence] = deque()
        # seq id -> {"groups": its images still to encode, in tower calls; "call": the call in progress; "cached":
        # its images encoded or cached when it started (taken then, so KV reclaiming the cache's blocks meanwhile
        # does not send them to the tower again)}
        self.jobs: dict[int, dict[str, Any]] = {}
        self._turn = True  # the next step with work on both sides is a slice here

    def __bool__(self) -> bool:
        return bool(self.queue)

    def __len__(self) -> int:
        return len(self.queue)

    def takes(self, seq: Sequence) -> bool:
        """Whether ``seq`` waits here: slicing is on and it is a Qwen3-VL prompt with images."""
        return self.slice_s is not None and seq.mm is not None and self.runner.model.cfg.is_qwen_vl

    def add(self, seq: Sequence) -> None:
        seq.metrics.vision_ahead = True
        self.queue.append(seq)

    def remove(self, seq: Sequence) -> bool:
        """Take ``seq`` out (an abort) and drop its tower call in progress; False when it is not here."""
        if seq not in self.queue:
            return False
        self.queue.remove(seq)
        self.jobs.pop(seq.seq_id, None)
        return True

    def take_turn(self, scheduler: Scheduler) -> bool:
        """Whether this engine step is the stage's (it then advanced): while the scheduler has work too, steps
        alternate between a slice here and a scheduler step, so a prompt ready for the language model waits at most one
        slice, and images are not starved by a stream of text."""
        if not self.queue:
            return False
        if scheduler.has_unfinished() and not self._turn:
            self._turn = True
            return False
        self._turn = False
        self.advance(scheduler)
        return True

    def advance(self, scheduler: Scheduler) -> None:
        """Encode for about one slice, oldest prompt first; the prompts done join ``scheduler``."""
        deadline = time.perf_counter() + self.slice_s
        while self.queue:
            seq = self.queue[0]
            if not self._encode(seq, deadline):
                return
            self.queue.popleft()
            scheduler.add(seq)
            if time.perf_counter() >= deadline:
                return

    def _encode(self, seq: Sequence, deadline: float) -> bool:
        """Advance ``seq``'s images not cached yet until ``deadline`` (at least one piece); True once its features
        are set. Its images go through the tower in calls that keep within the workspace
        (:func:`engine.workspace.workspace_groups`), one after the other. The tower's time counts in its
        ``metrics.vision_s``. An image another prompt is encoding now is encoded again (one prompt is advanced at a
        time, oldest first, so that is rare)."""
        runner, tower = self.runner, self.runner.model.vision
        job = self.jobs.get(seq.seq_id)
        if job is None:
            todo: dict[bytes, tuple[Sequence, int]] = {}
            for i, h in enumerate(seq.mm.image_hashes):
                if h not in runner.vision_cache and h not in todo:
                    todo[h] = (seq, i)
            if not todo:
                runner.encode_pending_images([seq])  # every image cached: sets its features
                return True
            cached = {h: e for h in seq.mm.image_hashes if h not in todo and (e := runner.vision_cache.get(h))}
            groups = workspace_groups(todo, runner.model.cfg, runner.workspace, runner.dtype.itemsize)
            job = self.jobs[seq.seq_id] = {"groups": groups, "call": None, "cached": cached}
        t0 = time.perf_counter()
        try:
            while True:
                if job["call"] is None:
                    job["call"] = tower.start(*runner.grid_inputs(job["groups"][0]))
                while not tower.advance(job["call"], rows=VISION_SLICE_ROWS):
                    if time.perf_counter() >= deadline:
                        return False
                feats, deepstack = tower.finish(job["call"])
                job["call"] = None
                done = job["groups"].pop(0)
                job["cached"].update(runner.cache_grid_features(done, feats, torch.stack(deepstack) if deepstack
                                                                else None))
                if not job["groups"]:
                    break
                if time.perf_counter() >= deadline:
                    return False
            del self.jobs[seq.seq_id]
        finally:
            seq.metrics.vision_s += time.perf_counter() - t0
        runner.encode_pending_images([seq], job["cached"])  # its images are all encoded now: sets its features
        return True
