"""What ``duet bench kv-codec`` measures per policy, shared by its LLaVA mode (:mod:`duet_bench.kvcodec_bench`) and
its Qwen3-VL-MoE mode (:mod:`duet_bench.qwen_kvcodec`); this module imports neither, so the arrows point one way.

* policies -- :func:`policies_from_args`: the named and custom policies, ``none`` (the reference) always first;
* bytes -- :func:`capture_layers` (the KV the prefill worker hands its sender), :func:`codec_measure` (encode +
  decode of those layers: per-layer stats, GB/s) and :func:`byte_summary` (bytes per text / visual token and the
  ratios against the pool dtype, float32 and bfloat16);
* quality -- :func:`quality_runs` (greedy tokens and logits through an in-process prefill -> decode pair),
  :func:`agreement` and :func:`mean_kl` against the reference.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import torch


def policies_from_args(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """``(name, policy)`` for ``--policies`` then each ``--policy`` JSON; ``("none", None)`` first (raises
    :class:`~kv_transfer.compression.InvalidPolicy`)."""
    from kv_transfer.compression import resolve_policy

    out = [(name, resolve_policy(name)) for name in args.policies.split(",") if name]
    out += [(f"custom-{i}", resolve_policy(spec)) for i, spec in enumerate(args.policy)]
    if not out or out[0][0] != "none":
        out.insert(0, ("none", None))  # the reference every ratio and agreement is measured against
    return out


# ----------------------------------------------------------------------------------------------------- pure helpers
def agreement(ref: list[list[int]], got: list[list[int]]) -> float:
    """Fraction of the reference's generated positions (up to its end of turn or the token limit) where ``got`` has
    the same token; a position ``got`` never reached counts as a mismatch."""
    total = sum(len(r) for r in ref)
    same = sum(a == b for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=False))
    return same / max(1, total)


def mean_kl(ref_tokens: list[list[int]], ref_logits: list[list[torch.Tensor]], tokens: list[list[int]],
            logits: list[list[torch.Tensor]]) -> float:
    """Mean KL(ref || got) of next-token distributions over decode steps whose generated prefix still agrees.

    ``*_logits[i][j]`` is the distribution of token ``j + 1`` (the first token comes from prefill)."""
    kls = []
    for rt, rl, gt, gl in zip(ref_tokens, ref_logits, tokens, logits, strict=True):
        for j in range(min(len(rl), len(gl))):
            if rt[: j + 1] != gt[: j + 1]:
                break
            p, q = rl[j].float().log_softmax(-1), gl[j].float().log_softmax(-1)
            kls.append(float((p.exp() * (p - q)).sum()))
    return sum(kls) / max(1, len(kls))


def byte_summary(stats: list[dict], num_layers: int, raw_bytes_per_token: float, itemsize: int) -> dict:
    """Per-modality bytes per prompt token from the codec's per-layer ``stats`` (summed over layers and prompts;
    dropped tokens count as tokens that cost nothing), and the ratios against the pool dtype, float32 and bfloat16
    (``raw_bytes_per_token``: K and V of one token over all layers in the pool dtype)."""
    out: dict[str, Any] = {}
    elems_per_token = raw_bytes_per_token / itemsize
    for mod in ("text", "visual"):
        tokens = sum(s[mod]["tokens"] + s[mod]["dropped"] for s in stats) / num_layers
        nbytes = sum(s[mod]["bytes"] for s in stats)
        per_token = nbytes / tokens if tokens else None
        out[mod] = {
            "tokens": tokens, "bytes": nbytes, "bytes_per_token": per_token,
            "vs_raw": raw_bytes_per_token / per_token if per_token else None,
            "vs_float32": elems_per_token * 4 / per_token if per_token else None,
            "vs_bfloat16": elems_per_token * 2 / per_token if per_token else None,
        }
    return out


# ------------------------------------------------------------------------------------------------------ measuring
class _Capture:
    """Stands in for a KV sender: keeps what the prefill worker would send (for byte and speed measurements)."""

    def __init__(self) -> None:
        self.layers, self.meta, self.tamper = [], None, None

    def send_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, ctx=None) -> None:
        self.layers.append((layer, k.clone(), v.clone(), ctx))

    def finish(self, meta: dict) -> None:
        self.meta = meta

    def poll(self):
        from kv_transfer import KVPoll

        return KVPoll.TRANSFERRING

    def abort(self, reason: str = "aborted") -> None:
        pass


def capture_layers(model_dir: Path, config, prompts: list[dict], policy) -> list[list[tuple]]:
    """Per prompt, the (layer, k, v, ctx) the prefill worker hands its sender under ``policy``."""
    from engine import SamplingParams
    from prefill_node.worker import PrefillWorker

    pw = PrefillWorker(model_dir, config, compression=policy)
    caps = []
    for i, p in enumerate(prompts):
        cap = _Capture()
        pw.submit(f"cap-{i}", p, SamplingParams(temperature=0, max_tokens=1), cap)
        caps.append(cap)
    while pw.has_work():
        pw.step()
    return [c.layers for c in caps]


def codec_measure(captured: list[list[tuple]], policy, layout) -> dict:
    """Encode + decode every captured layer: the codec's byte stats and encode / decode GB/s (best of 3)."""
    from kv_transfer.codec import decode_layer, encode_layer
    from kv_transfer.compression import codec_for

    codec = codec_for(policy)
    stats, raw = [], 0
    best_enc = best_dec = math.inf
    for rep in range(3):
        enc_s = dec_s = 0.0
        for pi, layers in enumerate(captured):
            for layer, k, v, ctx in layers:
                t0 = time.perf_counter()
                header, payload = encode_layer("bench", layer, k, v, codec, ctx)
                t1 = time.perf_counter()
                decode_layer(header, payload, layout)
                t2 = time.perf_counter()
                enc_s += t1 - t0
                dec_s += t2 - t1
                if rep == 0:
                    n = ctx.num_tokens if ctx is not None else k.shape[0] * k.shape[1]
                    raw += 2 * n * k.shape[2] * k.shape[3] * k.element_size()
                    stats.append({**_stats(header, k, ctx), "_prompt": pi, "_layer": layer})
        best_enc, best_dec = min(best_enc, enc_s), min(best_dec, dec_s)
    return {"stats": stats, "raw_bytes": raw, "encode_gbps": raw / best_enc / 1e9, "decode_gbps": raw / best_dec / 1e9,
            "encode_s": best_enc, "decode_s": best_dec,
            "wire_bytes": sum(s["text"]["bytes"] + s["visual"]["bytes"] for s in stats)}


def _stats(header: dict, k: torch.Tensor, ctx) -> dict:
    """Per-modality tokens / dropped / bytes of one encoded layer (identity: every valid token at raw size)."""
    st = header["codec_meta"].get("stats")
    if st is not None:
        return {m: {"tokens": st[m]["tokens"], "dropped": st[m]["dropped"], "bytes": st[m]["bytes"]}
                for m in ("text", "visual")}
    per_token = 2 * k.shape[2] * k.shape[3] * k.element_size()
    n = ctx.num_tokens if ctx is not None else k.shape[0] * k.shape[1]
    vis = int(ctx.visual.sum()) if ctx is not None else 0
    return {"text": {"tokens": n - vis, "dropped": 0, "bytes": (n - vis) * per_token},
            "visual": {"tokens": vis, "dropped": 0, "bytes": vis * per_token}}


def quality_runs(model_dir: Path, config, policy, prompts: list[dict], tokens: int, examples,
                 window: int | None = None) -> dict:
    """Greedy tokens + logits on ``prompts`` and answers on ``examples`` through an in-process pair (``window``:
    :meth:`LocalPair.generate`'s, for prompts whose prefills would outlast a lease when queued together)."""
    from duet_bench.quality_bench import prompts_for, records, summarize
    from cluster.control.local_pair import LocalPair
    from engine import SamplingParams

    pair = LocalPair(model_dir, config, compression=policy)
    try:
        sp = SamplingParams(temperature=0, max_tokens=tokens, return_logits=True)
        outs, failed = pair.generate(prompts, sp, window=window)
        if failed:
            raise RuntimeError(f"transfers failed: {failed}")
        toks = [o.outputs[0].token_ids for o in outs]
        logits = [o.outputs[0].logits or [] for o in outs]
        acc, acc_failed = None, 0
        if examples:
            tok = pair.prefill.engine.tokenizer
            outs, failed = pair.generate(prompts_for(tok, examples), SamplingParams(temperature=0, max_tokens=48))
            acc_failed = len(failed)  # a failed request counts as a wrong answer, and is reported
            texts = [tok.decode(o.outputs[0].token_ids) if o is not None else "" for o in outs]
            acc = summarize(records(examples, texts))
        pair.check_no_leaks()
    finally:
        pair.close()
    return {"tokens": toks, "logits": logits, "accuracy": acc, "failed": acc_failed}
