"""The vision tower's workspace: what a tower call holds, the budget's reserve for it, and the tower calls a step's
images are split into so the reserve holds.

An engine with a tower keeps ``encoder_workspace_mb`` (default: :func:`encoder_reserve`) out of
``kv_cache_memory_gb`` before its pool is sized (:func:`engine.kv_budget.plan_pool`); its images are encoded in as
few tower calls as keep each call's workspace (:func:`workspace_bytes`) within that reserve
(:func:`workspace_groups`: the synchronous path, :meth:`engine.model_runner.ModelRunner.encode_pending_images`, and the
sliced one, :mod:`engine.vision_stage`), and a prompt with an image that alone needs more is refused
(:func:`check_workspace`, :class:`~engine.errors.RequestTooLargeError`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.errors import RequestTooLargeError
from engine.sequence import Sequence

VISION_SLICE_ROWS = 512  # tower output rows per piece (engine.vision_stage)
# [patches, vision hidden] tensors a tower call keeps alive at once: the hidden states, a block's q, k and v, its
# attention output and the kernel's transposed keys
WORKSPACE_ROWS = 6


def image_patches(cfg: Any, mm: Any, i: int) -> int:
    """Patches the vision tower sees for image ``i`` of ``mm`` (its Qwen grid, or a LLaVA tower's fixed count)."""
    return int(np.prod(mm.grid_thw[i])) if mm.grid_thw is not None else _fixed_patches(cfg.vision)


def _fixed_patches(v: Any) -> int:
    """A LLaVA tower's patches for its one image size (and its class token)."""
    return (v.image_size // v.patch_size) ** 2 + (1 if v.has_cls_token else 0)


def workspace_bytes(cfg: Any, patches: int, itemsize: int) -> int:
    """Bytes a tower call over ``patches`` patches holds at its peak (an estimate from its shapes): the
    :data:`WORKSPACE_ROWS` per-patch tensors, one MLP piece of intermediate rows, and the merged features with their
    DeepStack levels (Qwen3-VL) or the projected features (LLaVA)."""
    v = cfg.vision
    merge = getattr(v, "spatial_merge_size", 1)
    levels = len(getattr(v, "deepstack_visual_indexes", ()))
    rows = patches * v.hidden_size * WORKSPACE_ROWS + min(patches, VISION_SLICE_ROWS) * v.intermediate_size
    return itemsize * (rows + patches // (merge * merge) * cfg.text.hidden_size * (levels + 1))


def encoder_reserve(c: Any, cfg: Any, image_processor: Any, dtype: Any, tower: Any) -> int:
    """Bytes of the budget kept for the vision ``tower``'s workspace (``dtype`` activations): ``encoder_workspace_mb``,
    else a step's worth of images (``max_num_batched_tokens`` visual tokens' patches), at least one largest image
    (the processor's ``max_pixels``; a LLaVA tower's fixed size); 0 without a tower."""
    if tower is None or cfg.vision is None:
        return 0
    if c.encoder_workspace_mb is not None:
        return int(c.encoder_workspace_mb * 2**20)
    patch = getattr(image_processor, "patch_size", None)
    if getattr(image_processor, "max_pixels", None) and patch:  # Qwen3-VL: 2x2 patches merge into a token
        merge = cfg.vision.spatial_merge_size
        patches = max(image_processor.max_pixels // (patch * patch), c.max_num_batched_tokens * merge * merge)
    else:  # LLaVA: every image is one size
        one = _fixed_patches(cfg.vision)
        patches = one * max(1, c.max_num_batched_tokens // one)
    return workspace_bytes(cfg, patches, dtype.itemsize)


def check_workspace(seq: Sequence, cfg: Any, reserve: int, itemsize: int) -> None:
    """Raise :class:`RequestTooLargeError` when one of ``seq``'s images needs more tower workspace than ``reserve``
    (the images of a prompt are encoded in as many tower calls as the reserve needs, one image at least)."""
    if seq.mm is None or not reserve or seq.mm.pixel_values is None:
        return
    for i in range(len(seq.mm.image_hashes)):
        need = workspace_bytes(cfg, image_patches(cfg, seq.mm, i), itemsize)
        if need > reserve:
            raise RequestTooLargeError(
                f"request {seq.request_id!r}: image {i} ({image_patches(cfg, seq.mm, i)} patches) needs {need:,} "
                f"bytes of vision-tower workspace; this worker keeps {reserve:,} (encoder_workspace_mb) -- send a "
                "smaller image or raise encoder_workspace_mb")


def workspace_groups(todo: dict, cfg: Any, reserve: int, itemsize: int) -> list[dict]:
    """``todo`` (image hash -> (sequence, image index)) split, in order, into tower calls whose workspace stays within
    ``reserve`` (one image per call at least; one call when ``reserve`` is 0)."""
    groups: list[dict] = []
    used = 0
    for h, (s, i) in todo.items():
        patches = image_patches(cfg, s.mm, i)
        if not groups or (reserve and workspace_bytes(cfg, used + patches, itemsize) > reserve):
            groups.append({})
            used = 0
        groups[-1][h] = (s, i)
        used += patches
    return groups
