"""Importance of a prompt's KV channels and tokens, scored with the prompt's own last queries.

Used by the prefill side to decide what the wire may prune (:mod:`kv_transfer.compression`):

* key channels (ThinK-style): channel ``c`` of KV head ``h`` contributes ``q[:, c] * k[:, c]`` to every attention
  logit, so its weight is ``||q_window[:, group(h), c]|| * ||k[:, h, c]||``;
* value channels: the norm of channel ``c`` in the window's attention outputs, ``||A_h @ v[:, h, c]||``;
* tokens (FastV-style): the attention each key receives from the window's *text* queries, averaged over heads.

The window is the prompt's last ``W`` tokens (the question that follows the image). Everything is a few small
matrix products per layer, on the device the KV is on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVImportance:
    k_channel: torch.Tensor  # [kv_heads, head_dim]
    v_channel: torch.Tensor  # [kv_heads, head_dim]
    token: torch.Tensor  # [num_tokens]


def kv_importance(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                  query_is_text: torch.Tensor | None = None) -> KVImportance:
    """Scores for one layer of one prompt.

    q: ``[W, H, D]`` queries of the prompt's last W tokens (after RoPE); k, v: ``[T, KVH, D]`` the prompt's keys
    (after RoPE) and values, T >= W; the window's query ``i`` sits at position ``T - W + i`` and sees keys up to it.
    ``query_is_text`` ([W] bool): which window queries vote for token scores (default: all).
    """
    w, h, d = q.shape
    t, kvh, _ = k.shape
    g = h // kvh
    qf, kf, vf = q.float().view(w, kvh, g, d), k.float(), v.float()
    k_channel = qf.square().sum(dim=(0, 2)).sqrt() * kf.square().sum(dim=0).sqrt()  # [KVH, D]
    logits = torch.einsum("wkgd,tkd->kgwt", qf, kf) * scale  # [KVH, G, W, T]
    q_pos = torch.arange(t - w, t, device=k.device).view(w, 1)
    logits = logits.masked_fill(torch.arange(t, device=k.device).view(1, t) > q_pos, float("-inf"))
    attn = logits.softmax(dim=-1)
    out = torch.einsum("kgwt,tkd->kgwd", attn, vf)  # [KVH, G, W, D]
    v_channel = out.square().sum(dim=(1, 2)).sqrt()
    voters = attn if query_is_text is None else attn[:, :, query_is_text.to(k.device)]
    token = voters.mean(dim=(0, 1, 2)) if voters.shape[2] else attn.mean(dim=(0, 1, 2))
    return KVImportance(k_channel, v_channel, token)
