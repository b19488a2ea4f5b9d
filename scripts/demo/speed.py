"""The demo trainer's precision and weight averaging: matrix products under a bfloat16 autocast where the CPU
multiplies bfloat16 natively (attention kept in float32), and an exponential moving average of the weights, saved
instead of the last step's."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

PRECISIONS = ("auto", "float32", "bfloat16")


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512_BF16 or AMX-BF16 in its flags): a bfloat16 matrix
    product of the tower's shapes ran 3.7x the float32 one on an AMD EPYC (Zen 5, 2 threads); without those
    instructions bfloat16 is emulated and slower than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_precision(precision: str) -> str:
    """``auto`` -> ``bfloat16`` where the CPU has native bfloat16, else ``float32``; the others as given."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} (known: {', '.join(PRECISIONS)})")
    if precision == "auto":
        return "bfloat16" if native_bfloat16() else "float32"
    return precision


def _fp32_sdpa(module, query, key, value, attention_mask, **kwargs):
    """Attention in float32 under a bfloat16 autocast: the CPU's bfloat16 flash-attention backward took three times
    its float32 time here, more than the bfloat16 matrix products saved."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with torch.autocast("cpu", enabled=False):
        return sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)


def use_fp32_attention(model, on: bool = True) -> None:
    """Route the model's attention through :func:`_fp32_sdpa` (``on``) or back to plain SDPA."""
    from transformers import AttentionInterface

    if on:
        AttentionInterface.register("fp32_sdpa", _fp32_sdpa)
    model.set_attn_implementation("fp32_sdpa" if on else "sdpa")


class WeightAverage:
    """Exponential moving average of ``model``'s weights, its decay warmed up over the first steps
    (``min(decay, (1 + step) / (10 + step))``)."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"weight-average decay must lie in (0, 1), not {decay}")
        self.params = list(model.parameters())
        self.decay = decay
        self.averaged = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        decay = min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(self.averaged, [p.detach() for p in self.params], 1.0 - decay)

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the model's weights with the averaged ones."""
        for p, a in zip(self.params, self.averaged, strict=True):
            held = p.detach().clone()
            p.copy_(a)
            a.copy_(held)

    @contextmanager
    def applied(self):
        """The model holds the averaged weights inside, its own again after."""
        self.swap()
        try:
            yield
        finally:
            self.swap()
