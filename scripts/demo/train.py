"""Train the demo model from a seed: ``python -m scripts.demo.train OUT_DIR [--steps N] [--seed S]``.

A Qwen3-VL-MoE model -- a native-resolution vision tower (16-pixel patches, 2x2 merge, DeepStack levels into the first
text layers) and a MoE text model (8 experts, top-2, interleaved M-RoPE) -- trained with transformers'
``Qwen3VLMoeForConditionalGeneration`` on :mod:`duet_testing.demo_tasks` in its ``varied`` style (canvases from 48 to
360 pixels a side at any aspect ratio up to 2.5:1, so an image's visual-token count varies from 12 to 36 after the
processor's resize to 112^2-192^2 pixels). Each training sequence is one scene with ``--min-turns``-4 question/answer
turns (or one two-image comparison), loss on the answer tokens only, plus two training-only probes that are not saved:
:class:`TokenProbe` (from each merged visual token: the shape kind and colour over it, the third of the image it lies in
and, with ``--centre-probe``, whether it holds a shape's centre; from the mean of a shape's tokens, its kind) and
:class:`MatchProbe` (which visual token holds the shape the first question asks about, read from the text model's hidden
states; the image follows the question in the chat template). Without them the answers alone teach the vision tower
slowly (the LLaVA demo's lesson: 81% against 99%).
Deterministic for a seed on a given machine, worker and thread count. Writes a Hugging Face checkpoint in the layout
transformers 5 saves (config, safetensors, tokenizer, ``preprocessor_config.json``, generation config; see
:func:`_save` for why not the released checkpoints' fused-expert layout) plus ``train_log.jsonl``. ``--workers 2``
trains data-parallel in two one-thread processes (a step took 0.49 s against 0.62 s in one process of two threads on
an AMD EPYC, 2 cores: the small matrix products and the Python work of a step run on both cores at once; other worker
counts give other, equally trained, weights). ``--precision bfloat16`` (``auto``: where the CPU multiplies bfloat16
natively) and ``--ema D`` (save a moving average of the weights): :mod:`scripts.demo.speed`; ``--optimizer muon``
(the hidden matrices by Muon, the rest by AdamW): :mod:`scripts.demo.muon`. The command line's defaults
(:data:`SHIPPED_RUN`) are the run that made the shipped checkpoint, 19.9 minutes on that host.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from duet_testing.demo_tasks import Conversation, Example, make_conversation
from scripts.demo.muon import make_optimizers
from scripts.demo.parallel import all_reduce_mean, all_reduce_sum, mean_parts
from scripts.demo.probes import MatchProbe, TokenProbe, asked_shape, centre_token
from scripts.demo.speed import PRECISIONS, WeightAverage, resolve_precision, use_fp32_attention
from scripts.demo.tokenizer import (
    ENDOFTEXT,
    IM_END,
    IMAGE_PAD,
    QWEN_SPECIAL_TOKENS,
    VISION_END,
    VISION_START,
    VIDEO_PAD,
    chat_prompt,
    save_tokenizer,
    train_tokenizer,
)

PATCH, MERGE, TEMPORAL = 16, 2, 2
MIN_PIXELS, MAX_PIXELS = 112 * 112, 192 * 192  # 12 to 36 visual tokens an image
PROBE_WEIGHT = 1.5  # weight of the training-only token probe's loss (TokenProbe)
MATCH_WEIGHT = 0.5  # weight of the training-only match probe's loss (MatchProbe)
# the command line's defaults: the run that made the shipped checkpoint (on a CPU with native bfloat16)
SHIPPED_RUN = {"steps": 2250, "seed": 1, "workers": 2, "precision": "auto", "ema": 0.999, "optimizer": "muon",
               "min_turns": 4, "centre_probe": True}
# the vision tower: wider than the text model, since telling a triangle from a diamond at any scale and offset
# against the 16-pixel patch grid is the slowest thing the demo learns (a linear probe of shape kind: 85% after
# 500 steps at this width, 77% at 128 wide)
VISION = {"depth": 4, "hidden_size": 192, "intermediate_size": 512, "num_heads": 6}


def processor_config() -> dict:
    return {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": PATCH, "temporal_patch_size": TEMPORAL,
            "merge_size": MERGE, "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True, "do_resize": True, "resample": 3}


def image_processor():
    from transformers import Qwen2VLImageProcessorPil

    cfg = {k: v for k, v in processor_config().items() if k != "image_processor_type"}
    return Qwen2VLImageProcessorPil(**cfg)


def build_model(tok, seed: int):
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    ids = {t: tok.token_to_id(t) for t in QWEN_SPECIAL_TOKENS}
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                max_position_embeddings=1024, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5],
                                 "mrope_interleaved": True},
                pad_token_id=ids[ENDOFTEXT], eos_token_id=ids[IM_END], bos_token_id=None)
    vision = dict(**VISION, patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE,
                  out_hidden_size=128,
                  num_position_embeddings=256, deepstack_visual_indexes=[1, 2])
    cfg = Qwen3VLMoeConfig(text_config=text, vision_config=vision, image_token_id=ids[IMAGE_PAD],
                           video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
                           vision_end_token_id=ids[VISION_END], tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen3VLMoeForConditionalGeneration(cfg)


def linear_patch_embed(model) -> None:
    """Run the vision tower's patch embedding (a Conv3d whose kernel is its stride and its whole input) as the
    matrix product it is: the same weights and result, without the CPU convolution's slow backward (about a sixth
    of a training step)."""
    proj = model.model.visual.patch_embed.proj

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.reshape(-1, proj.weight[0].numel()).to(proj.weight.dtype),
                                          proj.weight.flatten(1), proj.bias)

    model.model.visual.patch_embed.forward = forward


def encode(tok, conv: Conversation | Example, ids: dict[str, int], tokens_per_image: list[int]
           ) -> tuple[list[int], list[int]]:
    """(input ids with each image's pad run expanded to its visual-token count, labels: the answers and their end
    tokens, -100 elsewhere)."""
    turns = conv.turns if isinstance(conv, Conversation) else ((conv.question, conv.answer),)
    counts = iter(tokens_per_image)
    input_ids: list[int] = []
    labels: list[int] = []
    for question, answer in turns:
        prompt: list[int] = []
        for t in tok.encode(chat_prompt(question)).ids:
            prompt.extend([t] * next(counts) if t == ids[IMAGE_PAD] else [t])
        reply = tok.encode(answer).ids + [ids[IM_END]]
        input_ids += prompt + reply
        labels += [-100] * len(prompt) + reply
    return input_ids, labels


def make_batch(tok, proc, examples: list[Conversation | Example], ids: dict[str, int]) -> dict[str, torch.Tensor]:
    images = [im for e in examples for im in e.images()]
    vis = proc(images=images, return_tensors="pt")
    grid = vis["image_grid_thw"]
    per_image = (grid.prod(-1) // MERGE**2).tolist()
    seqs, at = [], 0
    for e in examples:
        n = len(e.scenes)
        seqs.append(encode(tok, e, ids, per_image[at:at + n]))
        at += n
    batch = pad_batch(seqs, ids[ENDOFTEXT])
    return {**batch, "pixel_values": vis["pixel_values"], "image_grid_thw": grid,
            "mm_token_type_ids": (batch["input_ids"] == ids[IMAGE_PAD]).int()}


def pad_batch(seqs: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """``input_ids`` / ``labels`` / ``attention_mask`` of (input ids, labels) pairs, right-padded to the longest."""
    n = max(len(s) for s, _ in seqs)
    input_ids = torch.full((len(seqs), n), pad_id)
    labels = torch.full((len(seqs), n), -100)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, (s, lab) in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s)
        labels[i, : len(s)] = torch.tensor(lab)
        mask[i, : len(s)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def batch_loss(model, tok, proc, examples: list[Conversation], ids: dict[str, int], probe: TokenProbe | None = None,
               probe_weight: float = 0.0, match: MatchProbe | None = None, match_weight: float = 0.0,
               chunk: int = 16, parts: dict | None = None) -> torch.Tensor:
    """Mean loss over all answer tokens of the batch, run in chunks of similar length (sorted by visual tokens, so
    little padding); plus the probes' weighted losses (each unweighted in ``parts`` when given)."""
    order = sorted(examples, key=lambda e: sum(s.width * s.height for s in e.scenes))
    captured: list[torch.Tensor] = []
    hook = (model.model.visual.merger.register_forward_hook(lambda _m, _i, out: captured.append(out))
            if probe is not None else None)
    try:
        total, count, aux, aux_n, matched, match_n = None, 0, 0.0, 0, 0.0, 0
        for at in range(0, len(order), chunk):
            part = order[at:at + chunk]
            batch = make_batch(tok, proc, part, ids)
            tokens = int((batch["labels"][:, 1:] != -100).sum())
            out = model(**batch, output_hidden_states=match is not None)
            total = out.loss * tokens if total is None else total + out.loss * tokens
            count += tokens
            grids = [(int(h) // MERGE, int(w) // MERGE) for _, h, w in batch["image_grid_thw"].tolist()]
            if probe is not None:
                scenes = [s for e in part for s in e.scenes]
                aux = aux + probe.loss(captured.pop(), scenes, grids) * len(scenes)
                aux_n += len(scenes)
            if match is not None:
                targets, g = [], 0
                for e in part:
                    s = asked_shape(e.scenes[0], e.turns[0][0]) if len(e.scenes) == 1 else None
                    targets.append(None if s is None else centre_token(s, *grids[g]))
                    g += len(e.scenes)
                m = match.loss(out.hidden_states[match.layer], batch["input_ids"] == ids[IMAGE_PAD], targets)
                if m is not None:
                    n = sum(t is not None for t in targets)
                    matched, match_n = matched + m * n, match_n + n
    finally:
        if hook is not None:
            hook.remove()
    loss = total / count
    if parts is not None:
        parts["answers"] = loss.item()
    if probe is not None:
        loss = loss + probe_weight * aux / aux_n
        if parts is not None:
            parts["token_probe"] = (aux / aux_n).item()
    if match_n:
        loss = loss + match_weight * matched / match_n
        if parts is not None:
            parts["match_probe"] = (matched / match_n).item()
    return loss


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(out: Path, *, steps: int, seed: int = 0, batch_size: int = 32, lr: float = 3e-3, log_every: int = 20,
          progress: bool = True, save: bool = True, checkpoint_every: int = 0,
          probe_weight: float = PROBE_WEIGHT, match_weight: float = MATCH_WEIGHT, workers: int = 1,
          precision: str = "float32", ema: float = 0.0, optimizer: str = "adamw", muon_lr: float | None = None,
          min_turns: int = 1, save_last: bool = False, centre_probe: bool = False) -> torch.nn.Module | None:
    """Train and (``save``) write the checkpoint to ``out``. ``workers`` > 1 runs that many processes of one thread
    each, data-parallel (each takes every ``workers``-th conversation of a step's batch, ordered by image area; the
    gradients are averaged over gloo), and returns None; one worker returns the trained model."""
    kw = dict(steps=steps, seed=seed, batch_size=batch_size, lr=lr, log_every=log_every, progress=progress,
              save=save, checkpoint_every=checkpoint_every, probe_weight=probe_weight, match_weight=match_weight,
              precision=precision, ema=ema, optimizer=optimizer, muon_lr=muon_lr, min_turns=min_turns,
              save_last=save_last, centre_probe=centre_probe)
    if workers <= 1:
        return _train(out, rank=0, workers=1, **kw)
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as rendezvous:
        mp.spawn(_worker, args=(workers, f"file://{rendezvous}/store", out, kw), nprocs=workers, join=True)
    return None


def _worker(rank: int, workers: int, init_method: str, out: Path, kw: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=workers)
    try:
        _train(out, rank=rank, workers=workers, **kw)
    finally:
        dist.destroy_process_group()


def _train(out: Path, *, rank: int, workers: int, steps: int, seed: int, batch_size: int, lr: float, log_every: int,
           progress: bool, save: bool, checkpoint_every: int, probe_weight: float, match_weight: float,
           precision: str, ema: float, optimizer: str, muon_lr: float | None, min_turns: int,
           save_last: bool, centre_probe: bool) -> torch.nn.Module:
    lead = rank == 0
    tok = train_tokenizer()
    ids = {t: tok.token_to_id(t) for t in QWEN_SPECIAL_TOKENS}
    proc = image_processor()
    model = build_model(tok, seed)
    linear_patch_embed(model)
    precision = resolve_precision(precision)
    bf16 = precision == "bfloat16"
    if bf16:
        use_fp32_attention(model)
    model.train()
    hidden = model.config.text_config.hidden_size
    probe = TokenProbe(hidden, centre=centre_probe) if probe_weight > 0 else None
    match = MatchProbe(hidden) if match_weight > 0 else None
    extra = [p for m in (probe, match) if m is not None for p in m.parameters()]
    params = [*model.parameters(), *extra]
    share = (rank, workers, all_reduce_sum) if workers > 1 else None
    opts = make_optimizers(model, extra, optimizer, lr, muon_lr, bf16=bf16, share=share)
    peaks = [[g["lr"] for g in opt.param_groups] for opt in opts]  # each group's peak learning rate
    average = WeightAverage(model, ema) if ema else None
    rng = random.Random(seed)
    header = {"seed": seed, "steps": steps, "workers": workers, "precision": precision, "ema": ema,
              "optimizer": optimizer, "muon_lr": muon_lr, "min_turns": min_turns, "centre_probe": centre_probe}
    log = []
    bar = _bar(steps) if progress and lead else None
    t0 = time.perf_counter()
    for step in range(steps):
        # every worker draws the whole batch
        examples = [make_conversation(rng, min_turns=min_turns) for _ in range(batch_size)]
        if workers > 1:
            examples = sorted(examples, key=lambda e: sum(s.width * s.height for s in e.scenes))[rank::workers]
        scale = lr_at(step, steps, 1.0, warmup=min(100, steps // 10 + 1))
        for opt, peak in zip(opts, peaks, strict=True):
            for g, top in zip(opt.param_groups, peak, strict=True):
                g["lr"] = top * scale
            opt.zero_grad(set_to_none=True)
        parts: dict[str, float] = {}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = batch_loss(model, tok, proc, examples, ids, probe, probe_weight, match, match_weight, parts=parts)
        loss.backward()
        if workers > 1:
            for p in params:  # a probe a worker's half never reached: a zero gradient on every worker alike
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            all_reduce_mean([p.grad for p in params], workers)
            loss_value, parts = mean_parts(loss.item(), parts, workers)
        else:
            loss_value = loss.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for opt in opts:
            opt.step()
        if average is not None:
            average.update(step)
        if step % log_every == 0 or step == steps - 1:
            log.append({"step": step, "loss": round(loss_value, 5), **{k: round(v, 5) for k, v in parts.items()},
                        "lr": opts[0].param_groups[0]["lr"], "elapsed_s": round(time.perf_counter() - t0, 1)})
        if checkpoint_every and step and step % checkpoint_every == 0 and lead:
            with average.applied() if average is not None else nullcontext():
                _save(model, tok, out / f"step-{step}", log, header)
            model.train()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.4f}")
    if bar is not None:
        bar.close()
    if average is not None:
        average.swap()
    if bf16:
        use_fp32_attention(model, on=False)
    model.eval()
    if save and lead:
        _save(model, tok, out, log, header)
        if average is not None and save_last:
            with average.applied():  # holds the last step's weights now
                _save(model, tok, out / "last", log, {**header, "ema": 0.0})
    return model


def _save(model, tok, out: Path, log: list[dict], header: dict) -> None:
    """The checkpoint and ``train_log.jsonl``: ``header`` (the run's settings and torch's thread count), then
    ``log``."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    # transformers 5's layout: the experts' down_proj is square here (moe_intermediate_size == hidden_size), and
    # transformers 5.24 reading the released layout transposes a fused expert tensor only when its shape says so, so
    # a square one written that way loads untransposed there (Duet reads both layouts by the config's version)
    model.save_pretrained(out)
    save_tokenizer(tok, out)
    (out / "preprocessor_config.json").write_text(json.dumps(processor_config(), indent=2) + "\n")
    GenerationConfig(eos_token_id=tok.token_to_id(IM_END), pad_token_id=tok.token_to_id(ENDOFTEXT), do_sample=False,
                     max_new_tokens=48).save_pretrained(out)
    with open(out / "train_log.jsonl", "w") as f:
        f.write(json.dumps({**header, "torch_threads": torch.get_num_threads()}) + "\n")
        f.writelines(json.dumps(r) + "\n" for r in log)


def _bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="train", unit="step")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.demo.train", description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=SHIPPED_RUN["steps"])
    p.add_argument("--seed", type=int, default=SHIPPED_RUN["seed"])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--workers", type=int, default=SHIPPED_RUN["workers"],
                   help="data-parallel processes of one thread each (1: a single process of --threads threads)")
    p.add_argument("--threads", type=int, default=2, help="torch threads with --workers 1")
    p.add_argument("--probe-weight", type=float, default=PROBE_WEIGHT,
                   help="weight of the auxiliary token-probe loss on the visual tokens (0: off)")
    p.add_argument("--match-weight", type=float, default=MATCH_WEIGHT,
                   help="weight of the auxiliary match-probe loss (which token the question asks about; 0: off)")
    p.add_argument("--precision", choices=PRECISIONS, default=SHIPPED_RUN["precision"],
                   help="bfloat16: matrix products under a bfloat16 autocast (float32 weights and optimizer, attention "
                   "in float32); auto: bfloat16 where the CPU multiplies it natively (AVX512_BF16 / AMX), else float32")
    p.add_argument("--ema", type=float, default=SHIPPED_RUN["ema"],
                   help="save a moving average of the weights with this decay (0: the last step's weights)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also save OUT/step-N every N steps")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default=SHIPPED_RUN["optimizer"],
                   help="muon: the hidden matrices by Muon (scripts/demo/muon.py), the rest by AdamW")
    p.add_argument("--muon-lr", type=float, default=None, help="Muon's peak learning rate (default: --lr)")
    p.add_argument("--min-turns", type=int, default=SHIPPED_RUN["min_turns"],
                   help="questions a single-image conversation asks at least (1-4: all four kinds)")
    p.add_argument("--save-last", action="store_true", help="with --ema: also save the last step's weights to OUT/last")
    p.add_argument("--centre-probe", action=argparse.BooleanOptionalAction, default=SHIPPED_RUN["centre_probe"],
                   help="the token probe also learns which token holds each shape's centre (a count's units)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    train(a.out, steps=a.steps, seed=a.seed, batch_size=a.batch_size, lr=a.lr, checkpoint_every=a.checkpoint_every,
          probe_weight=a.probe_weight, match_weight=a.match_weight, workers=a.workers,
          precision=a.precision, ema=a.ema, optimizer=a.optimizer, muon_lr=a.muon_lr,
          min_turns=a.min_turns, save_last=a.save_last,
          centre_probe=a.centre_probe)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
