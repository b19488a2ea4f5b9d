"""Sparse MoE block: reference-exact top-k routing, execution grouped by expert, per-expert token counts.

Routing follows transformers exactly: router logits in the model dtype, softmax in float32, top-k, optional
renormalisation (``norm_topk_prob``; Mixtral always renormalises), and for Qwen3-MoE a cast of the weights back to
the model dtype. Execution sorts the (token, slot) pairs by expert and runs one gate/up/down per expert that received
tokens. ``expert_counts`` accumulates how many tokens each expert received; later stages place experts from it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import TextConfig
from engine.layers import ACTIVATIONS


class SparseMoe(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.top_k = e, cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weights_in_model_dtype = cfg.model_type == "qwen3_moe"
        self.gate = nn.Linear(h, e, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))  # [E, 2I, H]: gate rows then up rows
        self.down_proj = nn.Parameter(torch.empty(e, h, i))  # [E, H, I]
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.register_buffer("expert_counts", torch.zeros(e, dtype=torch.int64), persistent=False)

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
        weights, experts = self.route(x)
        flat = experts.view(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.expert_counts += counts
        token_of = order // self.top_k
        flat_w = weights.view(-1)[order].unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c == 0:
                continue
            tok = token_of[start:start + c]
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_proj[e]) * flat_w[start:start + c]
            out.index_add_(0, tok, y.to(out.dtype))
            start += c
        return out


class DenseMlp(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
