"""Interleaved multimodal RoPE (M-RoPE) of the Qwen3-VL families.

Every token has three position ids (temporal, height, width). Text tokens have the same id in all three rows; the
tokens of an image of merged grid ``(t, h, w)`` that starts at text position ``p`` get ``(p + t_i, p + h_i, p + w_i)``
over the grid, and the text after it continues at ``p + max(h, w)`` (:func:`rope_index`, as transformers'
``get_rope_index`` assigns them). Generated token ``i`` (0-based index in the whole sequence) has position
``i + delta`` in all rows, with ``delta = max(prompt positions) + 1 - prompt length`` (``<= 0``): the decode side of
a disaggregated request needs only ``delta`` to continue.

Frequency pair ``j`` of a head (``j < head_dim / 2``) rotates by the height row when ``j % 3 == 1`` and
``j < 3 * mrope_section[1]``, by the width row when ``j % 3 == 2`` and ``j < 3 * mrope_section[2]``, and by the
temporal row otherwise (``mrope_interleaved``, the layout of every released Qwen3-VL checkpoint).
"""

from __future__ import annotations

import numpy as np
import torch


def rope_index(token_ids: list[int] | np.ndarray, image_token_id: int, grids: np.ndarray, merge: int
               ) -> tuple[np.ndarray, int]:
    """Prompt positions ``[3, L]`` int64 and the generation delta.

    ``grids`` is ``[N, 3]`` (patch grid ``t, h, w`` per image, in prompt order). Each maximal run of
    ``image_token_id`` must hold exactly one image's ``t * h * w / merge**2`` tokens (callers validate that first).
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    n = len(ids)
    pos = np.empty((3, n), dtype=np.int64)
    is_img = ids == image_token_id
    starts = np.flatnonzero(is_img & ~np.r_[False, is_img[:-1]])
    cur, i = 0, 0  # next text position, next token index
    for img, s in enumerate(starts):
        pos[:, i:s] = np.arange(cur, cur + s - i)
        cur += s - i
        t, h, w = (int(x) for x in grids[img])
        h, w = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        k = t * h * w
        pos[0, s:s + k] = tt.ravel() + cur
        pos[1, s:s + k] = hh.ravel() + cur
        pos[2, s:s + k] = ww.ravel() + cur
        cur += max(h, w)
        i = s + k
    pos[:, i:] = np.arange(cur, cur + n - i)
    delta = int(pos.max()) + 1 - n if n else 0
    return pos, delta


def positions(prompt: np.ndarray | None, delta: int, start: int, n: int) -> np.ndarray:
    """``[3, n]`` positions of sequence indices ``[start, start + n)``: the prompt's own where it has them, then
    ``index + delta``."""
    out = np.empty((3, n), dtype=np.int64)
    p = 0 if prompt is None else prompt.shape[1]
    k = max(0, min(n, p - start))
    if k:
        out[:, :k] = prompt[:, start:start + k]
    out[:, k:] = np.arange(start + k, start + n) + delta
    return out


class MRotaryEmbedding:
    """Tables of interleaved M-RoPE, float32, for positions ``< max_len``.

    ``tables(pos [3, T])`` returns ``cos`` and signed ``sin`` ``[T, 1, head_dim]`` for
    :func:`engine.layers.apply_rotary` (the same contract as :class:`engine.layers.RotaryEmbedding`).
    """

    def __init__(self, head_dim: int, theta: float, max_len: int, section: tuple[int, int, int],
                 device: torch.device | str) -> None:
        half = head_dim // 2
        assert sum(section) == half, f"mrope_section {section} must sum to head_dim / 2 = {half}"
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [max_len, half]
        self.cos, self.sin = freqs.cos().to(device), freqs.sin().to(device)
        j = torch.arange(half)
        row = torch.zeros(half, dtype=torch.long)
        row[(j % 3 == 1) & (j < 3 * section[1])] = 1
        row[(j % 3 == 2) & (j < 3 * section[2])] = 2
        self.row = row.to(device)  # which position row rotates frequency pair j
        self.cols = torch.arange(half, device=device)
        self.half, self.max_len = half, max_len

    def tables(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """pos: [3, T] long -> (cos, signed sin), each [T, 1, head_dim] in ``dtype``."""
        sel = pos.index_select(0, self.row).t()  # [T, half]: the position each frequency pair rotates by
        cos, sin = self.cos[sel, self.cols], self.sin[sel, self.cols]
        cos = torch.cat((cos, cos), dim=-1)
        sin_signed = torch.cat((-sin, sin), dim=-1)
        return cos.to(dtype).unsqueeze(1), sin_signed.to(dtype).unsqueeze(1)
