"""KV importance scores (engine/kv_importance.py) against a direct per-head, per-query computation."""

from __future__ import annotations

import math

import pytest
import torch

from engine.kv_importance import kv_importance


def _reference(q, k, v, scale, query_is_text):
    w, h, d = q.shape
    t, kvh, _ = k.shape
    g = h // kvh
    k_channel = torch.zeros(kvh, d)
    v_out = torch.zeros(kvh, d)
    token = torch.zeros(t)
    votes = 0
    for head in range(h):
        kh = head // g
        for c in range(d):
            k_channel[kh, c] += float(q[:, head, c].square().sum())
        for i in range(w):
            pos = t - w + i
            logits = torch.tensor([float(q[i, head] @ k[j, kh]) * scale if j <= pos else -math.inf for j in range(t)])
            a = logits.softmax(0)
            v_out[kh] += (a @ v[:, kh]).square()
            if query_is_text[i]:
                token += a
                votes += 1
    k_channel = k_channel.sqrt() * k.square().sum(0).sqrt()
    return k_channel, v_out.sqrt(), token / votes


@pytest.mark.parametrize("heads,kv_heads,window,tokens", [(4, 2, 3, 7), (2, 2, 5, 5), (6, 1, 1, 9)])
def test_scores_match_direct_computation(heads, kv_heads, window, tokens):
    g = torch.Generator().manual_seed(heads * 100 + tokens)
    d = 8
    q = torch.randn(window, heads, d, generator=g)
    k = torch.randn(tokens, kv_heads, d, generator=g)
    v = torch.randn(tokens, kv_heads, d, generator=g)
    text = torch.tensor([i % 2 == 0 for i in range(window)])
    got = kv_importance(q, k, v, scale=d ** -0.5, query_is_text=text)
    kc, vc, tok = _reference(q, k, v, d ** -0.5, text)
    torch.testing.assert_close(got.k_channel, kc, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.v_channel, vc, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.token, tok, rtol=1e-5, atol=1e-6)
    if tokens > window:
        assert got.token[: tokens - window].sum() > 0  # keys before the window get votes too


def test_token_scores_fall_back_to_all_queries_without_text_votes():
    q, k, v = torch.randn(2, 2, 4), torch.randn(5, 1, 4), torch.randn(5, 1, 4)
    got = kv_importance(q, k, v, scale=0.5, query_is_text=torch.tensor([False, False]))
    torch.testing.assert_close(got.token, kv_importance(q, k, v, scale=0.5).token)
    assert float(got.token.sum()) == pytest.approx(1.0, rel=1e-5)
