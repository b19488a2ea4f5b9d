"""OpenAI's two logprobs shapes, from the engine's :class:`~engine.outputs.TokenLogprobs` (pure).

Chat (``logprobs: true`` + ``top_logprobs``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
"logprob", "bytes"}]}]}``. Completions (``logprobs: k``): ``{"tokens", "token_logprobs", "top_logprobs": [{token:
logprob}], "text_offset"}``. A token's text is its own decoding (special tokens included); ``-inf`` (a token top-k /
top-p removed) is written as -9999.0, as vLLM does, since JSON has no infinity.
"""

from __future__ import annotations

import math
from typing import Any

from engine.outputs import TokenLogprobs

FLOOR = -9999.0


def _lp(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


def _entry(tok: Any, token_id: int, logprob: float) -> dict:
    text = token_text(tok, token_id)
    return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}


def token_text(tok: Any, token_id: int) -> str:
    """One token's text (``""`` without a tokenizer)."""
    return tok.decode([token_id], skip_special_tokens=False) if tok is not None else ""


def chat_logprobs(tok: Any, lps: list[TokenLogprobs]) -> dict:
    return {"content": [{**_entry(tok, lp.token_id, lp.logprob),
                         "top_logprobs": [_entry(tok, t, x) for t, x in lp.top]} for lp in lps]}


def completion_logprobs(tok: Any, lps: list[TokenLogprobs], offset: int = 0) -> dict:
    """``offset``: the text offset of the first token (the length of text already returned before it)."""
    tokens = [token_text(tok, lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [_lp(lp.logprob) for lp in lps],
            "top_logprobs": [{token_text(tok, t): _lp(x) for t, x in lp.top} for lp in lps], "text_offset": offsets}


def prompt_logprobs(tok: Any, ids: list[int], lps: list[TokenLogprobs | None]) -> dict:
    """Completions' ``echo`` with ``logprobs``: the prompt tokens' part (the first token has none: ``None``)."""
    tokens = [token_text(tok, t) for t in ids]
    offsets, offset = [], 0
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [None if lp is None else _lp(lp.logprob) for lp in lps],
            "top_logprobs": [None if lp is None else {token_text(tok, t): _lp(x) for t, x in lp.top} for lp in lps],
            "text_offset": offsets}


def joined(first: dict | None, second: dict) -> dict:
    """Two completions logprobs dicts, one after the other."""
    return second if first is None else {k: first[k] + second[k] for k in second}
