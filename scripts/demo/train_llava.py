"""Train the LLaVA test fixture from a seed: ``python -m scripts.demo.train_llava OUT_DIR [--steps N] [--seed S]``.

The shipped demo was this model until the Qwen3-VL-MoE one (:mod:`scripts.demo.train`) replaced it; it stays as
``tests/fixtures/llava_demo`` for the LLaVA paths' tests.

A LLaVA model (a small SigLIP-style tower + Qwen3-MoE text model, 8 experts, top-2) trained with transformers'
``LlavaForConditionalGeneration`` on :mod:`duet_testing.demo_tasks`: each training sequence is one scene with 1-4
question/answer turns (or one two-image comparison), loss on the answer tokens only, plus two training-only
probes that are not saved: :class:`CellProbe` (what each grid cell holds, read from the projected visual tokens) and
:class:`MatchProbe` (which cell the first question asks about, read from the text model's hidden states at the visual
tokens, which follow the question in the chat template). Without them the answers alone teach the vision tower
slowly and colour / place answers stay near chance between the shapes of a scene (81% held-out after 5000 steps,
against 99% with them). Deterministic for a seed on a given machine and thread count. Writes a standard Hugging Face checkpoint (config, safetensors, tokenizer,
preprocessor and generation config) plus ``train_log.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from duet_testing.demo_tasks import COLORS, GRID, IMAGE_SIZE, KINDS, SIZES, Conversation, Example, Scene, make_conversation
from scripts.demo.probes import asked_shape
from scripts.demo.tokenizer import END, IMAGE_TOKEN, PAD, chat_prompt, save_tokenizer, train_tokenizer
from scripts.demo.train import _bar, lr_at, pad_batch  # the schedule, batching and progress bar both demos use

PATCH = 16  # one 3x3-grid cell = 2x2 patches: 36 visual tokens per image
PROBE_WEIGHT = 0.5  # weight of the training-only cell probe's loss (CellProbe)
MATCH_WEIGHT = 0.5  # weight of the training-only match probe's loss (MatchProbe)
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2


def build_model(vocab_size: int, image_token_id: int, pad_id: int, end_id: int, seed: int):
    from transformers import LlavaConfig, LlavaForConditionalGeneration, Qwen3MoeConfig, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                                image_size=IMAGE_SIZE, patch_size=PATCH, vision_use_head=False)
    text = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=1024,
                          tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          pad_token_id=pad_id, eos_token_id=end_id, bos_token_id=None)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                      image_seq_length=TOKENS_PER_IMAGE, vision_feature_layer=-1,
                      vision_feature_select_strategy="full", projector_hidden_act="gelu", tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(cfg)


def pixel_values(images) -> torch.Tensor:
    """SigLIP preprocessing at the native size (resize is the identity): rescale to [0, 1], normalise with 0.5/0.5."""
    arr = np.stack([np.asarray(im.convert("RGB"), dtype=np.float32) for im in images]) / 255.0
    return torch.from_numpy((arr - 0.5) / 0.5).permute(0, 3, 1, 2).contiguous()


def encode(tok, conv: Conversation | Example, ids: dict[str, int]) -> tuple[list[int], list[int]]:
    """(input ids with image placeholders expanded, labels: the answers and their end tokens, -100 elsewhere)."""
    turns = conv.turns if isinstance(conv, Conversation) else ((conv.question, conv.answer),)
    input_ids: list[int] = []
    labels: list[int] = []
    for question, answer in turns:
        prompt: list[int] = []
        for t in tok.encode(chat_prompt(question, "llava")).ids:
            prompt.extend([t] * TOKENS_PER_IMAGE if t == ids[IMAGE_TOKEN] else [t])
        reply = tok.encode(answer).ids + [ids[END]]
        input_ids += prompt + reply
        labels += [-100] * len(prompt) + reply
    return input_ids, labels


def make_batch(tok, examples: list[Conversation | Example], ids: dict[str, int]) -> dict[str, torch.Tensor]:
    batch = pad_batch([encode(tok, e, ids) for e in examples], ids[PAD])
    return {**batch, "pixel_values": pixel_values([im for e in examples for im in e.images()])}


class CellProbe(torch.nn.Module):
    """Training-only auxiliary head (not saved): from the projected visual tokens of each grid cell (the 2x2 patches
    it covers), predict what the cell holds -- nothing or a shape kind, its colour, its size. It gives the vision
    tower a dense signal per shape from the first step, where the answers alone reach it only through the text
    model; the checkpoint stays a plain LLaVA."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.register_buffer("cells", _cell_patches(), persistent=False)  # [cells, patches per cell]
        width = hidden * self.cells.shape[1]
        self.kind = torch.nn.Linear(width, 1 + len(KINDS))
        self.color = torch.nn.Linear(width, len(COLORS))
        self.size = torch.nn.Linear(width, len(SIZES))

    def loss(self, visual: torch.Tensor, scenes: list[Scene]) -> torch.Tensor:
        """Mean cross-entropy of the three predictions; ``visual`` is ``[images, tokens per image, hidden]``."""
        x = visual[:, self.cells].flatten(2)  # [images, cells, per*per*hidden]
        kind = torch.zeros(len(scenes), GRID * GRID, dtype=torch.long)
        color = torch.full_like(kind, -100)
        size = torch.full_like(kind, -100)
        for i, sc in enumerate(scenes):
            for s in sc.shapes:
                cell = s.row * GRID + s.col
                kind[i, cell] = 1 + KINDS.index(s.kind)
                color[i, cell] = list(COLORS).index(s.color)
                size[i, cell] = list(SIZES).index(s.size)
        ce = torch.nn.functional.cross_entropy
        return (ce(self.kind(x).flatten(0, 1), kind.flatten()) + ce(self.color(x).flatten(0, 1), color.flatten())
                + ce(self.size(x).flatten(0, 1), size.flatten()))


class MatchProbe(torch.nn.Module):
    """Training-only auxiliary head (not saved): from the text model's hidden states at a cell's visual tokens
    (``layer`` decoder layers in), pick the cell holding the shape the first question asks about ("What color is the
    triangle?", "Where is the blue circle?"). The image follows the question in the prompt, so each visual token can
    test itself against it; this trains that test directly."""

    def __init__(self, hidden: int, layer: int = 2) -> None:
        super().__init__()
        self.layer = layer
        self.register_buffer("cells", _cell_patches(), persistent=False)
        self.score = torch.nn.Linear(hidden * self.cells.shape[1], 1)

    def loss(self, hidden: torch.Tensor, is_image: torch.Tensor, targets: list[int | None]) -> torch.Tensor | None:
        """Cross-entropy over the cells of each image with a target; None when no image has one."""
        keep = [i for i, t in enumerate(targets) if t is not None]
        if not keep:
            return None
        visual = hidden[is_image].view(len(targets), -1, hidden.shape[-1])[keep]
        logits = self.score(visual[:, self.cells].flatten(2)).squeeze(-1)  # [images, cells]
        return torch.nn.functional.cross_entropy(logits, torch.tensor([targets[i] for i in keep]))


def _cell_patches() -> torch.Tensor:
    """[cells, patches per cell]: the visual-token indices each grid cell covers (row-major patches)."""
    side = IMAGE_SIZE // PATCH
    per = side // GRID
    return torch.tensor([[(r * per + i) * side + c * per + j for i in range(per) for j in range(per)]
                         for r in range(GRID) for c in range(GRID)])


def asked_cell(scene: Scene, question: str) -> int | None:
    """The grid cell of the shape a colour or place question names (None for other questions)."""
    shape = asked_shape(scene, question)
    return None if shape is None else shape.row * GRID + shape.col


def _grouped_loss(model, tok, examples: list[Conversation], ids: dict[str, int], probe: CellProbe | None = None,
                  probe_weight: float = 0.0, match: MatchProbe | None = None, match_weight: float = 0.0
                  ) -> torch.Tensor:
    """Mean loss over all answer tokens of the batch, computed in groups of equal image count so one-image
    prompts are not padded to two-image length (about 1.5x less compute for the same batch); plus
    ``probe_weight`` x the cell probe's loss on the batch's images and ``match_weight`` x the match probe's."""
    groups: dict[int, list[Conversation]] = {}
    for e in examples:
        groups.setdefault(len(e.scenes), []).append(e)
    captured: list[torch.Tensor] = []
    hook = (model.model.multi_modal_projector.register_forward_hook(lambda _m, _i, out: captured.append(out))
            if probe is not None else None)
    try:
        total, count, aux, images, matched = None, 0, 0.0, 0, None
        for n in sorted(groups):
            batch = make_batch(tok, groups[n], ids)
            tokens = int((batch["labels"][:, 1:] != -100).sum())
            out = model(**batch, output_hidden_states=match is not None)
            part = out.loss * tokens
            if match is not None and n == 1:
                targets = [asked_cell(e.scenes[0], e.turns[0][0]) for e in groups[n]]
                matched = match.loss(out.hidden_states[match.layer], batch["input_ids"] == ids[IMAGE_TOKEN], targets)
            total = part if total is None else total + part
            count += tokens
            if probe is not None:
                scenes = [s for e in groups[n] for s in e.scenes]
                aux = aux + probe.loss(captured.pop(), scenes) * len(scenes)
                images += len(scenes)
    finally:
        if hook is not None:
            hook.remove()
    loss = total / count
    if probe is not None:
        loss = loss + probe_weight * aux / images
    if matched is not None:  # only one-image prompts ask about a cell (one group)
        loss = loss + match_weight * matched
    return loss


def train(out: Path, *, steps: int, seed: int = 0, batch_size: int = 32, lr: float = 3e-3, log_every: int = 20,
          progress: bool = True, save: bool = True, checkpoint_every: int = 0,
          probe_weight: float = PROBE_WEIGHT, match_weight: float = MATCH_WEIGHT) -> torch.nn.Module:
    tok = train_tokenizer(family="llava")
    ids = {t: tok.token_to_id(t) for t in (IMAGE_TOKEN, END, PAD)}
    model = build_model(tok.get_vocab_size(), ids[IMAGE_TOKEN], ids[PAD], ids[END], seed)
    model.train()
    probe = CellProbe(model.config.text_config.hidden_size) if probe_weight > 0 else None
    match = MatchProbe(model.config.text_config.hidden_size) if match_weight > 0 else None
    params = [p for m in (model, probe, match) if m is not None for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = random.Random(seed)
    log = []
    bar = _bar(steps) if progress else None
    t0 = time.perf_counter()
    for step in range(steps):
        examples = [make_conversation(rng, style="grid96") for _ in range(batch_size)]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup=min(100, steps // 10 + 1))
        opt.zero_grad(set_to_none=True)
        loss = _grouped_loss(model, tok, examples, ids, probe, probe_weight, match, match_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % log_every == 0 or step == steps - 1:
            log.append({"step": step, "loss": round(loss.item(), 5), "lr": opt.param_groups[0]["lr"],
                        "elapsed_s": round(time.perf_counter() - t0, 1)})
        if checkpoint_every and step and step % checkpoint_every == 0:
            _save(model, tok, out / f"step-{step}", log, seed=seed, steps=steps)
            model.train()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.4f}")
    if bar is not None:
        bar.close()
    model.eval()
    if save:
        _save(model, tok, out, log, seed=seed, steps=steps)
    return model


def _save(model, tok, out: Path, log: list[dict], *, seed: int, steps: int) -> None:
    from transformers import GenerationConfig, SiglipImageProcessorPil

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    save_tokenizer(tok, out, "llava")
    SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(out)
    end = tok.token_to_id(END)
    GenerationConfig(eos_token_id=end, pad_token_id=tok.token_to_id(PAD), do_sample=False,
                     max_new_tokens=48).save_pretrained(out)
    with open(out / "train_log.jsonl", "w") as f:
        f.write(json.dumps({"seed": seed, "steps": steps, "torch_threads": torch.get_num_threads()}) + "\n")
        f.writelines(json.dumps(r) + "\n" for r in log)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.demo.train_llava", description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--probe-weight", type=float, default=PROBE_WEIGHT,
                   help="weight of the auxiliary cell-probe loss on the visual tokens (0: off)")
    p.add_argument("--match-weight", type=float, default=MATCH_WEIGHT,
                   help="weight of the auxiliary match-probe loss (which cell the question asks about; 0: off)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also save OUT/step-N every N steps")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    train(a.out, steps=a.steps, seed=a.seed, batch_size=a.batch_size, lr=a.lr, checkpoint_every=a.checkpoint_every,
          probe_weight=a.probe_weight, match_weight=a.match_weight)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
