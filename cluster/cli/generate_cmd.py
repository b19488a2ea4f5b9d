"""``duet generate``: one request through the offline engine (``--mode local``) or a disaggregated cluster of
prefill and decode actors on Ray (``--mode disagg``).

Everything a user can get wrong is checked before a model or a worker is loaded: the flags, the image files, and the
images' visual tokens against ``--max-visual-tokens`` (from their sizes alone; a Qwen-VL image takes grid / merge²).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from engine.errors import ImageDecodeError, InvalidRequestError

if TYPE_CHECKING:
    import PIL.Image

    from engine.config import ModelConfig


def run_generate(args: argparse.Namespace) -> int:
    from cluster.cli.main import print_json
    from cluster.demo import default_model_dir
    from engine import SamplingParams

    if args.mode == "local" and args.kv_compression != "none":
        raise InvalidRequestError("--kv-compression applies to --mode disagg (local serving moves no KV)")
    if args.mode == "local" and args.expert_parallel != 1:
        raise InvalidRequestError("--expert-parallel applies to --mode disagg (decode workers share the experts)")
    if args.mode == "local" and args.expert_resident is not None:
        raise InvalidRequestError("--expert-resident applies to --mode disagg (it tiers the decode workers' experts)")
    images = [_load_image_file(p) for p in args.image]  # fail on a bad image before loading the model
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    model_dir = str(args.model_dir or default_model_dir())
    _check_visual_tokens(model_dir, images, args.max_visual_tokens)
    run = _run_disagg if args.mode == "disagg" else _run_local
    result = run(args, model_dir, images, params)
    if args.json:
        print_json(result)
    else:
        print(result["text"] if result["text"] else " ".join(map(str, result["token_ids"])))
    return 0


def _check_visual_tokens(model_dir: str, images: list, limit: int | None) -> None:
    """``--max-visual-tokens`` (None: the server's default limit) against the images' counts; reads the config only."""
    from cluster.serve.limits import Limits, check_visual_tokens, visual_token_counts
    from engine.config import ModelConfig
    from engine.inputs import image_processor_for

    if limit is not None and limit < 1:
        raise InvalidRequestError(f"--max-visual-tokens must be at least 1, got {limit}")
    if not images:
        return
    limit = Limits().max_visual_tokens if limit is None else limit
    cfg = ModelConfig.from_pretrained(model_dir)
    counts = visual_token_counts(cfg, image_processor_for(model_dir, cfg), [im.size for im in images])
    check_visual_tokens(counts, limit)


def _prompt(args: argparse.Namespace, tokenizer, cfg: ModelConfig, images: list) -> dict:
    """The request: ``--prompt`` goes through the checkpoint's chat template when it has one (``--raw-prompt``
    skips it; a Qwen-VL template gets the images as content parts, :mod:`cluster.serve.chat`); ``--token-ids`` are
    taken as they are."""
    from cluster.serve.chat import render_chat

    if args.prompt is not None:
        text = args.prompt
        if tokenizer is not None and not args.raw_prompt:
            text = render_chat(tokenizer, cfg, [{"role": "user", "content": text}]) or text
        prompt: dict = {"prompt": text}
    else:
        prompt = {"prompt_token_ids": args.token_ids}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    return prompt


def _run_local(args: argparse.Namespace, model_dir: str, images: list, params) -> dict:
    from engine import LLM

    llm = LLM(model_dir, dtype=args.dtype, device=args.device, max_num_seqs=1)
    out = llm.generate([_prompt(args, llm.get_tokenizer(), llm.engine.inputs.cfg, images)], params)[0]
    c = out.outputs[0]
    return {"token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason,
            "metrics": {"ttft_s": out.metrics.ttft_s, "tpot_s": out.tpot_s()}}


def _run_disagg(args: argparse.Namespace, model_dir: str, images: list, params) -> dict:
    import os

    import ray

    from cluster.control.disagg import DisaggCluster
    from cluster.control.spec import ClusterSpec

    spec = ClusterSpec(model_dir=model_dir, num_prefill=args.prefill, num_decode=args.decode,
                       transport=args.kv_transport, dtype="float32" if args.dtype == "auto" else args.dtype,
                       kv_compression=args.kv_compression, expert_parallel=args.expert_parallel,
                       expert_resident=args.expert_resident, expert_cache_policy=args.expert_cache_policy,
                       gpus_per_worker=1.0 if args.device == "cuda" else 0.0)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=max(os.cpu_count() or 1, args.prefill + args.decode), include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    cluster = DisaggCluster(spec)
    try:
        c = cluster.generate_batch([_prompt(args, cluster.tokenizer, cluster.inputs.cfg, images)], params)[0]
        experts = cluster.expert_summary()
    finally:
        cluster.shutdown()
        if started:
            ray.shutdown()
    result = {"token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason,
              "metrics": {"ttft_s": c.ttft_s, "tpot_s": c.tpot_s}, "kv_transfer": c.kv_transfer}
    if experts is not None:  # placement_changes, balancedness, prewarm_hits, prewarm_misses (see expert_summary)
        result["experts"] = experts
    return result


def _load_image_file(path: str) -> PIL.Image.Image:
    """``load_image``, with the file named in the error (the decoder's own message may not say which file)."""
    from engine.image_processor import load_image

    try:
        return load_image(path)
    except ImageDecodeError as e:
        if path in str(e):
            raise
        raise ImageDecodeError(f"--image {path}: {e}") from None
