"""Sparse MoE block: reference-exact top-k routing, execution grouped by expert, per-expert token counts.

Routing follows transformers exactly: router logits in the model dtype, softmax in float32, top-k, optional
renormalisation (``norm_topk_prob``; Mixtral always renormalises), and for Qwen3-MoE a cast of the weights back to
the model dtype. Execution sorts the (token, slot) pairs by expert and runs one grouped GEMM for gate/up and one for
down over the experts that received tokens. ``expert_counts`` accumulates how many tokens each expert received; later stages place experts from it.

``executor``, when set, takes over execution after routing: ``executor(x [T, H], weights [T, k], experts [T, k])
-> [T, H]`` in x's dtype. The expert-parallel decode group (:mod:`decode_node.expert_parallel`) plugs in there to
run the experts on the workers that hold them; the module's own expert tensors are then unused.

On CPU (:mod:`engine.cpu_linear`) the experts may also run one by one through oneDNN kernels with packed weights.
Which path is faster depends on the step's size: measured on one host (AMD EPYC, 2 threads, float32, 16 experts
top-2, 512 x 256), the packed path won a decode step and the grouped GEMM a 256-token prefill chunk by about 2x. So
both are timed at load, per step size, on the layer's own shapes with random routing
(:meth:`SparseMoe.pack_linears`), and each step takes the faster one for its token count. For steps of at most
``cpu_kernels.MAX_ROWS`` tokens a third path competes: the compiled kernel of :mod:`engine.cpu_kernels` that runs a
token's experts (gate/up, SiLU, down, the weighted sum) in one call, reading each expert's weights at close to the
core's memory bandwidth (SwiGLU, float32). Where that path takes every step size, the experts are kept only in the
panel layout its kernels stream (:func:`engine.cpu_kernels.panel_pack`; :meth:`SparseMoe.expert_weights` rebuilds
the plain tensors for whoever needs them).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import engine.cpu_kernels as cpu_kernels
import engine.tuning_cache as tuning_cache
from engine.cpu_linear import BUCKET_UPPER, ROW_PROBES, bucket, median_seconds_each
from engine.layers import ACTIVATIONS, Linear
from engine.text_config import TextConfig

logger = logging.getLogger(__name__)


class SparseMoe(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.top_k = e, cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weights_in_model_dtype = cfg.router_weights_in_model_dtype
        self.gate = Linear(h, e, bias=False)
        # Output-major, as transformers stores them: [E, 2I, H] (gate rows, then up rows) and [E, H, I]. Grouped GEMM
        # takes transposed views; measured faster than input-major copies for both decode (few rows per expert)
        # and prefill shapes.
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.register_buffer("expert_counts", torch.zeros(e, dtype=torch.int64), persistent=False)
        self.record_routing = False
        self.last_experts: torch.Tensor | None = None  # [T, k] of the last forward, when record_routing is set
        self.executor: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self._packed: list[tuple[Callable, Callable]] | None = None  # per expert (gate_up, down): pack_linears
        self._packed_for: tuple[bool, ...] = ()  # per ROW_PROBES step size: the packed path runs it (pack_linears)
        self._swiglu = cfg.hidden_act == "silu"
        self._fused = None  # the compiled library, where its one-call path runs steps of few tokens (pack_linears)
        self._fused_upto = 0  # ... of up to this many tokens
        self._panels = False  # the experts live in panel_gate_up / panel_down (pack_linears), in panels
        self.register_buffer("panel_gate_up", None, persistent=False)
        self.register_buffer("panel_down", None, persistent=False)

    def pack_linears(self, make) -> list:
        """CPU (:mod:`engine.cpu_linear`): give each expert packed kernels, then time the two paths -- the grouped
        GEMM over the [E, ...] tensors, the experts one by one through their packed kernels -- at each step size of
        ``ROW_PROBES`` tokens (once per shape, dtype and thread count in a process). The packed path faster by 5%
        at every size: the [E, ...] tensors are dropped (one copy of the experts; :meth:`expert_weights` rebuilds
        them); at none: the packed copies are; in between both are kept (the experts twice in memory) and each step
        runs the path measured faster for its token count. Where the compiled one-call path was measured faster at
        few tokens (:meth:`_measure_paths`) it runs those steps and keeps the [E, ...] tensors it reads. Mode
        ``"packed"``: the packed path always."""
        if self.executor is not None or self.gate_up_proj.shape[0] == 0:
            return []
        packed = [(make(gu, None, always=True), make(down, None, always=True))
                  for gu, down in zip(self.gate_up_proj, self.down_proj)]
        if packed[0][0].packed is None:  # no packed kernel here (device, dtype)
            return []
        self._packed = packed
        fused = 0
        if make.mode == "packed":
            self._packed_for = (True,) * len(ROW_PROBES)
        else:
            self._packed_for, fused = self._measure_paths()
        self._fused = cpu_kernels.library() if fused else None
        self._fused_upto = fused
        # the packed copies serve only the step sizes the one-call path does not take (none where it takes all)
        if fused >= FUSED_ALL or not any(p and fused < upper for p, upper in zip(self._packed_for, BUCKET_UPPER)):
            self._packed = None
            if fused >= FUSED_ALL and make.mode == "auto":
                self._to_panels()
            return []
        if all(self._packed_for) and not fused:
            self.release_experts(keep_packed=True)
        return [k for pair in packed for k in pair]

    def _to_panels(self) -> None:
        """The one-call path takes every step: keep the experts only in the layout its kernels stream
        (:func:`engine.cpu_kernels.panel_pack`), as buffers that move with the module, where they were measured
        faster here (:func:`panels_faster`)."""
        if not (cpu_kernels.panels_fit(self.gate_up_proj) and cpu_kernels.panels_fit(self.down_proj)):
            return
        e, two_i, h = self.gate_up_proj.shape
        key = (e, two_i, h, self.top_k, torch.get_num_threads())
        if not tuning_cache.remembered(_PANELS, "moe_panels", key, lambda: panels_faster(
                self.gate_up_proj.detach(), self.down_proj.detach(), self.top_k), like=False):
            return
        self.panel_gate_up = cpu_kernels.panel_pack(self.gate_up_proj.detach())
        self.panel_down = cpu_kernels.panel_pack(self.down_proj.detach())
        self.release_experts(keep_fused=True)
        self._panels = True

    def kernel_experts(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(gate_up, down, in panels?) as the compiled kernels read them."""
        if self._panels:
            return self.panel_gate_up, self.panel_down, True
        return self.gate_up_proj, self.down_proj, False

    @property
    def one_call_upto(self) -> int:
        """The most tokens a step may have for the compiled one-call path to run it (0: never)."""
        return self._fused_upto if self._fused is not None else 0

    def _fusable(self) -> bool:
        """Can the compiled one-call path run this layer (SwiGLU, float32 experts on CPU, top-k it takes)?"""
        return self._swiglu and self.top_k <= cpu_kernels.MAX_TOP_K and cpu_kernels.usable(self.gate_up_proj) \
            and cpu_kernels.usable(self.down_proj) and cpu_kernels.library() is not None

    def _measure_paths(self) -> tuple[tuple[bool, ...], int]:
        """Per step size of ``ROW_PROBES`` tokens: is the packed path faster than the grouped GEMM by 5%? And the
        most tokens the compiled one-call path takes: the largest of :data:`FUSED_PROBES` at which it was faster than
        both others by 5% (a near tie at a smaller probe does not cut it short: one noisy probe at 32 tokens sent
        256-token prefills to a path 1.7x slower); :data:`FUSED_ALL` where it won the largest."""
        e, two_i, h = self.gate_up_proj.shape
        fusable = self._fusable()
        key = (e, two_i, h, self.top_k, self.gate_up_proj.dtype, torch.get_num_threads(), fusable)
        return tuning_cache.remembered(_PATHS, "moe_paths", key, lambda: self._probe_paths(fusable),
                                       like=((False,) * len(ROW_PROBES), 0))

    def _probe_paths(self, fusable: bool) -> tuple[tuple[bool, ...], int]:
        e, two_i, h = self.gate_up_proj.shape
        gen = torch.Generator().manual_seed(0)
        faster, fused = [], 0
        for t in sorted({*ROW_PROBES, *(FUSED_PROBES if fusable else ())}):
            x = torch.randn(t, h, generator=gen).to(self.gate_up_proj.dtype)
            experts = torch.stack([torch.randperm(e, generator=gen)[:self.top_k] for _ in range(t)])
            weights = torch.full((t, self.top_k), 1.0 / self.top_k, dtype=x.dtype)
            counts = torch.bincount(experts.view(-1), minlength=e)
            fns = [lambda: self._experts(x, weights, experts, counts, packed=False),
                   lambda: self._experts(x, weights, experts, counts, packed=True)]
            if fusable and t in FUSED_PROBES:
                lib = cpu_kernels.library()
                fns.append(lambda: cpu_kernels.moe_silu(lib, x, self.gate_up_proj, self.down_proj, experts,
                                                        weights))
            grouped, one_by_one, *one_call = median_seconds_each(fns)
            if t in ROW_PROBES:
                faster.append(one_by_one < 0.95 * grouped)
            if one_call:
                fused = t if one_call[0] < 0.95 * min(grouped, one_by_one) else fused
        fused = FUSED_ALL if fusable and fused == FUSED_PROBES[-1] else fused
        logger.info("MoE %d experts x (%d, %d), top-%d: packed experts at %s tokens, grouped GEMM at %s%s%s", e,
                    two_i, h, self.top_k, [t for t, f in zip(ROW_PROBES, faster) if f] or "no",
                    [t for t, f in zip(ROW_PROBES, faster) if not f] or "none",
                    "" if not fused else "; the compiled one-call path at every step" if fused == FUSED_ALL
                    else f"; the compiled one-call path up to {fused} tokens",
                    " (both copies of the experts kept)" if any(faster) and not all(faster) and fused != FUSED_ALL
                    else "")
        return tuple(faster), fused

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts' (gate_up [E, 2I, H], down [E, H, I]), plain tensors (rebuilt when only packed ones remain)."""
        if self._panels:
            return cpu_kernels.panel_unpack(self.panel_gate_up), cpu_kernels.panel_unpack(self.panel_down)
        if self._packed is None or self.gate_up_proj.shape[0]:
            return self.gate_up_proj, self.down_proj
        return (torch.stack([gu.dense() for gu, _ in self._packed]),
                torch.stack([down.dense() for _, down in self._packed]))

    def release_experts(self, *, keep_packed: bool = False, keep_fused: bool = False) -> None:
        """Drop the all-resident expert tensors (an ``executor`` computes the experts elsewhere)."""
        self.gate_up_proj = nn.Parameter(self.gate_up_proj.new_empty(0, *self.gate_up_proj.shape[1:]), False)
        self.down_proj = nn.Parameter(self.down_proj.new_empty(0, *self.down_proj.shape[1:]), False)
        if not keep_fused:  # it reads the plain tensors (or the panels, dropped too)
            self._fused, self._panels = None, False
            self.panel_gate_up = self.panel_down = None
        if not keep_packed:
            self._packed = None

    def _route_kernel(self, x: torch.Tensor):
        """The compiled kernels where they route this step (float32 on CPU, a step of at most
        :data:`ROUTE_KERNEL_ROWS` tokens: beyond it the library GEMM reuses the router's weights better), else None."""
        w = self.gate.weight
        if x.shape[0] > ROUTE_KERNEL_ROWS or x.dtype != torch.float32 or w.dtype != torch.float32 \
                or x.device.type != "cpu" or not (x.is_contiguous() and w.is_contiguous()):
            return None
        return cpu_kernels.library()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k], expert ids [T, k])."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        lib = self._route_kernel(x)
        if lib is not None:  # router GEMV, softmax, top-k and the counts in one call
            weights, experts = cpu_kernels.moe_route(lib, x, self.gate.weight, self.top_k, self.norm_topk_prob,
                                                     self.expert_counts)
            counts = None
        else:
            weights, experts = self.route(x)
            counts = torch.bincount(experts.view(-1), minlength=self.num_experts)
            self.expert_counts += counts
        if self.record_routing:
            self.last_experts = experts
        if self.executor is not None:
            return self.executor(x, weights, experts)
        if self._fused is not None and t <= self._fused_upto and x.dtype == torch.float32:
            gate_up, down, panel = self.kernel_experts()
            return cpu_kernels.moe_silu(self._fused, x, gate_up, down, experts, weights, checked=lib is not None,
                                        panel=panel)
        if counts is None:
            counts = torch.bincount(experts.view(-1), minlength=self.num_experts)
        packed = self._packed is not None and self._packed_for[bucket(t)]
        return self._experts(x, weights, experts, counts, packed=packed)

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor, *,
                 packed: bool) -> torch.Tensor:
        """The routed experts on x [T, H] (``counts``: rows per expert), by the grouped GEMM or, ``packed``, one by
        one through their packed kernels."""
        t, h = x.shape
        if t == 1 and packed:
            return self._one_token(x, weights[0], experts[0].tolist())
        flat = experts.view(-1)
        order = torch.argsort(flat, stable=True)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        token = order // self.top_k
        xs = x[token]  # [S, H], S = T * k, grouped by expert
        if packed:
            y = self._run_packed(xs, offsets)
        else:
            gate, up = grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offsets).chunk(2, dim=-1)
            y = grouped_mm(self.act(gate) * up, self.down_proj.transpose(1, 2), offsets)
        y = y * weights.view(-1)[order].unsqueeze(1)
        return torch.zeros(t, h, dtype=y.dtype, device=y.device).index_add_(0, token, y).to(x.dtype)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on rows ``x`` through its packed kernels."""
        gate_up, down = self._packed[e]
        gate, up = gate_up(x).chunk(2, dim=-1)
        return down(self.act(gate) * up)

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, experts: list[int]) -> torch.Tensor:
        """A batch of one token (decode of one sequence): its k experts in expert order, summed as the grouped path
        sums them, without the sort, the gather and the scatter."""
        acc = None
        for j in sorted(range(len(experts)), key=experts.__getitem__):
            y = self._expert(experts[j], x) * weights[j:j + 1]  # a [1] tensor: promotes as the grouped path's [S, 1]
            acc = y if acc is None else acc + y
        return acc.to(x.dtype)

    def _run_packed(self, xs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The experts over rows grouped by expert, each through its packed kernels; experts without rows cost
        nothing."""
        out = xs.new_empty(xs.shape[0], xs.shape[1])
        start = 0
        for e, end in enumerate(offsets.tolist()):
            if end > start:
                out[start:end] = self._expert(e, xs[start:end])
            start = end
        return out


def _native_grouped_mm_ok(x: torch.Tensor) -> bool:
    if _GROUPED_MM is None:
        return False
    if x.device.type == "cpu":
        return True
    return x.device.type == "cuda" and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows ``[offsets[e-1], offsets[e])`` of x [S, K] times w[e] [K, N] (any strides) -> [S, N]; experts with no
    rows cost nothing."""
    if _native_grouped_mm_ok(x):
        return _GROUPED_MM(x, w, offs=offsets)
    out = x.new_empty(x.shape[0], w.shape[2])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
        start = end
    return out


_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
ROUTE_KERNEL_ROWS = 16  # steps of up to this many tokens route through the compiled kernel (decode batches)
FUSED_PROBES = (1, 4, 16, 32, 64, 256, 384, 512, 1024, 2048)  # step sizes the one-call path is timed at (a served
# ~260-token prompt steps with the running decodes: 256 alone left it on the grouped GEMM, 3.5 against 3.1 ms a layer at
# 262); where it wins the largest, it takes every step (its experts' GEMMs are tiled there, as the grouped path's are)
FUSED_ALL = cpu_kernels.ALL_STEPS  # SparseMoe._fused_upto: no limit
# (E, 2I, H, k, dtype, threads, one-call path possible) -> SparseMoe._measure_paths' answer
_PATHS: dict[tuple, tuple[tuple[bool, ...], int]] = {}


PANEL_PROBES = (4, 32, 256)  # tokens a step: decode batches and a prefill chunk (panels_faster)
PANEL_PROBE_EXPERTS = 8  # experts the probe routes among (copies of them cycled, so they come from memory)
_PANEL_COLD_BYTES = 64 << 20  # per layout: the probe's copies of those experts add up to this (2x this host's L3)
_PANELS: dict[tuple, bool] = {}  # (E, 2I, H, k, threads) -> panels_faster's answer


def panels_faster(gate_up: torch.Tensor, down: torch.Tensor, top_k: int) -> bool:
    """Are the experts faster in panels than row-major through the one-call kernel, here? Timed at each of
    :data:`PANEL_PROBES` tokens (random routing among up to :data:`PANEL_PROBE_EXPERTS` experts, both layouts
    interleaved on cold copies); yes when the geometric mean of the speed-ups is at least 1: one layout serves every
    step, and where panels win decode steps a prefill chunk may lose a little (measured here, AMD EPYC: 1.2-1.5x at
    4-32 tokens, 0.93x at 256), and it is the host that says by how much."""
    lib = cpu_kernels.library()
    e = min(gate_up.shape[0], PANEL_PROBE_EXPERTS)
    nbytes = (gate_up[:e].numel() + down[:e].numel()) * gate_up.element_size()
    copies = [(gate_up[:e].clone(), down[:e].clone()) for _ in range(max(1, min(16, _PANEL_COLD_BYTES // nbytes)))]
    layouts = {False: itertools.cycle(copies),
               True: itertools.cycle([(cpu_kernels.panel_pack(g), cpu_kernels.panel_pack(d)) for g, d in copies])}
    gen, ratios = torch.Generator().manual_seed(0), []
    for t in PANEL_PROBES:
        x = torch.randn(t, gate_up.shape[2], generator=gen)
        ids = torch.stack([torch.randperm(e, generator=gen)[:min(top_k, e)] for _ in range(t)])
        w = torch.full(ids.shape, 1.0 / ids.shape[1])
        plain, panel = median_seconds_each([
            lambda p=p: cpu_kernels.moe_silu(lib, x, *next(layouts[p]), ids, w, panel=p) for p in (False, True)])
        ratios.append(plain / panel)
    mean = math.prod(ratios) ** (1 / len(ratios))
    logger.info("MoE experts (%d, %d) in panels: %s faster at %s tokens -> %s", *gate_up.shape[1:],
                "/".join(f"{r:.2f}x" for r in ratios), "/".join(map(str, PANEL_PROBES)), "panels" if mean >= 1.0
                else "row-major")
    return mean >= 1.0


class DenseMlp(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.silu = cfg.hidden_act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
