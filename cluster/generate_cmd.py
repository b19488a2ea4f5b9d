"""``duet generate``: one request through the offline engine."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from engine.errors import ImageDecodeError, InvalidRequestError

if TYPE_CHECKING:
    import PIL.Image


def run_generate(args: argparse.Namespace) -> int:
    from cluster.cli import print_json
    from cluster.demo import default_model_dir
    from engine import LLM, SamplingParams

    images = [_load_image_file(p) for p in args.image]  # fail on a bad image before loading the model
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    llm = LLM(args.model_dir or default_model_dir(), dtype=args.dtype, device=args.device, max_num_seqs=1)
    prompt: dict = {"prompt": args.prompt} if args.prompt is not None else {"prompt_token_ids": args.token_ids}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    out = llm.generate([prompt], params)[0]
    c = out.outputs[0]
    if args.json:
        print_json({"token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason,
                    "metrics": {"ttft_s": out.metrics.ttft_s, "tpot_s": out.tpot_s()}})
    else:
        print(c.text if llm.get_tokenizer() is not None else " ".join(map(str, c.token_ids)))
    return 0


def _load_image_file(path: str) -> PIL.Image.Image:
    """``load_image``, with the file named in the error (the decoder's own message may not say which file)."""
    from engine.image_processor import load_image

    try:
        return load_image(path)
    except ImageDecodeError as e:
        if path in str(e):
            raise
        raise ImageDecodeError(f"--image {path}: {e}") from None
