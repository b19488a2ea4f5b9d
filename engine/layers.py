"""Small numeric building blocks shared by the vision tower and the text decoder.

Each function computes exactly what the reference implementation computes (same dtype casts, same order), so the
engine's logits match transformers' to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import engine.cpu_kernels as cpu_kernels


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_new,
    "quick_gelu": _quick_gelu,
    "silu": F.silu,
    "relu": F.relu,
}


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same checkpoint keys) whose forward runs through the kernel
    :func:`engine.cpu_linear.pack_linears` gave it (oneDNN with a packed weight where that was measured faster), or
    ``F.linear`` until then."""

    kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.weight, self.bias)

    def pack_linears(self, make) -> list:
        self.kernel = make(self.weight, self.bias)
        return [self.kernel]


def _norm_kernel():
    """The compiled kernels for float32 RMSNorm on CPU (one fused pass where torch runs six element-wise ops: 12-20 us
    a call at one row on AMD EPYC), or None (not built)."""
    global _NORM_LIB
    if _NORM_LIB is False:
        _NORM_LIB = cpu_kernels.library()
    return _NORM_LIB


_NORM_LIB = False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back before the weight multiply, as Llama/Qwen3 do.

    ``weight`` broadcasts against ``x`` (e.g. ``[hidden]``, or ``[heads, head_dim]`` for per-head q/k norms).
    """
    if x.dtype == torch.float32:
        lib = _norm_kernel()
        if lib is not None and x.is_contiguous() and cpu_kernels.usable(weight) and x.device.type == "cpu" \
                and weight.dim() <= 2 and x.numel():
            return cpu_kernels.rms_norm(lib, x, weight, eps)
        return F.rms_norm(x, (x.shape[-1],), eps=eps) * weight
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


class RotaryEmbedding:
    """Default RoPE (``rope_type: default``). Tables are float32 and built once for ``max_len`` positions.

    ``rotate_half(x) * sin`` equals ``roll(x, d/2) * sin_signed`` with the first half of ``sin`` negated, which
    turns RoPE into three element-wise ops with no concatenation.
    """

    def __init__(self, head_dim: int, theta: float, max_len: int, device: torch.device | str) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = head_dim // 2
        self.cos = emb.cos().to(device)
        self.sin_signed = torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), dim=-1).to(device)
        self.max_len = max_len

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin, each [T, 1, head_dim] in ``dtype``, for positions [T]."""
        return (self.cos.index_select(0, positions).to(dtype).unsqueeze(1),
                self.sin_signed.index_select(0, positions).to(dtype).unsqueeze(1))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; tables: [T, 1, head_dim] from :meth:`RotaryEmbedding.tables`."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin_signed)
