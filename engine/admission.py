"""Admission by bytes: what a request costs an engine's one memory budget, and the typed refusal when it can never fit.

An engine's budget (``kv_cache_memory_gb``) is its block pool: plain KV blocks (text, and every block of a prompt
computed here), and the elastic region lent out of the same blocks -- cached image features
(:mod:`engine.vision_cache`) and coded visual pages (:mod:`engine.coded_kv`) -- which never takes the pool's last
``text_kv_floor`` share; and, on an engine with a vision tower, a reserve for the tower's workspace
(``encoder_workspace_mb``; :func:`engine.workspace.encoder_reserve`) taken off before the pool is sized: a prompt's
images are encoded in as many tower calls as keep within it, and an image that alone needs more is refused. A
received prompt on a ``visual_kv_cache="int8"`` engine costs its plain blocks plus its pages; anything else costs its
plain blocks. Over what the pool can *ever* give: :class:`RequestTooLargeError` naming the bytes, nothing reserved.
Over what is free *now*: the caller's retry error (``OutOfBlocksError``).
"""

from __future__ import annotations

from typing import Any

from engine.block_manager import BlockManager
from engine.coded_kv import CodedKV, coded_blocks, page_count
from engine.errors import RequestTooLargeError
from engine.sequence import Sequence
from engine.workspace import check_workspace


def plan_received(mode: str, capacity: int, seq: Sequence) -> tuple[CodedKV | None, int]:
    """How a received prompt is stored on an engine with ``visual_kv_cache=mode`` and pages of ``capacity`` tokens:
    its :class:`CodedKV` plan (pages not yet taken) and page count, or (None, 0) when it is kept plain (``plain``,
    no whole image block, or pages that would not save)."""
    bs, cap = seq.block_size, capacity
    if mode == "plain" or seq.mm is None or cap <= bs:
        return None, 0
    blocks = coded_blocks(seq.mm.positions, seq.num_prompt_tokens, bs)
    if not len(blocks):
        return None, 0
    n = len(blocks) * bs
    pages = page_count(n, cap)
    counts = [cap] * (pages - 1) + [n - cap * (pages - 1)]
    return CodedKV(blocks, [], counts, bs), pages


def check_fits(bm: BlockManager, block_bytes: int, seq: Sequence, num_tokens: int, coded: CodedKV | None = None,
               pages: int = 0) -> None:
    """Raise :class:`RequestTooLargeError` when ``seq``'s first ``num_tokens`` cannot fit the pool of ``bm`` (blocks
    of ``block_bytes``) even empty: plain blocks within the pool, pages within its elastic region, both together
    within the pool."""
    plain = -(-num_tokens // bm.block_size) - (len(coded.blocks) if coded is not None else 0)
    elastic = bm.num_blocks - bm.visual_floor
    if plain + pages <= bm.num_blocks and pages <= elastic:
        return
    coded_part = (f" + {pages} coded pages ({pages * block_bytes / 2**20:.1f} MiB) for its {coded.num_tokens} image "
                  "tokens" if coded is not None else "")
    raise RequestTooLargeError(
        f"request {seq.request_id!r}: its {num_tokens} tokens need {(plain + pages) * block_bytes:,} bytes of KV "
        f"({plain} plain blocks, {plain * block_bytes / 2**20:.1f} MiB{coded_part}); this worker's pool holds "
        f"{bm.num_blocks * block_bytes:,} bytes ({bm.num_blocks} blocks of {block_bytes:,}, at most {elastic} of them "
        f"visual pages) -- raise kv_cache_memory_gb or send fewer or smaller images")


def check_local(engine: Any, seq: Sequence) -> None:
    """A prompt an engine computes itself (:meth:`engine.llm_engine.LLMEngine.make_sequence`): its KV, every block
    plain, within the pool, and each image within the tower's workspace."""
    check_fits(engine.block_manager, engine.runner.block_bytes, seq, seq.num_tokens + 1)
    check_workspace(seq, engine.model_config, engine.workspace, engine.dtype.itemsize)
