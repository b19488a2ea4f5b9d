"""The CPU kernels of ``cpu_kernels.c`` (few rows), ``cpu_attention.c`` (prefill attention) and ``cpu_panels.c``
(experts stored in panels, :func:`panel_pack`), compiled on the host at first use and called through ctypes.

Why they exist: a decode step reads every weight once for one or a few rows, and library GEMMs at one row read
memory at a third of what the core can (``cpu_kernels.c`` says how they differ). Whether they are faster is measured
per weight shape at load (:mod:`engine.cpu_linear`, :mod:`engine.moe`), as for every other CPU kernel choice. The
rest fuse what torch runs as several ops (RMSNorm, add + norm, q/k norm + rotary, decode attention with its KV
writes, the MoE router) and, :func:`decode_layer`, chain them into one call per decoder layer for decode steps of a
few sequences, whose time is otherwise mostly per-op overhead.

Build: the system C compiler (``$CC`` or ``cc``) with ``-O3 -march=native``, so the code is vectorized for this CPU.
The library is cached under ``$DUET_KERNEL_CACHE`` (default ``~/.cache/duet/kernels``), named by a hash of the
source, the flags, the compiler's version and the CPU's model and flags: a host of another kind builds its own, and
processes on one host build once (written to a temporary name, then renamed into place). No compiler, a failed
build, or ``DUET_CPU_KERNELS=0``: :func:`library` returns None and every layer keeps the library kernels (logged once).
Calls pass raw pointers of contiguous float32 tensors; the wrappers below check what the C code assumes.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from engine.cpu_attention import ATTENTION_MAX_HEAD_DIM, prefill_attention, prefill_attention_fits  # noqa: F401

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(n) for n in ("cpu_kernels.c", "cpu_attention.c", "cpu_panels.c"))  # one .so
HEADER = Path(__file__).with_name("cpu_kernels.h")  # the vector helpers they include
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno")
OPENMP = ("-fopenmp",)  # tried first: libgomp's soname is the one torch loaded, so the kernels share its threads
BUILD_TIMEOUT_S = 120.0
MAX_ROWS = 4  # rows a call is meant for: beyond this the library GEMMs reuse each weight line better
MAX_TOP_K = 64  # top-k the MoE kernel is offered for (routers use 1-10)
ALL_STEPS = 1 << 62  # a token limit meaning none (the MoE one-call path where it won every probe)
TILE_MIN = 16  # an expert's rows from which moe_silu takes its tiled GEMM (8-32 within noise, Intel Xeon)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_p = ctypes.c_void_p
_i = ctypes.c_int64


def _cpu_signature() -> str:
    """The CPU's model name and feature flags (Linux), else the platform's processor string."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _cache_dir() -> Path:
    base = os.environ.get("DUET_KERNEL_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "duet" / "kernels"


def _build(cc: str, flags: tuple[str, ...]) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    source = b"\0".join(f.read_bytes() for f in (*SOURCES, HEADER))
    key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:20]
    out = _cache_dir() / f"duet_cpu_kernels_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: a process building beside this one finds either nothing or the whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on the first call in a process (None where they cannot be: see the module)."""
    global _lib, _tried
    if _tried:  # built (or refused) already: no lock on the per-step path
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("DUET_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
            logger.info("CPU few-row kernels off (DUET_CPU_KERNELS)")
            return None
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            logger.warning("no C compiler found: the few-row CPU kernels are not built (library kernels only)")
            return None
        lib, errors = None, []
        for flags in ((*FLAGS, *OPENMP), FLAGS):  # without OpenMP where it does not build or load: one thread
            try:
                lib = ctypes.CDLL(str(_build(cc, flags)))
                break
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                errors.append(str(exc))
        if lib is None:
            logger.warning("the few-row CPU kernels did not build (%s): library kernels only", "; ".join(errors))
            return None
        _declare(lib)
        _lib = lib
        return lib


def _declare(lib: ctypes.CDLL) -> None:
    """The C functions' argument and result types (ctypes would otherwise pass every int as 32 bits)."""
    lib.duet_linear_f32.argtypes = [_p, _i, _i, _p, _i, _p, _p]
    lib.duet_linear_f32.restype = None
    lib.duet_set_linear_tile_rows.argtypes = [_i]
    lib.duet_set_linear_tile_rows.restype = None
    lib.duet_moe_silu_f32.argtypes = [_p, _i, _i, _i, _i, _p, _p, _p, _p, _i, _i, ctypes.c_int, _p, _p, _p]
    lib.duet_moe_silu_scratch.argtypes = [_i] * 6
    lib.duet_moe_silu_scratch.restype = _i
    lib.duet_moe_silu_f32.restype = None
    lib.duet_rms_norm_f32.argtypes = [_p, _i, _i, _p, _i, ctypes.c_float, _p]
    lib.duet_rms_norm_f32.restype = None
    lib.duet_add_rms_norm_f32.argtypes = [_p, _p, _i, _i, _p, ctypes.c_float, _p, _p]
    lib.duet_add_rms_norm_f32.restype = None
    lib.duet_norm_rope_f32.argtypes = [_p, _i, _i, _i, _p, ctypes.c_float, _p, _p]
    lib.duet_norm_rope_f32.restype = None
    lib.duet_decode_attention_f32.argtypes = [_p, _i, _p, _i, _p, _i, _p, _p, _p, _p, _p, _p, _p, _i, _i, _i, _i,
                                              _i, ctypes.c_float, _p, _i, _p, _p, _p, _i, _i, _p, _p, _p]
    lib.duet_decode_layer_scratch.argtypes = [_i] * 9
    lib.duet_decode_layer_scratch.restype = _i
    lib.duet_decode_layer_f32.argtypes = [_p, _i, _i, ctypes.c_float, _p, _p, _p, _p, _i, _i, _i, _p,
                                          ctypes.c_float, _p, _p, _p, _p, _p, _p, _i, _i, _p, _p, _p, _p, _p,
                                          _i, _i, ctypes.c_int, _p, _p, _p, _i, ctypes.c_int, _p, _p, _p, _p,
                                          _i, _i, _p, _p, _p]
    lib.duet_decode_layer_f32.restype = None
    lib.duet_decode_attention_f32.restype = None
    lib.duet_moe_route_f32.argtypes = [_p, _i, _i, _p, _i, _i, ctypes.c_int, _p, _p, _p, _p]
    lib.duet_moe_route_f32.restype = None
    lib.duet_prefill_attention_scratch.argtypes = [_i, _i, _i]
    lib.duet_prefill_attention_scratch.restype = _i
    lib.duet_prefill_attention_f32.argtypes = [_p, _i, _p, _i, _i, _p, _i, _i, _i, _i, _i, _i, _i, ctypes.c_float,
                                               ctypes.c_int, _p, _p, _i]
    lib.duet_prefill_attention_f32.restype = None


def usable(t: torch.Tensor) -> bool:
    """Can the kernels read ``t`` as it is (CPU, float32, contiguous)?"""
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


def linear(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [..., K] with few rows; ``weight`` [N, K] and ``bias`` must be
    :func:`usable` (the caller checks once, when it chooses this kernel)."""
    k, n = weight.shape[1], weight.shape[0]
    if x.shape[-1] != k:
        raise ValueError(f"linear: input has {x.shape[-1]} features, the weight takes {k}")
    x2 = x.reshape(-1, k)
    if not usable(x2):
        x2 = x2.contiguous().float()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    lib.duet_linear_f32(x2.data_ptr(), x2.shape[0], k, weight.data_ptr(), n,
                        None if bias is None else bias.data_ptr(), y.data_ptr())
    return y.view(*x.shape[:-1], n)


PANEL, VW = 64, 16  # rows per panel of panel_pack, floats per vector (PANEL and VW in cpu_kernels.h)


def panels_fit(w: torch.Tensor) -> bool:
    """Can :func:`panel_pack` lay out ``w`` [..., N, K] (float32 on CPU, N a whole number of vectors)?"""
    return usable(w) and w.dim() >= 2 and w.shape[-2] % VW == 0 and w.shape[-1] > 0


def _panels(n: int) -> list[tuple[int, int]]:
    return [(n0, min(PANEL, n - n0)) for n0 in range(0, n, PANEL)]  # (first row, rows) of each panel


def panel_pack(w: torch.Tensor) -> torch.Tensor:
    """``w`` [..., N, K] in panels, the layout the experts' kernels stream (``cpu_panels.c``): rows [n0, n0 + pw) of
    each matrix as K rows of pw floats, panel after panel (pw = PANEL, the last one the rows left). Same shape and
    size; only :func:`panel_unpack` reads it back as a matrix."""
    n, k = w.shape[-2:]
    flat = w.reshape(-1, n, k)
    return torch.cat([flat[:, a:a + pw].transpose(1, 2).reshape(len(flat), -1) for a, pw in _panels(n)], 1).view(w.shape)


def panel_unpack(p: torch.Tensor) -> torch.Tensor:
    """The matrices :func:`panel_pack` laid out, row-major again."""
    n, k = p.shape[-2:]
    flat = p.reshape(-1, n * k)
    return torch.cat([flat[:, a * k:(a + pw) * k].view(-1, k, pw).transpose(1, 2) for a, pw in _panels(n)],
                     1).contiguous().view(p.shape)


def moe_silu(lib: ctypes.CDLL, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
             weights: torch.Tensor, *, checked: bool = False, tile_min: int = TILE_MIN,
             panel: bool = False) -> torch.Tensor:
    """Routed SwiGLU experts for x [T, H] (float32): ``gate_up`` [E, 2I, H], ``down`` [E, H, I] (both
    :func:`usable`), ``experts`` [T, k] ids < E, ``weights`` [T, k]. Each expert with tokens runs once over all of
    them; each token's experts are summed in ascending id order, as the grouped path sums them. ``checked``: the
    ids come from :func:`moe_route` (in range by construction), so the range check is skipped. ``tile_min``: an
    expert with at least this many rows takes the tiled GEMM instead of gemv (``cpu_kernels.c``). ``panel``: both
    weights are :func:`panel_pack`'s layout."""
    t, h = x.shape
    e, two_i, _ = gate_up.shape
    i = two_i // 2
    k = experts.shape[1]
    if k > MAX_TOP_K:
        raise ValueError(f"moe_silu: top-{k} exceeds the kernel's {MAX_TOP_K}")
    if weights.shape != experts.shape or experts.shape[0] != t:
        raise ValueError(f"moe_silu: {t} tokens, expert ids {tuple(experts.shape)}, weights {tuple(weights.shape)}")
    ids = experts.to(torch.int64).contiguous()
    flat = [] if checked else ids.view(-1).tolist()
    if flat and (min(flat) < 0 or max(flat) >= e):  # the kernel indexes the weights by these: never out of range
        raise ValueError(f"moe_silu: expert ids outside [0, {e})")
    w = weights.to(torch.float32).contiguous()
    xc = x.contiguous()
    tile_min = ALL_STEPS if panel else max(int(tile_min), 1)  # over panels every expert takes panel_gemv
    fscratch = torch.empty(lib.duet_moe_silu_scratch(t, h, i, e, k, tile_min), dtype=torch.float32)
    iscratch = torch.empty(4 * e + 2 * t * k, dtype=torch.int64)
    y = torch.empty(t, h, dtype=torch.float32)
    lib.duet_moe_silu_f32(xc.data_ptr(), t, h, i, e, gate_up.data_ptr(), down.data_ptr(), ids.data_ptr(),
                          w.data_ptr(), k, tile_min, int(panel), fscratch.data_ptr(), iscratch.data_ptr(),
                          y.data_ptr())
    return y


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (H,), eps=eps) * weight`` for float32 x [..., H] (contiguous) and a contiguous float32
    ``weight`` of shape [H] or [R, H] broadcast over x's last two dimensions (per-head norms: x [..., R, H])."""
    h = x.shape[-1]
    wrows = weight.numel() // h
    if weight.shape[-1] != h or (wrows > 1 and (x.dim() < 2 or x.shape[-2] != wrows)):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not broadcast over x {tuple(x.shape)}")
    y = torch.empty_like(x)
    lib.duet_rms_norm_f32(x.data_ptr(), x.numel() // h if h else 0, h, weight.data_ptr(), wrows, eps, y.data_ptr())
    return y


def add_rms_norm(lib: ctypes.CDLL, x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + r, rms_norm(x + r) * weight) in one pass, for contiguous float32 x and r of one shape [..., H]."""
    h = x.shape[-1]
    if r.shape != x.shape or weight.shape != (h,):
        raise ValueError(f"add_rms_norm: shapes {tuple(x.shape)} + {tuple(r.shape)}, weight {tuple(weight.shape)}")
    s, y = torch.empty_like(x), torch.empty_like(x)
    lib.duet_add_rms_norm_f32(x.data_ptr(), r.data_ptr(), x.numel() // h if h else 0, h, weight.data_ptr(), eps,
                              s.data_ptr(), y.data_ptr())
    return s, y


def norm_rope(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
              sin_signed: torch.Tensor) -> torch.Tensor:
    """In place on contiguous float32 x [T, R, D]: per-head RMSNorm (``weight`` [R, D], or None for none), then
    rotary with tables cos / sin_signed of T * D floats (:meth:`engine.layers.RotaryEmbedding.tables`). Returns x."""
    t, r, d = x.shape
    if d % 2 or cos.numel() != t * d or sin_signed.numel() != t * d or (weight is not None and weight.numel() != r * d):
        raise ValueError(f"norm_rope: x {tuple(x.shape)}, tables {tuple(cos.shape)}")
    lib.duet_norm_rope_f32(x.data_ptr(), t, r, d, None if weight is None else weight.data_ptr(), eps,
                           cos.data_ptr(), sin_signed.data_ptr())
    return x


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mirror_k: torch.Tensor,
                     mirror_v: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, max_len: int, scale: float,
                     pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, coded: Any = None,
                     pages: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One query per sequence: write k, v [B, KVH, D] at ``pos`` [B] of mirror rows ``slots`` [B] (int64; the
    mirror [S, KVH, cap, D]) and, with ``pool`` = (k_pool, v_pool, pool slots [B]), into the paged pool; then q
    [B, H, D] attends over positions 0..pos of its row (``max_len`` > every pos) and, with ``coded``
    (:class:`engine.coded_kv.CodedRows`), over each row's coded pages in ``pages`` (the layer's pool k, v).
    Float32; q, k and v may be row slices of wider rows (each token's heads contiguous), the rest contiguous; the
    caller guarantees the slots and positions are in range (the model runner built them). Returns [B, H, D]."""
    b, h, d = q.shape
    s, kvh, cap, _ = mirror_k.shape
    for t, n in ((q, h), (k, kvh), (v, kvh)):
        if t.stride()[1:] != (d, 1) or t.shape != (b, n, d):
            raise ValueError(f"decode_attention: a [{b}, {n}, {d}] operand has shape {tuple(t.shape)}, strides "
                             f"{t.stride()}")
    lds = max(max_len, 1, 0 if coded is None else coded.max_keys)
    scratch = torch.empty(b * h * lds, dtype=torch.float32)
    out = torch.empty_like(q)
    pk, pv, ps = (None, None, None) if pool is None else (pool[0].data_ptr(), pool[1].data_ptr(), pool[2].data_ptr())
    lib.duet_decode_attention_f32(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                  mirror_k.data_ptr(), mirror_v.data_ptr(), slots.data_ptr(), pos.data_ptr(), pk, pv,
                                  ps, b, h, kvh, d, cap, scale, scratch.data_ptr(), lds, out.data_ptr(),
                                  *_page_args(coded, pages))
    return out


def _page_args(coded: Any, pages: tuple[torch.Tensor, torch.Tensor] | None) -> tuple:
    """The kernels' coded-page arguments (page_k, page_v, floats a block, page capacity, offsets, blocks, counts)."""
    if coded is None:
        return None, None, 0, 0, None, None, None
    assert pages is not None and pages[0].dtype == torch.float32, "coded pages are read from a float32 pool"
    return (pages[0].data_ptr(), pages[1].data_ptr(), pages[0][0].numel(), coded.capacity, coded.off.data_ptr(),
            coded.blk.data_ptr(), coded.n.data_ptr())


def moe_route(lib: ctypes.CDLL, x: torch.Tensor, gate: torch.Tensor, k: int, norm: bool,
              counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's (weights [T, k] float32, expert ids [T, k] int64) for contiguous float32 x [T, H] and gate [E, H]:
    softmax, top-k (descending, ties to the lower id), renormalized when ``norm``; ``counts`` [E] int64 += picks."""
    t, h = x.shape
    e = gate.shape[0]
    if not 1 <= k <= e or gate.shape[1] != h or counts.shape != (e,) or counts.dtype != torch.int64:
        raise ValueError(f"moe_route: top-{k} of gate {tuple(gate.shape)} for x {tuple(x.shape)}")
    logits = torch.empty(t * e, dtype=torch.float32)
    weights = torch.empty(t, k, dtype=torch.float32)
    ids = torch.empty(t, k, dtype=torch.int64)
    lib.duet_moe_route_f32(x.data_ptr(), t, h, gate.data_ptr(), e, k, int(norm), logits.data_ptr(),
                           weights.data_ptr(), ids.data_ptr(), counts.data_ptr())
    return weights, ids


_scratches = threading.local()


def _scratch(kind: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    """At least ``n`` elements of this thread's scratch of ``kind``, kept between calls (a decode step's layers run
    one after another on one thread; grown, never shrunk): allocating it per layer cost more than some kernels."""
    buf = getattr(_scratches, kind, None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(max(n, 1), dtype=dtype)
        setattr(_scratches, kind, buf)
    return buf


def decode_layer(lib: ctypes.CDLL, x: torch.Tensor, *, eps: float, ln1: torch.Tensor, ln2: torch.Tensor,
                 wqkv: torch.Tensor, bqkv: torch.Tensor | None, heads: int, kv_heads: int, head_dim: int,
                 qk_norm: torch.Tensor | None, scale: float, cos: torch.Tensor, sin_signed: torch.Tensor,
                 mirror: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, pos: torch.Tensor, max_len: int,
                 pool: tuple[torch.Tensor, torch.Tensor, torch.Tensor], wo: torch.Tensor, bo: torch.Tensor | None,
                 gate_up: torch.Tensor, down: torch.Tensor, router: torch.Tensor | None = None, top_k: int = 1,
                 norm_topk: bool = False, counts: torch.Tensor | None = None, panel: bool = False,
                 coded: Any = None) -> torch.Tensor:
    """A whole decoder layer for a decode step of x [B, H] (``duet_decode_layer_f32``): returns the layer's output
    [B, H]; the step's keys and values land in ``mirror`` (k, v [S, KVH, cap, D]) rows ``slots`` at ``pos`` and in
    the paged ``pool`` (k, v, flat slots [B]). MoE when ``router`` [E, H] is given (``gate_up`` [E, 2I, H],
    ``down`` [E, H, I], ``counts`` [E] += picks), else one SwiGLU MLP (``gate_up`` [2I, H], ``down`` [H, I]); those
    two in :func:`panel_pack`'s layout where ``panel``; ``coded``: rows' coded pages in ``pool`` (decode_attention).
    Everything float32 and contiguous, slots and positions in range: the caller (:class:`engine.text_model.
    DecoderLayer`) checks what it cannot know by construction."""
    b, h = x.shape
    e = 0 if router is None else router.shape[0]
    kk = top_k if e else 1
    if e and not 1 <= top_k <= min(e, MAX_TOP_K):
        raise ValueError(f"decode_layer: top-{top_k} of {e} experts")
    i = down.shape[-1]
    lds = max(max_len, 1, 0 if coded is None else coded.max_keys)
    fs = _scratch("f", lib.duet_decode_layer_scratch(b, h, heads, kv_heads, head_dim, lds, e, kk, i), torch.float32)
    iscr = _scratch("i", 4 * max(e, 1) + 3 * b * kk, torch.int64)
    y = torch.empty_like(x)
    lib.duet_decode_layer_f32(
        x.data_ptr(), b, h, eps, ln1.data_ptr(), ln2.data_ptr(), wqkv.data_ptr(),
        None if bqkv is None else bqkv.data_ptr(), heads, kv_heads, head_dim,
        None if qk_norm is None else qk_norm.data_ptr(), scale, cos.data_ptr(), sin_signed.data_ptr(),
        mirror[0].data_ptr(), mirror[1].data_ptr(), slots.data_ptr(), pos.data_ptr(), mirror[0].shape[2], lds,
        pool[0].data_ptr(), pool[1].data_ptr(), pool[2].data_ptr(), wo.data_ptr(), None if bo is None else bo.data_ptr(),
        e, kk, int(norm_topk), None if router is None else router.data_ptr(), gate_up.data_ptr(), down.data_ptr(), i,
        int(panel), None if counts is None else counts.data_ptr(), fs.data_ptr(), iscr.data_ptr(), y.data_ptr(),
        *_page_args(coded, pool[:2])[2:])
    return y
