"""Linear layers on CPU through oneDNN with the weight packed once, where timing both kernels at load finds it faster.

``F.linear`` on CPU multiplies by the weight as stored ([N, K], row-major) and reorders it for the GEMM kernel on
every call; oneDNN can instead reorder it once into the blocked layout its kernels read
(``torch.ops.mkldnn._reorder_linear_weight``) and then run ``_linear_pointwise`` on that. How much that saves depends
on the weight's shape, the number of rows, the dtype and the host (AMD EPYC with AVX-512, 2 threads, float32: an
8192 x 512 LM head 9.6x faster at 1 row and 1.6x at 256; a 768 x 512 projection 1.1-1.7x; a 64 x 512 router 0.3x at
1 row), so nothing is assumed: each distinct (shape, dtype, bias, threads) is timed both ways when the model loads, at
:data:`ROW_PROBES` rows, and each row range then uses whichever kernel was faster there. Results equal ``F.linear``'s
to float rounding (the same products, summed in another order), not bit for bit.

A third kernel competes where a call has at most :data:`engine.cpu_kernels.MAX_ROWS` rows (a decode step): the
few-row kernel of :mod:`engine.cpu_kernels`, compiled on the host, which reads the weight at close to the core's
memory bandwidth where both library kernels reach a third to a half of it (float32; AMD EPYC, 1 thread, cold
weights: a 768 x 512 projection at one row 154 us with ``F.linear``, 121 us packed, 81 us few-row; at four rows
193 / 100 / 140 us). It is timed at :data:`FEW_ROW_PROBES` rows beside the other two and runs calls of up to the
largest probe at which it, and every smaller probe, was faster than both by 5%.

Modes (``EngineConfig.cpu_linear``): ``"auto"`` (measure, the default), ``"packed"`` (always the packed kernel: for
tests), ``"native"`` (never; nor the few-row kernel). Off CPU, for float16, or where this torch build lacks the
oneDNN ops, every layer keeps ``F.linear``. Memory: a packed copy of every packed weight is kept beside the original
(the original serves tied embeddings, checkpoint export and the native row ranges).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

import engine.cpu_kernels as cpu_kernels
import engine.tuning_cache as tuning_cache

logger = logging.getLogger(__name__)

MODES = ("auto", "packed", "native")
ROW_PROBES = (1, 16, 256)  # a decode step, a small mixed batch, a prefill chunk
_DTYPES = (torch.float32, torch.bfloat16)
_COLD_BYTES = 96 << 20  # the probes cycle through copies of a weight this large in all (beyond the caches: a
# 32 MiB L3 holding every copy made the probes read small weights from cache, unlike a step, and hid the few-row
# kernel's advantage, which is reading memory)
_MAX_COPIES = 64
_PROBE_BUDGET_S = 0.02  # per kernel per probe: repetitions are cut to fit (a large LM head runs once or twice)
_timings: dict[tuple, tuple[tuple[float, float], ...]] = {}  # (N, K, dtype, bias, threads) -> per probe (F.linear s,
# packed s), measured once per process
TILE_ROW_PROBES = (8, 16, 32)  # decode batch sizes choose_tile_rows times (above the few-row kernel's rows)
_tile_rows: dict[tuple, int] = {}  # (N, K, threads) -> choose_tile_rows' answer
FEW_ROW_PROBES = (1, 2, 4)  # up to cpu_kernels.MAX_ROWS
_few_row_timings: dict[tuple, tuple[tuple[float, float], ...]] = {}  # the same key -> per FEW_ROW_PROBES (the faster
# library kernel's seconds, the few-row kernel's seconds)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")


BUCKET_UPPER = (4, 64, math.inf)  # the most rows each probe of ROW_PROBES judges (bucket)


def bucket(rows: int) -> int:
    """The probe a row count is judged by: the nearest of :data:`ROW_PROBES` on a log scale."""
    return next(i for i, upper in enumerate(BUCKET_UPPER) if rows <= upper)


class LinearKernel:
    """``kernel(x)`` = ``F.linear(x, weight, bias)``; rows in a range where the packed kernel was measured faster go
    through oneDNN with the weight packed once. ``packed_for[i]``: whether rows judged by ``ROW_PROBES[i]`` do.
    ``few_rows``: calls of up to that many rows run the compiled few-row kernel (float32, at most
    ``cpu_kernels.MAX_ROWS``; 0: never)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed_for: tuple[bool, ...], *,
                 few_rows: int = 0) -> None:
        self.bias, self.packed_for, self.dtype = bias, packed_for, weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None) if any(packed_for) else None
        self.few_rows = cpu_kernels.library() if few_rows and weight.dtype == torch.float32 else None
        self.few_rows_upto = min(few_rows, cpu_kernels.MAX_ROWS) if self.few_rows is not None else 0
        if self.few_rows is not None:  # the compiled kernel reads plain contiguous float32
            weight = weight.contiguous()
            self.bias = None if bias is None else bias.contiguous()
        # packed for every row count: the kernel does not need the plain weight (a caller may free it)
        self.weight = None if self.packed is not None and all(packed_for) and self.few_rows is None else weight

    def dense(self) -> torch.Tensor:
        """The plain [N, K] weight (rebuilt from the packed one when the kernel does not keep it)."""
        return self.weight if self.weight is not None else self.packed.to_dense()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if 0 < rows <= self.few_rows_upto and x.dtype == torch.float32:
            return cpu_kernels.linear(self.few_rows, x, self.weight, self.bias)
        if self.weight is not None and (self.packed is None or not rows or not self.packed_for[bucket(rows)]
                                        or x.dtype != self.dtype):
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(rows, x.shape[-1])
        padded = padded_rows(rows)
        if padded != rows:  # a bounded set of shapes: oneDNN builds (JIT-compiles) a kernel per new row count
            x2 = torch.cat([x2, x2.new_zeros(padded - rows, x2.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.packed, self.bias, "none", [], "")
        return y[:rows].view(*x.shape[:-1], y.shape[-1])


def padded_rows(rows: int) -> int:
    """The row count a packed call runs at: exact up to 16 rows (decode), then rounded up to a multiple of 32 (up to
    512) or of 128. oneDNN creates a kernel for each new input shape and keeps a bounded cache of them, so a prefill's
    (and the experts') varying row counts would otherwise build kernels without end (measured: a 256-token prefill
    with packed experts went 57 -> 120 ms over six prompts, and back to 55 ms padded); this keeps a weight's shapes to
    16 + 16 + 28 for up to 4,096 rows, at the cost of computing up to 31 (127 beyond 512) rows more."""
    if rows <= 16:
        return rows
    step = 32 if rows <= 512 else 128
    return -(-rows // step) * step


TUNING_LOCK = os.path.join(tempfile.gettempdir(), "duet-cpu-tuning.lock")
TUNING_WAIT_S = 120.0  # the longest a process waits for another's measurements before measuring anyway


@contextlib.contextmanager
def tuning_turn(path: str = TUNING_LOCK, wait_s: float = TUNING_WAIT_S) -> Iterator[bool]:
    """Hold the host's kernel-tuning turn (an exclusive ``flock`` on ``path``) while measuring, so processes that
    start together (a node's prefill and decode workers) do not time their kernels against each other's: measured
    side by side, the MoE's one-call path lost at 32-64 tokens to noise and 256-token prefills took the grouped GEMM,
    75-84 ms against 50 ms (serve-peer checkpoint, 2 cores). Yields whether the turn is held: a lock that cannot be
    opened (or a platform without ``flock``), or a wait past ``wait_s``, measures without it."""
    try:
        import fcntl
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except (ImportError, OSError):
        yield False
        return
    try:
        deadline, held = time.monotonic() + wait_s, False
        while not held:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    logger.warning("kernel tuning: %s still held after %.0f s; measuring anyway", path, wait_s)
                    break
                time.sleep(0.05)
        yield held
    finally:
        os.close(fd)  # releases the lock


def median_seconds_each(fns: list[Callable[[], object]]) -> list[float]:
    """Median seconds of one call of each function, their calls interleaved (after a warm-up call of each), so that
    a burst of other work on the host slows them alike instead of deciding the comparison: measured one after the
    other, a worker tuning while another process started lost the MoE one-call path at every prefill size (a
    256-token step 45 ms against 37). Repetitions are cut to the probe budget of the slowest."""
    first = []
    for fn in fns:
        t0 = time.perf_counter()
        fn()
        first.append(time.perf_counter() - t0)
    reps = max(3, min(25, int(_PROBE_BUDGET_S / max(max(first), 1e-6))))
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [sorted(t)[len(t) // 2] for t in times]


class ColdCopies:
    """One weight's cold copies (:func:`_cold_copies`) and their packed forms, each made on first use and shared by
    the weight's probes (cloning and packing up to 64 copies took more of a load's tuning than the timed calls)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    @functools.cached_property
    def copies(self) -> list[torch.Tensor]:
        return _cold_copies(self.weight)

    @functools.cached_property
    def packed(self) -> list[torch.Tensor]:
        return [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in self.copies]


def timings(weight: torch.Tensor, bias: torch.Tensor | None, cold: ColdCopies | None = None
            ) -> tuple[tuple[float, float], ...]:
    """Per probe of :data:`ROW_PROBES`: (``F.linear`` s, packed s) for this weight here, both on the same random
    rows; measured once per (shape, dtype, bias, threads)."""
    key = (*weight.shape, weight.dtype, bias is not None, torch.get_num_threads())
    return tuning_cache.remembered(_timings, "linear", key, lambda: _measure_timings(cold or ColdCopies(weight), bias),
                                   like=((0.0, 0.0),) * len(ROW_PROBES))


def _measure_timings(cold: ColdCopies, bias: torch.Tensor | None) -> tuple[tuple[float, float], ...]:
    weight, copies, packed = cold.weight, cold.copies, cold.packed
    gen = torch.Generator().manual_seed(0)
    turn = itertools.count()
    row = []
    for rows in ROW_PROBES:
        x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.dtype)
        row.append(tuple(median_seconds_each([
            lambda: F.linear(x, copies[next(turn) % len(copies)], bias),
            lambda: torch.ops.mkldnn._linear_pointwise(x, packed[next(turn) % len(packed)], bias, "none", [], "")])))
    return tuple(row)


def few_row_timings(weight: torch.Tensor, bias: torch.Tensor | None, cold: ColdCopies | None = None
                    ) -> tuple[tuple[float, float], ...]:
    """Per probe of :data:`FEW_ROW_PROBES`: (the faster of ``F.linear`` and the packed kernel, the few-row kernel),
    seconds, on the same kind of cold copies as :func:`timings`; measured once per (shape, dtype, bias, threads).
    Empty where the few-row kernel cannot run (not float32, or not built)."""
    lib = cpu_kernels.library() if weight.dtype == torch.float32 else None
    if lib is None:
        return ()
    key = (*weight.shape, weight.dtype, bias is not None, torch.get_num_threads())
    return tuning_cache.remembered(_few_row_timings, "few_row", key,
                                   lambda: _measure_few_rows(lib, cold or ColdCopies(weight), bias),
                                   like=((0.0, 0.0),) * len(FEW_ROW_PROBES))


def _measure_few_rows(lib, cold: ColdCopies, bias: torch.Tensor | None) -> tuple[tuple[float, float], ...]:
    weight, copies, packed = cold.weight, cold.copies, cold.packed
    b = None if bias is None else bias.detach().contiguous()
    gen = torch.Generator().manual_seed(0)
    turn = itertools.count()
    row = []
    for rows in FEW_ROW_PROBES:
        x = torch.randn(rows, weight.shape[1], generator=gen)
        native, onednn, few = median_seconds_each([
            lambda: F.linear(x, copies[next(turn) % len(copies)], b),
            lambda: torch.ops.mkldnn._linear_pointwise(x, packed[next(turn) % len(packed)], b, "none", [], ""),
            lambda: cpu_kernels.linear(lib, x, copies[next(turn) % len(copies)], b)])
        row.append((min(native, onednn), few))
    return tuple(row)


def few_rows_upto(weight: torch.Tensor, bias: torch.Tensor | None, cold: ColdCopies | None = None) -> int:
    """The most rows a call of this weight runs through the few-row kernel: the largest probe at which it, and at
    every smaller probe, was faster than the library kernels by 5% (0: none)."""
    upto = 0
    for rows, (library, few) in zip(FEW_ROW_PROBES, few_row_timings(weight, bias, cold)):
        if few >= 0.95 * library:
            break
        upto = rows
    return upto


def choose_tile_rows(weight: torch.Tensor) -> int:
    """Set and return the row count from which the compiled kernels' linear (the one-call decode layer's
    projections) takes its tiled GEMM instead of gemv (:data:`TILE_ROW_PROBES`; 0: never): the smallest probe at
    which the tiled GEMM, and at every larger probe, was faster by 5%, timed interleaved on cold copies of
    ``weight`` (float32 [N, K]); once per (shape, threads) in a process. Where the kernels are not built: 0."""
    lib = cpu_kernels.library() if weight.dtype == torch.float32 and weight.device.type == "cpu" else None
    if lib is None:
        return 0
    key = (*weight.shape, torch.get_num_threads())
    rows = tuning_cache.remembered(_tile_rows, "tile_rows", key, lambda: _measure_tile_rows(lib, weight), like=0)
    lib.duet_set_linear_tile_rows(rows)
    return rows


def _measure_tile_rows(lib, weight: torch.Tensor) -> int:
    copies = _cold_copies(weight)
    gen = torch.Generator().manual_seed(0)
    turn = itertools.count()

    def run(x: torch.Tensor, rows: int) -> None:
        lib.duet_set_linear_tile_rows(rows)
        cpu_kernels.linear(lib, x, copies[next(turn) % len(copies)], None)

    start = 0
    try:
        for rows in reversed(TILE_ROW_PROBES):
            x = torch.randn(rows, weight.shape[1], generator=gen)
            gemv, tiled = median_seconds_each([lambda: run(x, 0), lambda: run(x, rows)])
            if tiled >= 0.95 * gemv:
                break
            start = rows
    finally:
        lib.duet_set_linear_tile_rows(0)
    return start


def _cold_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """Several copies of ``weight``, used in turn, so that a small weight is read from memory as in a step (a layer's
    weights are evicted by the other layers' before they come round again), not from a cache the probe keeps warm."""
    n = max(1, min(_MAX_COPIES, -(-_COLD_BYTES // _nbytes(weight))))
    return [weight.detach().contiguous().clone() for _ in range(n)]


def _nbytes(t: torch.Tensor) -> int:
    return max(1, t.numel() * t.element_size())


def measure(weight: torch.Tensor, bias: torch.Tensor | None, *, everywhere: bool = False,
            cold: ColdCopies | None = None) -> tuple[bool, ...]:
    """Per probe: use the packed kernel there? Yes where it is faster by 5% (a tie keeps ``F.linear``). With
    ``everywhere`` (a caller that will drop the plain weight): all or nothing, all when the packed kernel is faster
    by 5% on the geometric mean of the probes' time ratios (each row count counts alike)."""
    t = timings(weight, bias, cold)
    if everywhere:
        ok = math.prod(p / n for n, p in t) ** (1 / len(t)) < 0.95
        return (ok,) * len(t)
    return tuple(p < 0.95 * n for n, p in t)


def make_kernel(mode: str) -> Callable[[torch.Tensor, torch.Tensor | None], LinearKernel] | None:
    """The factory modules get (``pack_linears(make)``), or None when every layer keeps ``F.linear``."""
    if mode not in MODES:
        raise ValueError(f"cpu_linear must be one of {MODES}, got {mode!r}")
    if mode == "native" or not available():
        return None

    def make(weight: torch.Tensor, bias: torch.Tensor | None, *, everywhere: bool = False,
             always: bool = False) -> LinearKernel:
        """``everywhere``: the packed kernel for every row count or for none (the caller then frees the weight).
        ``always``: packed for every row count, unmeasured (a caller that measures its own alternatives: the MoE
        experts). Off CPU, or for a dtype without packed kernels, never packed."""
        if weight.device.type != "cpu" or weight.dtype not in _DTYPES or weight.dim() != 2:
            return LinearKernel(weight, bias, (False,) * len(ROW_PROBES))
        packed_all = always or mode == "packed"
        cold = ColdCopies(weight)  # the probes of both measurements time the same copies
        chosen = (True,) * len(ROW_PROBES) if packed_all else measure(weight, bias, everywhere=everywhere, cold=cold)
        few = 0 if packed_all or everywhere else few_rows_upto(weight, bias, cold)
        return LinearKernel(weight, bias, chosen, few_rows=few)

    make.mode = mode  # type: ignore[attr-defined]  # "packed": callers that measure skip it (tests force the path)
    return make


def pack_linears(model: nn.Module, mode: str = "auto", *, take_turn: bool = True) -> dict[str, int]:
    """Give every module that takes one (``pack_linears(make)``: :class:`engine.layers.Linear`, attention's split
    projections, the MoE experts) its kernels. Returns ``{"layers", "packed", "few_rows"}`` counts (packed: a layer
    with any packed row range; few_rows: one whose calls of few rows run the compiled kernel). ``take_turn=False``:
    the caller holds the host's :func:`tuning_turn` already."""
    make = make_kernel(mode)
    if make is None:
        return {"layers": 0, "packed": 0, "few_rows": 0, "moe_one_call_upto": []}
    t0 = time.perf_counter()
    kernels: list[LinearKernel] = []
    with tuning_turn() if take_turn else contextlib.nullcontext():
        waited = time.perf_counter() - t0
        for module in model.modules():
            hook = getattr(module, "pack_linears", None)
            if callable(hook):
                kernels += hook(make)
    packed = sum(getattr(k, "packed", None) is not None for k in kernels)
    few = sum(getattr(k, "few_rows", None) is not None for k in kernels)
    one_call = [m.one_call_upto for m in model.modules() if hasattr(m, "one_call_upto")]
    shown = sorted({"all" if u >= cpu_kernels.ALL_STEPS else u for u in one_call}, key=str) or "-"
    logger.info("CPU linear layers: %d of %d use oneDNN packed weights for some row counts, %d the few-row kernel "
                "for up to %d rows; MoE one-call path up to %s tokens (%s, %.2f s)", packed, len(kernels), few,
                cpu_kernels.MAX_ROWS, shown, mode, time.perf_counter() - t0 - waited)
    return {"layers": len(kernels), "packed": packed, "few_rows": few, "moe_one_call_upto": one_call}
