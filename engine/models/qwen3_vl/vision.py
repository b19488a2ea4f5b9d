"""Qwen3-VL vision tower (dense and MoE checkpoints share it), with the patch merger and the DeepStack mergers.

``QwenVisionTower.forward(pixel_values, grid_thw) -> (merged, deepstack)`` reproduces transformers'
``Qwen3VLMoeVisionModel`` (``pooler_output`` and ``deepstack_features``):

1. patch embedding: the reference's Conv3d has kernel = stride = (T, p, p) over already-flattened patches, so it is
   one GEMM over ``pixel_values [P, C*T*p*p]`` with the 5-D weight viewed as ``[hidden, C*T*p*p]``;
2. learned position table (``side x side``) bilinearly resampled (align_corners) to each image's ``(h, w)`` grid;
3. 2-D axial RoPE: head_dim/4 frequencies per axis, laid out ``[h, w, h, w]``;
4. ``depth`` pre-norm blocks; attention never crosses a frame (the reference's ``cu_seqlens`` has one segment per
   frame, ``t`` per entry of ``grid_thw``), so several images in one call are encoded exactly as if alone;
5. ``merger`` (LayerNorm per patch, then merge² patches concatenated) and one ``deepstack_merger_list`` entry
   (concatenate, then LayerNorm) per block in ``deepstack_visual_indexes``.

Patches arrive in merge-window order (the image processor emits each ``merge x merge`` window contiguously), so
tables 2 and 3 are built in that order and merging is a plain ``view``. Parameter names equal transformers', so a
checkpoint's ``model.visual.X`` loads as ``X``; the tower has no buffers (RoPE frequencies are rebuilt per call).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import engine.cpu_kernels as cpu_kernels
from engine.attention import choose_prefill_kernel
from engine.layers import ACTIVATIONS, Linear, apply_rotary
from engine.models.qwen3_vl.config import QwenVisionConfig

# Reference state_dict keys this tower deliberately has no parameter for (none: the rotary inv_freq is non-persistent).
IGNORED_KEYS: tuple[str, ...] = ()


class PatchEmbed(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        # A Conv3d only so the weight keeps the checkpoint's 5-D shape; forward is the equivalent GEMM.
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.proj.weight.flatten(1), self.proj.bias)


class Attention(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size)
        self.kernel_from = 0  # frames of at least this many patches attend through the compiled kernel

    def pack_linears(self, make) -> list:
        """CPU kernel choice (:func:`engine.cpu_linear.pack_linears`): from which frame length a frame's attention
        runs through the compiled kernel (:func:`engine.cpu_kernels.prefill_attention`, full attention) instead of
        SDPA, measured at load; float32 in ``auto`` mode only."""
        if make.mode == "auto" and self.qkv.weight.dtype == torch.float32:
            self.kernel_from = choose_prefill_kernel(self.num_heads, self.num_heads, self.head_dim, causal=False)
        return []

    def _kernel(self, n: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> bool:
        """out [m, heads, head_dim] = q's m rows attending to a frame's n keys k, v (token-major views) through the
        compiled kernel, where it was chosen for frames of n patches and takes the layouts; False: not run."""
        if not 0 < self.kernel_from <= n or not cpu_kernels.prefill_attention_fits(q, k, v):
            return False
        cpu_kernels.prefill_attention(cpu_kernels.library(), q, k, v, self.head_dim ** -0.5, causal=False, out=out)
        return True

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                segments: list[tuple[int, int, int]]) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin_signed)
        h = self.num_heads
        out = []
        for start, frames, n in segments:  # `frames` frames of `n` tokens each, attended frame by frame
            o = torch.empty(frames * n, h, self.head_dim, dtype=x.dtype)
            if all(self._kernel(n, *(y[start + f * n:start + (f + 1) * n] for y in (q, k, v)), o[f * n:(f + 1) * n])
                   for f in range(frames)):
                out.append(o.view(frames * n, -1))
                continue
            # contiguous [frames, heads, n, head_dim]: the CPU flash kernel runs ~6% faster than on strided views
            q_, k_, v_ = (y[start:start + frames * n].view(frames, n, h, self.head_dim).transpose(1, 2).contiguous()
                          for y in (q, k, v))
            out.append(F.scaled_dot_product_attention(q_, k_, v_).transpose(1, 2).reshape(frames * n, -1))
        return self.proj(out[0] if len(out) == 1 else torch.cat(out))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[tokens, heads, head_dim]``, q and k rotated."""
        s, h = x.shape[0], self.num_heads
        qkv = self.qkv(x).view(s, 3, h, self.head_dim)
        # As the reference: rotate in float32, cast back; q and k in one pass (same table for both).
        qk = apply_rotary(qkv[:, :2].reshape(s, 2 * h, self.head_dim).float(), cos, sin_signed).to(x.dtype)
        return qk[:, :h], qk[:, h:], qkv[:, 2]

    def rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[tuple[int, int, int]],
             r0: int, r1: int) -> torch.Tensor:
        """The attention output of query rows ``[r0, r1)`` only (each row attends to its own frame, as
        :meth:`forward`), projected: ``[r1 - r0, hidden]``. ``k`` and ``v`` come head-major, ``[heads, tokens,
        head_dim]`` contiguous (:meth:`QwenVisionTower.advance` lays them out once a block)."""
        out = []
        for start, frames, n in segments:
            for f in range(frames):
                lo, hi = start + f * n, start + (f + 1) * n
                a, b = max(lo, r0), min(hi, r1)
                if a >= b:
                    continue
                o = torch.empty(b - a, self.num_heads, self.head_dim, dtype=q.dtype)
                if self._kernel(n, q[a:b], k[:, lo:hi].transpose(0, 1), v[:, lo:hi].transpose(0, 1), o):
                    out.append(o.view(b - a, -1))
                    continue
                q_ = q[a:b].unsqueeze(0).transpose(1, 2).contiguous()
                k_, v_ = (y[:, lo:hi].unsqueeze(0) for y in (k, v))  # [heads, tokens, head_dim] once per block
                out.append(F.scaled_dot_product_attention(q_, k_, v_).transpose(1, 2).reshape(b - a, -1))
        return self.proj(out[0] if len(out) == 1 else torch.cat(out))


class MLP(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                segments: list[tuple[int, int, int]]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin_signed, segments)
        return x + self.mlp(self.norm2(x))

    def rows(self, x: torch.Tensor, qkv: tuple[torch.Tensor, ...], segments: list[tuple[int, int, int]],
             r0: int, r1: int) -> torch.Tensor:
        """Output rows ``[r0, r1)`` of :meth:`forward`, given ``qkv = self.attn.project(self.norm1(x), ...)``
        (every row's keys and values: a row attends to its whole frame)."""
        y = x[r0:r1] + self.attn.rows(*qkv, segments, r0, r1)
        return y + self.mlp(self.norm2(y))


class PatchMerger(nn.Module):
    """merge² neighbouring patches -> one LLM token. ``postshuffle`` (DeepStack) normalises after concatenating."""

    def __init__(self, cfg: QwenVisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.dim = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.dim if postshuffle else cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.linear_fc1 = Linear(self.dim, self.dim)
        self.linear_fc2 = Linear(self.dim, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.dim)) if self.postshuffle else self.norm(x).view(-1, self.dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # exact GELU whatever hidden_act is, as the reference


@dataclass
class VisionJob:
    """One tower call in progress (:meth:`QwenVisionTower.start`): the hidden states after ``next_block`` blocks,
    the call's RoPE tables and attention segments, and the DeepStack levels computed so far."""

    x: torch.Tensor
    cos: torch.Tensor
    sin_signed: torch.Tensor
    segments: list[tuple[int, int, int]]
    next_block: int = 0
    deepstack: list[torch.Tensor] = field(default_factory=list)
    # a block run by rows (advance(rows=...)): its q, k, v, the output so far, and the next row to compute
    partial: tuple[torch.Tensor, ...] | None = None
    next_row: int = 0


class QwenVisionTower(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        # weights given: no random init, whose first use on the meta device imports torch._dynamo (1.1 s at start-up)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size,
                                      _weight=torch.empty(cfg.num_position_embeddings, cfg.hidden_size))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(cfg, postshuffle=True)
                                                   for _ in cfg.deepstack_visual_indexes)
        self._deepstack_at = {b: i for i, b in enumerate(cfg.deepstack_visual_indexes)}

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values [P, C*T*p*p] (any float dtype; cast to the weights'), grid_thw [N, 3] int (t, h, w) with
        P = sum t*h*w and h, w multiples of merge -> (merged [sum t*h*w/merge², out_hidden], one tensor of that
        shape per DeepStack level, in block order as the reference). Rows follow the images' order."""
        job = self.start(pixel_values, grid_thw)
        self.advance(job, blocks=len(self.blocks))
        return self.finish(job)

    # the same computation in slices (a serving engine runs the tower between steps): start, advance ..., finish
    def start(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionJob:
        """Check the inputs (as :meth:`forward`) and embed the patches; no block has run yet."""
        w = self.patch_embed.proj.weight
        grids = [tuple(map(int, g)) for g in grid_thw.tolist()]
        self._check_inputs(pixel_values, grids)
        x = self.patch_embed(pixel_values.to(dtype=w.dtype, device=w.device))
        pos, cos, sin_signed = self._position_tables(grids, w.device)
        return VisionJob(x + pos.to(x.dtype), cos, sin_signed, _segments(grids))

    def advance(self, job: VisionJob, *, blocks: int = 1, rows: int | None = None) -> bool:
        """Run up to ``blocks`` more blocks of ``job``, or with ``rows`` at most that many more output rows of the
        block in progress (its keys and values are computed for all rows first); returns whether every block has
        run."""
        if rows is not None and job.next_block < len(self.blocks):
            blk = self.blocks[job.next_block]
            if job.partial is None:
                q, k, v = blk.attn.project(blk.norm1(job.x), job.cos, job.sin_signed)
                job.partial = (q, k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), torch.empty_like(job.x))
                job.next_row = 0
            r0, r1 = job.next_row, min(job.x.shape[0], job.next_row + max(1, rows))
            job.partial[3][r0:r1] = blk.rows(job.x, job.partial[:3], job.segments, r0, r1)
            job.next_row = r1
            if r1 == job.x.shape[0]:
                job.x, job.partial = job.partial[3], None
                self._end_block(job)
            return job.next_block == len(self.blocks)
        assert job.partial is None, "a block run by rows is finished by rows"
        for _ in range(blocks):
            if job.next_block == len(self.blocks):
                break
            job.x = self.blocks[job.next_block](job.x, job.cos, job.sin_signed, job.segments)
            self._end_block(job)
        return job.next_block == len(self.blocks)

    def _end_block(self, job: VisionJob) -> None:
        if (j := self._deepstack_at.get(job.next_block)) is not None:
            job.deepstack.append(self.deepstack_merger_list[j](job.x))
        job.next_block += 1

    def finish(self, job: VisionJob) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The merged features and DeepStack levels of a job whose blocks have all run."""
        assert job.next_block == len(self.blocks), "finish() before every block ran"
        return self.merger(job.x), job.deepstack

    def _check_inputs(self, pixel_values: torch.Tensor, grids: list[tuple[int, ...]]) -> None:
        m = self.cfg.spatial_merge_size
        if not grids or any(len(g) != 3 or min(g) <= 0 or g[1] % m or g[2] % m for g in grids):
            raise ValueError(f"grid_thw must be [N >= 1, 3] positive with h, w multiples of {m}, got {grids}")
        want = (sum(t * h * w for t, h, w in grids), self.cfg.patch_dim)
        if tuple(pixel_values.shape) != want:
            raise ValueError(f"pixel_values shape {tuple(pixel_values.shape)} does not match grid_thw ({want})")

    def _position_tables(self, grids: list[tuple[int, ...]], device: torch.device
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Learned positions [P, hidden] (float32) and RoPE cos / signed sin [P, 1, head_dim], merge-window order."""
        d = self.cfg.head_dim // 2  # per-axis rotary width; the reference's "spatial_dim"
        inv_freq = (1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))).to(device)
        table = self.pos_embed.weight.float().view(self.cfg.position_side, self.cfg.position_side, -1)
        per_grid: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        parts = []
        for t, h, w in grids:
            if (h, w) not in per_grid:
                rows, cols = _merge_order_coords(h, w, self.cfg.spatial_merge_size, device)
                pos = _interpolate(table, h, w)[rows, cols]
                ang = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1)
                cos, sin = ang.cos(), ang.sin()
                per_grid[(h, w)] = (pos, torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1))
            parts.append([p.repeat(t, 1) if t > 1 else p for p in per_grid[(h, w)]])
        pos, cos, sin_signed = (torch.cat(c) if len(c) > 1 else c[0] for c in zip(*parts))
        return pos, cos.unsqueeze(1), sin_signed.unsqueeze(1)


def _merge_order_coords(h: int, w: int, m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each of the h*w patches, ordered window by window (row-major), row-major inside a window."""
    rows = torch.arange(h, device=device).view(h // m, 1, m, 1).expand(h // m, w // m, m, m).flatten()
    cols = torch.arange(w, device=device).view(1, w // m, 1, m).expand(h // m, w // m, m, m).flatten()
    return rows, cols


def _axis_taps(size: int, side: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bilinear, align_corners=True: source taps floor / floor+1 (clamped) and the weight of the second."""
    src = torch.arange(size, dtype=torch.float32, device=device) * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    lo = floor.long()
    return lo, (lo + 1).clamp(max=side - 1), src - floor


def _interpolate(table: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[side, side, C] -> [h, w, C], separably (rows then columns): the reference's 4-tap weighted sum regrouped."""
    side = table.shape[0]
    lo, hi, f = _axis_taps(h, side, table.device)
    table = table[lo] * (1 - f)[:, None, None] + table[hi] * f[:, None, None]
    lo, hi, f = _axis_taps(w, side, table.device)
    return table[:, lo] * (1 - f)[None, :, None] + table[:, hi] * f[None, :, None]


def _segments(grids: list[tuple[int, ...]]) -> list[tuple[int, int, int]]:
    """Attention segments (start token, frames, tokens per frame); consecutive entries with equal h*w are batched."""
    segs: list[tuple[int, int, int]] = []
    start = 0
    for t, h, w in grids:
        if segs and segs[-1][2] == h * w:
            segs[-1] = (segs[-1][0], segs[-1][1] + t, h * w)
        else:
            segs.append((start, t, h * w))
        start += t * h * w
    return segs
