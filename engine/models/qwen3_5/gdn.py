"""Gated DeltaNet math: the causal depthwise conv with its rolling window, and the gated delta rule in two forms.

The recurrence, per value head, with state ``S [Dk, Dv]``, for token t (``g_t <= 0`` log decay, ``beta_t`` in (0, 1),
``k_t`` and ``q_t`` L2-normalised, ``q_t`` also scaled by ``Dk ** -0.5``)::

    S <- exp(g_t) * S                      decay
    S <- S + k_t (beta_t (v_t - S^T k_t))^T  delta update: write the part of v_t that S does not already predict
    o_t = S^T q_t

:func:`recurrent_step` runs it one token at a time for a batch of sequences (decode). :func:`chunked_delta_rule`
computes the same for a span of one sequence in chunks of ``chunk`` tokens (prefill): inside a chunk the sequential
updates condense into a unit lower-triangular solve (the UT / WY form of DeltaNet), and the state passes from chunk to
chunk, so a prompt may be split into any number of spans of any length with the state carried between them. Both work
in float32, as transformers' torch implementation does, and return the final state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # transformers' default chunk size


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k ``[..., Hk, Dk]`` -> float32 ``[..., Hv, Dk]``: each key head serves ``Hv / Hk`` consecutive value heads,
    both L2-normalised, q scaled by ``Dk ** -0.5``."""
    rep = num_v_heads // q.shape[-2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    q, k = _l2norm(q.float()), _l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor | None, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's span. q, k ``[n, H, Dk]`` (from :func:`prepare_qk`), v ``[n, H, Dv]``, g, beta ``[n, H]``,
    state ``[H, Dk, Dv]`` float32 or None (zeros) -> (o ``[n, H, Dv]`` float32, final state ``[H, Dk, Dv]``)."""
    n, h, dk = k.shape
    dv = v.shape[-1]
    pad = -n % chunk
    # [H, N, C, D] (heads lead, chunks of C tokens); padded tokens have beta 0 (no write) and g 0 (no decay)
    q, k, v = (F.pad(x.float().transpose(0, 1), (0, 0, 0, pad)).view(h, -1, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = (F.pad(x.float().t(), (0, pad)).view(h, -1, chunk) for x in (g, beta))
    cum = g.cumsum(-1)  # log decay from the chunk's start through each token
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(cum_i - cum_j) for j <= i, 0 above the diagonal (masked before exp: no overflow)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    kb, vb = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    # (I + strictly-lower(kb k^T * decay)) X = B: the chunk's sequential delta updates in one solve
    system = (kb @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)  # values to write
    w = torch.linalg.solve_triangular(system, kb * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # within-chunk attention, causal, decayed
    q_in = q * cum.exp().unsqueeze(-1)  # reads the state as it stood at the chunk's start
    k_out = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # writes decayed to the chunk's end
    chunk_decay = cum[..., -1].exp()
    s = torch.zeros(h, dk, dv, dtype=torch.float32, device=q.device) if state is None else state.float()
    out = torch.empty_like(v)
    for c in range(q.shape[1]):
        fresh = u[:, c] - w[:, c] @ s  # what the state before the chunk does not already predict
        out[:, c] = q_in[:, c] @ s + scores[:, c] @ fresh
        s = s * chunk_decay[:, c, None, None] + k_out[:, c].transpose(-1, -2) @ fresh
    return out.view(h, -1, dv)[:, :n].transpose(0, 1), s


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences. q, k ``[B, H, Dk]`` (from :func:`prepare_qk`), v ``[B, H, Dv]``,
    g, beta ``[B, H]``, state ``[B, H, Dk, Dv]`` float32 -> (o ``[B, H, Dv]`` float32, new state)."""
    s = state * g.float().exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", s, k)
    delta = (v.float() - predicted) * beta.float().unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return torch.einsum("bhkv,bhk->bhv", s, q), s


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over one sequence's span. x ``[n, C]``, window ``[C, K-1]`` (the previous
    inputs; zeros for a fresh sequence), weight ``[C, K]`` -> (y ``[n, C]`` in x's dtype, new window ``[C, K-1]``)."""
    full = torch.cat([window.to(weight.dtype), x.t().to(weight.dtype)], dim=-1)  # [C, K-1+n]
    y = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]
    return F.silu(y).t().to(x.dtype), full[:, full.shape[1] - window.shape[1]:]


def causal_conv_step(x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences. x ``[B, C]``, windows ``[B, C, K-1]``, weight ``[C, K]`` ->
    (y ``[B, C]``, new windows ``[B, C, K-1]``)."""
    full = torch.cat([windows.to(weight.dtype), x.unsqueeze(-1).to(weight.dtype)], dim=-1)  # [B, C, K]
    y = F.conv1d(full, weight.unsqueeze(1), groups=weight.shape[0])[..., 0]
    return F.silu(y).to(x.dtype), full[..., 1:]
