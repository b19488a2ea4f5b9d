"""Reading a running cluster's workers: per-worker status rows and the summaries built from them (prefix cache, KV
memory, experts), and the checks benchmarks and tests use (vision caches, leaked blocks).

Functions of a :class:`~cluster.control.worker_pool.WorkerPool` (blocking Ray calls: call them off the front-end
loop) and pure functions of the status rows; :class:`~cluster.control.disagg.DisaggCluster` exposes each as a method.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from cluster.control.ray_epoch import ray_call
from node_common import messages

if TYPE_CHECKING:
    from cluster.control.worker_pool import WorkerPool


@ray_call
def status(pool: WorkerPool, timeout_s: float = 5.0) -> list[dict]:
    """One dict per worker: ``worker_id, role, alive`` and the worker's own counters (prefill: ``waiting,
    running, free_blocks``, and ``prompt_tokens`` / ``cached_tokens`` of the prompts it finished; decode:
    ``free_blocks, receiving, running, total_blocks``; both: ``kv_pool_bytes``, ``kv_mirror_bytes`` and
    ``kv_state_bytes`` (hybrid models' GDN state slots), see :func:`kv_memory_summary`; prefill:
    ``prefix_cache_off``, why it keeps no prefix cache, or None; ``vision_cache_bytes`` / ``vision_cache_entries``,
    the encoded images it keeps, :mod:`engine.vision_cache`). Prefill rows also carry the front-end's view:
    ``outstanding_tokens`` (its load signal, :mod:`cluster.control.router`), ``placed_prompt_tokens`` and
    ``predicted_cached_tokens``. A worker that does not answer within ``timeout_s`` is reported with
    ``alive=False``; a dead one the pool healer is replacing or gave up on has ``healing``."""
    import ray

    workers = [("prefill", w) for w in pool.prefills] + [("decode", w) for w in pool.decodes]
    refs = [w.actor.stats.remote() if w.alive else None for _, w in workers]
    out = []
    for (role, w), ref in zip(workers, refs, strict=True):
        row: dict[str, Any] = {"worker_id": w.worker_id, "role": role, "alive": False}
        if ref is not None:
            try:
                stats = messages.unpack(ray.get(ref, timeout=timeout_s))
                row.update({k: v for k, v in stats.items() if k not in ("v", "worker_id")}, alive=True)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                pass
        if role == "decode":
            row["total_blocks"] = pool.total_blocks.get(w.worker_id, 0)
        else:
            row.update(outstanding_tokens=w.prefill_tokens, placed_prompt_tokens=w.placed_tokens,
                       predicted_cached_tokens=w.predicted_cached_tokens)
        if not row["alive"] and (healing := pool.healer.state_of(w.worker_id)) is not None:
            row["healing"] = healing  # "respawning" or "given_up" (cluster.control.pool_healer)
        out.append(row)
    return out


def prefix_summary(rows: list[dict]) -> dict:
    """Prefix-cache hits over the prefill workers of :func:`status` ``rows``: ``hit_rate`` = cached / prompt
    tokens as the workers counted them (prompts finished), ``predicted_hit_rate`` = the router's prediction over
    the prompts it placed (None before any prompt)."""
    pre = [r for r in rows if r["role"] == "prefill"]
    prompt, cached = sum(r.get("prompt_tokens", 0) for r in pre), sum(r.get("cached_tokens", 0) for r in pre)
    placed = sum(r.get("placed_prompt_tokens", 0) for r in pre)
    predicted = sum(r.get("predicted_cached_tokens", 0) for r in pre)
    off = next((r["prefix_cache_off"] for r in pre if r.get("prefix_cache_off")), None)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else None,
            "off_reason": off,  # why the workers keep no prefix cache (hybrid models), or None
            "placed_prompt_tokens": placed, "predicted_cached_tokens": predicted,
            "predicted_hit_rate": predicted / placed if placed else None}


def kv_memory_summary(rows: list[dict]) -> dict:
    """KV bytes over the alive workers of :func:`status` ``rows``: ``pool_bytes`` (paged pools), ``mirror_bytes``
    (decode mirrors, :mod:`engine.decode_mirror`), ``state_bytes`` (hybrid models' GDN state slots) and
    ``total_bytes``, everything attention reads; the pools' regions, part of ``pool_bytes``: ``vision_cache_bytes``
    (encoded images kept in blocks the pools lend, :mod:`engine.vision_cache`), ``text_kv_bytes`` (blocks sequences
    hold, plain) and ``visual_kv_bytes`` (image KV kept coded, :mod:`engine.coded_kv`); beside the pools,
    ``encoder_workspace_bytes`` (the vision towers' reserves, :mod:`engine.workspace`)."""
    alive = [r for r in rows if r["alive"]]
    total = {key: sum(r.get(field, 0) for r in alive) for key, field in (
        ("pool_bytes", "kv_pool_bytes"), ("mirror_bytes", "kv_mirror_bytes"), ("state_bytes", "kv_state_bytes"),
        ("vision_cache_bytes", "vision_cache_bytes"), ("text_kv_bytes", "kv_text_bytes"),
        ("visual_kv_bytes", "kv_visual_bytes"), ("encoder_workspace_bytes", "encoder_workspace_bytes"))}
    return {**total, "total_bytes": total["pool_bytes"] + total["mirror_bytes"] + total["state_bytes"]}


def expert_summary(router_rows: list[dict], decode_rows: list[dict] | None) -> dict | None:
    """``{"placement_changes", "balancedness", "prewarm_hits", "prewarm_misses"}`` from the expert-parallel groups'
    router summaries (:meth:`cluster.experts.expert_router.ExpertRouter.summary`: changes summed, balancedness
    averaged over the groups that measured one) and, with tiered expert memory, the decode workers' status rows
    (``decode_rows``; None without tiers): ``prewarm_hits`` / ``prewarm_misses`` are their expert accesses (one per
    layer, step and needed expert) that found the expert resident / stalled on its load
    (:mod:`decode_node.expert_tiers`), summed. None without expert parallelism nor tiers."""
    if not router_rows and decode_rows is None:
        return None
    out: dict[str, Any] = {"placement_changes": 0, "balancedness": None, "prewarm_hits": None, "prewarm_misses": None}
    if router_rows:
        measured = [r["balancedness"] for r in router_rows if r["balancedness"] is not None]
        out.update(placement_changes=sum(r["placement_changes"] for r in router_rows),
                   balancedness=sum(measured) / len(measured) if measured else None)
    if decode_rows is not None:
        tiers = [r["expert_tiers"] for r in decode_rows if r.get("expert_tiers")]
        out.update(prewarm_hits=sum(r["expert_hits"] for r in tiers),
                   prewarm_misses=sum(r["stalled_loads"] for r in tiers))
    return out


@ray_call
def clear_vision_caches(pool: WorkerPool, timeout_s: float = 30.0) -> int:
    """Every worker forgets its cached image encodings (benchmarks); returns how many were dropped in all."""
    import ray

    return sum(ray.get([w.actor.clear_vision_cache.remote() for w in pool.workers()], timeout=timeout_s))


@ray_call
def check_no_leaks(pool: WorkerPool, timeout_s: float = 10.0) -> dict[str, int]:
    """Blocks held per live worker once idle (waits up to ``timeout_s`` for in-flight work to drain)."""
    import ray

    held: dict[str, int] = {}
    for w in pool.workers():
        if not w.alive:
            continue
        end = time.monotonic() + timeout_s
        while True:
            try:
                r = messages.unpack(ray.get(w.actor.check_no_leaks.remote(), timeout=30))
            except ray.exceptions.RayActorError:
                w.mark_dead("check_no_leaks: actor gone")
                break
            if r["idle"] or time.monotonic() > end:
                held[w.worker_id] = r["held"]
                break
            time.sleep(0.05)
    return held
