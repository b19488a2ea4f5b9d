"""``duet bench memory --model qwen3-vl-moe``: one decode worker at one memory budget, today's static pool against the
unified pool that keeps received image KV coded (:mod:`engine.coded_kv`).

Both sides run the real data path in one process (:class:`~cluster.control.local_pair.LocalPair`: prefill worker ->
codec -> frames -> decode worker), the decode worker at ``--budget-mb`` (``kv_cache_memory_gb``):

* ``static``: ``kv_compression none``, ``visual_kv_cache plain`` -- every token plain in the pool (and again in the
  decode mirror while it decodes);
* ``unified``: ``kv_compression default`` (visual int8 on the wire), ``visual_kv_cache int8`` -- the image blocks in
  coded pages lent from the same pool.

Measured: **concurrent** -- how many one-image ``--side``² requests the decode worker admits at once with room left
for each one's ``--tokens`` (preallocated until the pool refuses), then *run* at that concurrency through the pair --
all allocated, prefilled and transferred, then decoded together: every request must complete with no preemption and
no failure; **agreement** -- greedy tokens of ``unified`` against ``static`` on ``--agreement-prompts`` other
requests of ``--agreement-tokens`` (in batches the static side holds); **tpot_ratio** -- unified / static decode step
time (a token for each request) with the static side's concurrency decoding together (rounds alternate which runs
first; medians); **eight_1024_images** -- one request with eight ``--side``² images at a budget that fits it (it
completes) and at one that does not (refused with the typed :class:`~engine.errors.RequestTooLargeError` naming the
bytes; nothing reserved). Random weights: agreement is pessimistic. Prints a table, writes ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import itertools
import statistics
import sys
import time
from pathlib import Path

from cluster.control.local_pair import LocalPair
from cluster.report import fmt, format_table, log, write_json
from duet_bench.kvcodec_measure import agreement
from duet_bench.machine import cpu_description
from duet_bench.qwen_bench import QWEN_BENCH_SPEC, QwenPrompts
from engine import EngineConfig, SamplingParams
from engine.decode_mirror import reserved_bytes
from engine.errors import OutOfBlocksError, RequestTooLargeError
from kv_transfer.compression import resolve_policy
from kv_transfer.lease import LeasePolicy

MODEL_NAME = "bench-qwen3-vl-moe-v1-16k"  # the Qwen bench model with room for eight 1024² images in one prompt
SPEC = dataclasses.replace(QWEN_BENCH_SPEC, max_position_embeddings=16384)
DEFAULT_BUDGET_MB, DEFAULT_SIDE, DEFAULT_TOKENS, DEFAULT_ROUNDS = 64, 1024, 16, 2
MODES = {"static": (None, "plain"), "unified": ("default", "int8")}  # wire policy, decode cache
PREFILL_BUDGET_GB = 0.5
LEASE_S = 900.0
_ids = itertools.count()  # the prefill worker's own pool: it computes an eight-image prompt plain


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=("qwen3-vl-moe",), default="qwen3-vl-moe",
                   help="the Qwen3-VL-MoE bench model (random weights, 16k positions), built once")
    p.add_argument("--model-dir", default=None, help="a Qwen3-VL-MoE checkpoint instead of the bench model")
    p.add_argument("--budget-mb", type=float, default=DEFAULT_BUDGET_MB, help="the decode worker's memory budget")
    p.add_argument("--side", type=int, default=DEFAULT_SIDE, help="square image side in pixels")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="tokens generated per request (greedy)")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="TPOT rounds per side, alternating")
    p.add_argument("--agreement-prompts", type=int, default=6, help="requests greedy agreement is measured on")
    p.add_argument("--agreement-tokens", type=int, default=32, help="tokens each of them generates")
    p.add_argument("--json", default="bench_out/memory.json", help="where to write the results")


def model_dir(args: argparse.Namespace) -> Path:
    if args.model_dir:
        return Path(args.model_dir)
    from cluster.demo import cached_model
    from duet_testing.qwen_checkpoints import make_tiny_qwen_checkpoint

    return cached_model(MODEL_NAME, lambda p: make_tiny_qwen_checkpoint(p, SPEC))


def decode_config(mode: str, budget_bytes: int, max_len: int) -> EngineConfig:
    return EngineConfig(dtype="float32", kv_cache_memory_gb=budget_bytes / 2**30, max_num_seqs=64,
                        max_model_len=max_len, vision_tower=False, vision_cache_mb=0,
                        visual_kv_cache=MODES[mode][1])


def make_pair(path: Path, mode: str, budget_bytes: int, max_len: int) -> LocalPair:
    """A prefill -> decode pair whose decode worker runs ``mode`` at ``budget_bytes``. ``max_len``: the longest
    request; the static side's plain pool is floored at one such sequence, so keep it to what is asked of it."""
    prefill = EngineConfig(dtype="float32", kv_cache_memory_gb=PREFILL_BUDGET_GB, max_num_seqs=64,
                           max_model_len=max_len)
    pair = LocalPair(path, decode_config(mode, budget_bytes, max_len), prefill_config=prefill,
                     compression=resolve_policy(MODES[mode][0]))
    # every request is allocated at once and waits there for its prefill (one at a time on this process's cores):
    # a lease long enough for the slowest, so holding them all is what is measured, not the prefill queue
    pair.decode.lease_policy = LeasePolicy(base_s=LEASE_S)
    return pair


def requests(prompts: QwenPrompts, side: int, n: int, images: int = 1, first: int = 0) -> list[dict]:
    """``n`` prompts of ``images`` images each: different text and pixels per prompt (no prefix or vision-cache
    reuse between them); ``first``: where their variants start (other numbers, other prompts)."""
    out = []
    for i in range(first, first + n):
        parts = [prompts.make(side, 1000 * i + j) for j in range(images)]
        ids = [t for p, _ in parts for t in p]
        out.append({"prompt_token_ids": ids, "multi_modal_data": {"image": [im for _, im in parts]}})
    return out


def capacity(pair: LocalPair, prompt: dict, tokens: int) -> int:
    """Copies of ``prompt`` the decode worker admits at once, each with room for ``tokens`` more (then released)."""
    eng = pair.decode.engine
    bm = eng.block_manager
    per_request = -(-tokens // bm.block_size) + 1
    wire = pair.wire(prompt)[1]
    held: list[str] = []
    while True:
        rid = f"cap-{len(held)}"
        try:
            eng.preallocate(rid, wire, SamplingParams(max_tokens=tokens))
        except (OutOfBlocksError, RequestTooLargeError):
            break
        if bm.num_free_blocks < (len(held) + 1) * per_request:  # no room left for every one's tokens
            eng.release_prefill(rid)
            break
        held.append(rid)
    for rid in held:
        eng.release_prefill(rid)
    bm.check_no_leaks()
    return len(held)


def run(pair: LocalPair, reqs: list[dict], tokens: int, timeout_s: float = 600.0) -> dict:
    """``reqs`` held at once by the decode worker: every one allocated, then prefilled and transferred (the decode
    worker not stepping meanwhile), then all decoded together. Returns their tokens, failures, preemptions, the
    median decode step at full concurrency (``tpot_ms``: a step gives each request one token), the most requests
    held, and the peak coded-page and mirror bytes."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    dw, pw = pair.decode, pair.prefill
    rids = [f"mem-{next(_ids)}" for _ in reqs]
    for rid, r in zip(rids, reqs, strict=True):
        to_prefill, to_decode = pair.wire(r)
        lease = dw.allocate(rid, to_decode, params)
        pw.submit(rid, to_prefill, params, pair.prefill_manager.sender(lease, codec=pw.codec))
    deadline = time.monotonic() + timeout_s
    while pw.has_work() and time.monotonic() < deadline:
        pw.step()
    for receiver in list(dw.receivers.values()):
        receiver.wait(max(0.0, deadline - time.monotonic()))
    held = len(dw.engine.requests)
    final, steps, pages, mirror = {}, [], 0, 0
    while dw.has_work() and time.monotonic() < deadline:
        full = len(dw.engine.scheduler.running) == len(reqs)
        t0 = time.perf_counter()
        report = dw.step()
        if full:
            steps.append(time.perf_counter() - t0)
        kv = dw.engine.kv_memory()
        pages, mirror = max(pages, kv.visual_kv_bytes), max(mirror, kv.mirror_bytes)
        final.update({o.request_id: o for o in report.outputs if o.finished})
    pair.check_no_leaks()
    done = [final[r] for r in rids if r in final]
    return {"tokens": [final[r].outputs[0].token_ids if r in final else [] for r in rids], "completed": len(done),
            "failed": len(rids) - len(done),
            "preemptions": sum(o.metrics.num_preemptions for o in done),
            "tpot_ms": 1e3 * statistics.median(steps) if steps else None, "visual_kv_bytes_peak": pages,
            "mirror_bytes_peak": mirror, "held_peak": held}


def eight_images(path: Path, prompts: QwenPrompts, side: int, tokens: int, max_len: int) -> dict:
    """One eight-image request on the unified side: the smallest of a few budgets that fits it runs it to the end;
    a budget whose pool holds half its KV refuses it typed, with nothing reserved."""
    req = requests(prompts, side, 1, images=8)[0]
    out: dict = {"images": 8, "side": side, "completed": False}
    need = reserve = None
    for mb in (48, 64, 96, 128, 192, 256):
        pair = make_pair(path, "unified", int(mb * 2**20), max_len)
        eng = pair.decode.engine
        try:
            try:
                blocks = eng.preallocate("probe", pair.wire(req)[1], SamplingParams(max_tokens=tokens))
            except (OutOfBlocksError, RequestTooLargeError):
                continue
            block_bytes = eng.runner.kv_bytes_per_token * eng.config.block_size
            need = (sum(b >= 0 for b in blocks) + eng.block_manager.num_pages) * block_bytes
            reserve = reserved_bytes(eng.config.max_num_seqs, eng.runner.kv_bytes_per_token)  # the mirror's share
            eng.release_prefill("probe")
            r = run(pair, [req], tokens)
            out.update(completed=r["completed"] == 1 and not r["failed"] and not r["preemptions"],
                       fit_budget_bytes=int(mb * 2**20), kv_bytes=need, visual_kv_bytes=r["visual_kv_bytes_peak"],
                       preemptions=r["preemptions"])
            break
        finally:
            pair.close()
    if need is None:
        return out
    over = reserve + need // 2
    pair = make_pair(path, "unified", over, max_len)
    eng = pair.decode.engine
    out.update(over_budget_bytes=over, refused_typed_when_over=False)
    try:
        eng.preallocate("over", pair.wire(req)[1], SamplingParams(max_tokens=tokens))
        eng.release_prefill("over")
    except RequestTooLargeError as e:
        nothing_held = not eng.requests and not eng.receiving and eng.block_manager.num_pages == 0
        eng.block_manager.check_no_leaks()
        out.update(refused_typed_when_over=nothing_held, error=str(e))
    finally:
        pair.close()
    return out


def table(res: dict) -> str:
    s, u = res["static"], res["unified"]
    rows = [[name, str(r["concurrent"]), str(r["held_peak"]), f"{r['completed']}/{r['concurrent']}", str(r["failed"]),
             str(r["preemptions"]), fmt(r["tpot_ms"], 2), fmt(r["mirror_bytes_peak"] / 2**20),
             fmt(r["visual_kv_bytes_peak"] / 2**20)] for name, r in (("static", s), ("unified", u))]
    return format_table(["pool", "concurrent", "held at once", "completed", "failed", "preempted", "TPOT ms",
                         "mirror MiB", "pages MiB"], rows)


def main(args: argparse.Namespace) -> dict:
    path = model_dir(args)
    budget = int(args.budget_mb * 2**20)
    prompts = QwenPrompts(path, seed=0)
    per_image = prompts.num_visual_tokens(args.side)
    one = requests(prompts, args.side, 1)[0]
    one_len = len(one["prompt_token_ids"]) + args.tokens + 16  # the static pool's floor: one such request
    eight_len = 8 * len(one["prompt_token_ids"]) + args.tokens + 16
    res: dict = {"budget_bytes": budget, "side": args.side, "visual_tokens_per_image": per_image,
                 "tokens": args.tokens, "machine": cpu_description(), "model_dir": str(path),
                 "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    pairs = {m: make_pair(path, m, budget, one_len) for m in MODES}
    try:
        for m, pair in pairs.items():
            res[m] = {"concurrent": capacity(pair, one, args.tokens),
                      "pool_bytes": pair.decode.engine.kv_memory().pool_bytes}
            log(f"{m}: {res[m]['concurrent']} concurrent {args.side}² requests at {args.budget_mb:g} MiB")
        for m, pair in pairs.items():  # held at once, for real
            r = run(pair, requests(prompts, args.side, res[m]["concurrent"]), args.tokens)
            res[m].update({k: r[k] for k in ("completed", "failed", "preemptions", "visual_kv_bytes_peak",
                                             "mirror_bytes_peak", "held_peak")})
            res[m]["tpot_ms_at_own"] = r["tpot_ms"]
        same = requests(prompts, args.side, max(1, res["static"]["concurrent"]))
        tp: dict[str, list[float]] = {m: [] for m in MODES}
        toks: dict[str, list] = {m: [] for m in MODES}
        others = requests(prompts, args.side, args.agreement_prompts, images=1, first=len(same) + 100)
        batch = max(1, res["static"]["concurrent"])
        for m in MODES:
            for i in range(0, len(others), batch):
                toks[m] += run(pairs[m], others[i:i + batch], args.agreement_tokens)["tokens"]
        for r in range(args.rounds):
            for m in (MODES if r % 2 == 0 else list(MODES)[::-1]):
                out = run(pairs[m], same, args.tokens)
                tp[m].append(out["tpot_ms"])
                log(f"round {r}: {m} TPOT {out['tpot_ms']:.2f} ms at {len(same)} requests")
        for m in MODES:
            res[m]["tpot_ms"] = statistics.median(tp[m])
            res[m]["tpot_rounds_ms"] = tp[m]
        res["unified"]["agreement"] = agreement(toks["static"], toks["unified"])
        res["unified"]["agreement_tokens"] = sum(len(t) for t in toks["static"])
        res["unified"]["tpot_ratio"] = res["unified"]["tpot_ms"] / res["static"]["tpot_ms"]
        res["unified"]["concurrent_ratio"] = res["unified"]["concurrent"] / max(1, res["static"]["concurrent"])
    finally:
        for pair in pairs.values():
            pair.close()
    res["eight_1024_images"] = eight_images(path, prompts, args.side, args.tokens, eight_len)
    return res


def run_bench(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    res = main(args)
    print(table(res))
    u, e = res["unified"], res["eight_1024_images"]
    print(f"unified / static: {u['concurrent_ratio']:.2f}x concurrent, TPOT {u['tpot_ratio']:.2f}x, agreement "
          f"{u['agreement']:.3f}; eight images: completed {e.get('completed')}, refused typed when over "
          f"{e.get('refused_typed_when_over')} ({time.perf_counter() - t0:.0f} s)")
    write_json(args.json, res)
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run_bench(parser.parse_args()))
