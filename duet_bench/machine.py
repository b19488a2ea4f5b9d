"""What the machine can do at best, and what a decode step must cost at least.

Two measured rates (best of a few repetitions, torch's default thread count):

* memory read bandwidth: ``torch.sum`` over a large float32 tensor (bytes read / seconds);
* matmul rate: float32 ``torch.mm`` of a square and a decode-like skinny shape (``2*m*k*n`` / seconds).

One pure cost model, :func:`decode_step_cost`: the bytes a decode step of ``batch`` sequences must read (text-decoder
weights it touches + the KV cache) and the FLOPs it must do. :func:`decode_bound` turns both into the least time a
step can take here, ``max(bytes / bandwidth, flops / best matmul rate)``, and the fraction of that bound a measured
step time reaches (1.0 = at the machine's limit).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from engine.config import parse_text_config


@dataclass(frozen=True)
class MachineRates:
    """Measured best rates; ``read_gbps`` in GB/s (1e9 bytes), matmul rates in GFLOP/s."""

    read_gbps: float
    matmul_square_gflops: float
    matmul_skinny_gflops: float
    read_bytes: int
    square_n: int
    skinny_shape: tuple[int, int, int]
    threads: int
    device: str

    @property
    def best_gflops(self) -> float:
        return max(self.matmul_square_gflops, self.matmul_skinny_gflops)

    def to_json(self) -> dict:
        return asdict(self) | {"best_matmul_gflops": self.best_gflops, "cpu": cpu_description()}


_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
          "amx_int8", "avx_vnni")


def cpu_description() -> dict:
    """The host's CPU as every bench JSON records it: model name, logical CPUs, and the vector flags that change
    which kernels win (Linux ``/proc/cpuinfo``; elsewhere the platform's processor string and no flags)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return {"model": model, "logical_cpus": os.cpu_count(), "flags": [f for f in _FLAGS if f in flags]}


def _best_seconds(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Best wall time of ``reps`` calls of ``fn`` after one untimed call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_read_bandwidth(nbytes: int, reps: int = 5, device: str = "cpu") -> float:
    """GB/s reading a float32 tensor of ``nbytes`` with ``torch.sum`` (best of ``reps``)."""
    dev = torch.device(device)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    s = _best_seconds(lambda: torch.sum(x), reps, dev)
    return x.numel() * 4 / s / 1e9


def measure_matmul(m: int, k: int, n: int, reps: int = 5, device: str = "cpu") -> float:
    """GFLOP/s of float32 ``[m, k] @ [k, n]`` (best of ``reps``)."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(m, k, generator=gen, device=dev)
    b = torch.randn(k, n, generator=gen, device=dev)
    out = torch.empty(m, n, device=dev)
    s = _best_seconds(lambda: torch.mm(a, b, out=out), reps, dev)
    return 2 * m * k * n / s / 1e9


def measure_machine(*, quick: bool = False, device: str = "cpu") -> MachineRates:
    """Measure bandwidth and matmul rates; ``quick`` uses small sizes (seconds, for tests, not for figures)."""
    read_bytes, square, reps = (16 << 20, 256, 3) if quick else (512 << 20, 2048, 5)
    skinny = (32, 512, 2048)
    return MachineRates(
        read_gbps=measure_read_bandwidth(read_bytes, reps, device),
        matmul_square_gflops=measure_matmul(square, square, square, reps, device),
        matmul_skinny_gflops=measure_matmul(*skinny, reps=reps * 4, device=device),
        read_bytes=read_bytes, square_n=square, skinny_shape=skinny, threads=torch.get_num_threads(), device=device)


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts ``batch`` tokens touch when each picks ``top_k`` of ``num_experts`` uniformly:
    ``E * (1 - (1 - k/E)^B)`` (``k`` for B = 1, close to ``E`` for large B)."""
    assert 1 <= top_k <= num_experts and batch >= 1
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def decode_step_cost(text_config: dict, batch: int, context_len: int, kv_bytes_per_token: int,
                     dtype_bytes: int) -> tuple[int, int]:
    """(bytes read, FLOPs) of one decode step: ``batch`` sequences, one new token each, ``context_len`` keys each.

    ``text_config`` is config.json's ``text_config`` (HF key names). Bytes: every text-decoder weight the step
    touches -- attention projections, norms, router, dense MLPs and the LM head fully; per MoE layer only the
    expected distinct experts (:func:`expected_distinct_experts`); embedding rows are negligible and left out -- plus
    the KV cache, ``batch * context_len * kv_bytes_per_token``. FLOPs: ``2 * batch *`` the matmul parameters one
    token uses (its ``top_k`` experts, not all touched ones) plus attention, ``4 * heads * head_dim * context_len``
    per layer per token (QK^T and AV). Norms, rotary and softmax are left out. Both rounded down to integers.
    """
    assert batch >= 1 and context_len >= 1 and dtype_bytes >= 1
    t = parse_text_config(text_config)
    h, d = t.hidden_size, t.head_dim
    attn = h * t.num_heads * d * 2 + h * t.num_kv_heads * d * 2  # q, o + k, v
    attn_bias = (t.num_heads + 2 * t.num_kv_heads) * d + h if t.attention_bias else 0
    norms = 2 * h + (2 * d if t.qk_norm else 0)
    expert = 3 * h * t.moe_intermediate_size
    read = active = 0.0
    for is_moe in t.moe_layers:
        read += attn + attn_bias + norms
        active += attn
        if is_moe:
            router = t.num_experts * h
            read += router + expert * expected_distinct_experts(t.num_experts, t.top_k, batch)
            active += router + expert * t.top_k
        else:
            read += 3 * h * t.intermediate_size
            active += 3 * h * t.intermediate_size
    head = t.vocab_size * h
    read += h + head  # final norm + LM head
    active += head
    kv = batch * context_len * kv_bytes_per_token
    attn_flops = 4 * t.num_heads * d * context_len * t.num_layers * batch
    return int(read * dtype_bytes + kv), int(2 * active * batch + attn_flops)


def decode_bound(text_config: dict, rates: MachineRates, *, batch: int, context_len: int, kv_bytes_per_token: int,
                 dtype_bytes: int, measured_step_s: float | None) -> dict:
    """The bound for one decode shape and how close ``measured_step_s`` (e.g. the engine's TPOT) comes to it."""
    nbytes, flops = decode_step_cost(text_config, batch, context_len, kv_bytes_per_token, dtype_bytes)
    mem_s, flop_s = nbytes / (rates.read_gbps * 1e9), flops / (rates.best_gflops * 1e9)
    bound_s = max(mem_s, flop_s)
    fraction = None if not measured_step_s else bound_s / measured_step_s
    return {"batch": batch, "context_len": context_len, "bytes_per_step": nbytes, "flops_per_step": flops,
            "memory_time_s": mem_s, "compute_time_s": flop_s, "bound_step_s": bound_s,
            "limited_by": "memory" if mem_s >= flop_s else "compute", "bound_tokens_per_s": batch / bound_s,
            "measured_step_s": measured_step_s, "fraction_of_bound": fraction}
