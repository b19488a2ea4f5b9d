"""The demo trainer's two training-only probes (not saved; the checkpoint stays a plain Qwen3-VL-MoE) and their
targets: :class:`TokenProbe` reads from each merged visual token the shape kind and colour over it and the third of
the image it lies in (and from the mean of a shape's tokens, its kind); :class:`MatchProbe` picks the visual token
holding the shape the first question asks about from the text model's hidden states."""

from __future__ import annotations

import torch

from duet_testing.demo_tasks import COLORS, GRID, KINDS, Scene
from scripts.demo.tokenizer import IMAGE_TOKEN


def token_targets(scene: Scene, gh: int, gw: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per merged visual token (row-major over the ``gh`` x ``gw`` grid): the kind over it (0 none, 1 + kind index),
    its colour (-100 where none), the third of the image it lies in (0-8, row-major) and the index of the shape over
    it in ``scene.shapes`` (-1 where none)."""
    kind = [0] * (gh * gw)
    color = [-100] * (gh * gw)
    cell = [0] * (gh * gw)
    owner = [-1] * (gh * gw)
    for i in range(gh):
        for j in range(gw):
            tx, ty = (j + 0.5) / gw, (i + 0.5) / gh
            t = i * gw + j
            cell[t] = min(GRID - 1, int(ty * GRID)) * GRID + min(GRID - 1, int(tx * GRID))
            for n, s in enumerate(scene.shapes):  # over the shape's box, in pixels
                r = s.r * min(scene.width, scene.height)
                if abs(tx - s.x) * scene.width <= r and abs(ty - s.y) * scene.height <= r:
                    kind[t], color[t], owner[t] = 1 + KINDS.index(s.kind), list(COLORS).index(s.color), n
    for n, s in enumerate(scene.shapes):  # the token holding the centre is always the shape's
        t = centre_token(s, gh, gw)
        kind[t], color[t], owner[t] = 1 + KINDS.index(s.kind), list(COLORS).index(s.color), n
    return kind, color, cell, owner


def centre_token(shape, gh: int, gw: int) -> int:
    return min(gh - 1, int(shape.y * gh)) * gw + min(gw - 1, int(shape.x * gw))


class TokenProbe(torch.nn.Module):
    """Training-only auxiliary head (not saved): from each merged visual token (the vision tower's output), predict
    the shape kind over it (or none), its colour, and which third of the image the token lies in; and from the mean
    of the tokens over each shape, its kind. A dense signal per shape from the first step, where the answers reach
    the tower only through the text model; the checkpoint stays a plain Qwen3-VL-MoE. With ``centre``, also
    whether a token holds a shape's centre (one token per shape: what a count can add up)."""

    def __init__(self, hidden: int, centre: bool = False) -> None:
        super().__init__()
        self.kind = torch.nn.Linear(hidden, 1 + len(KINDS))
        self.color = torch.nn.Linear(hidden, len(COLORS))
        self.cell = torch.nn.Linear(hidden, GRID * GRID)
        self.shape_kind = torch.nn.Linear(hidden, len(KINDS))
        self.centre = torch.nn.Linear(hidden, 2) if centre else None

    def loss(self, visual: torch.Tensor, scenes: list[Scene], grids: list[tuple[int, int]]) -> torch.Tensor:
        """Sum of the predictions' mean cross-entropies; ``visual`` is ``[tokens of every image, hidden]``."""
        kind, color, cell, owner, shape_kinds, at = [], [], [], [], [], 0
        centres: list[int] = []  # each shape's centre token, counted over every image's tokens
        for sc, (gh, gw) in zip(scenes, grids, strict=True):
            if self.centre is not None:
                centres += [len(kind) + centre_token(s, gh, gw) for s in sc.shapes]
            k, c, p, o = token_targets(sc, gh, gw)
            kind += k
            color += c
            cell += p
            owner += [at + n if n >= 0 else -1 for n in o]
            shape_kinds += [KINDS.index(s.kind) for s in sc.shapes]
            at += len(sc.shapes)
        owners = torch.tensor(owner)
        held = owners >= 0
        pooled = torch.zeros(at, visual.shape[-1], dtype=visual.dtype).index_add_(0, owners[held], visual[held])
        pooled = pooled / torch.bincount(owners[held], minlength=at).clamp_min(1)[:, None].to(visual.dtype)
        ce = torch.nn.functional.cross_entropy
        total = (ce(self.kind(visual), torch.tensor(kind)) + ce(self.color(visual), torch.tensor(color))
                 + ce(self.cell(visual), torch.tensor(cell)) + ce(self.shape_kind(pooled), torch.tensor(shape_kinds)))
        if self.centre is not None:
            target = torch.zeros(len(kind), dtype=torch.long)
            target[centres] = 1
            total = total + ce(self.centre(visual), target)
        return total


class MatchProbe(torch.nn.Module):
    """Training-only auxiliary head (not saved): from the text model's hidden states at an image's visual tokens
    (``layer`` decoder layers in), pick the token holding the shape the first question asks about ("What color is
    the triangle?", "Where is the blue circle?"). The image follows the question in the prompt, so each visual token
    can test itself against it; this trains that test directly."""

    def __init__(self, hidden: int, layer: int = 2) -> None:
        super().__init__()
        self.layer = layer
        self.score = torch.nn.Linear(hidden, 1)

    def loss(self, hidden: torch.Tensor, is_image: torch.Tensor, targets: list[int | None]) -> torch.Tensor | None:
        """Mean cross-entropy over the tokens of each sequence's (first) image with a target; None when none has
        one. ``hidden`` is ``[batch, seq, hidden]``, ``is_image`` ``[batch, seq]``."""
        losses = []
        for b, t in enumerate(targets):
            if t is None:
                continue
            logits = self.score(hidden[b][is_image[b]]).squeeze(-1)
            losses.append(torch.nn.functional.cross_entropy(logits[None], torch.tensor([t])))
        return torch.stack(losses).mean() if losses else None


def asked_shape(scene: Scene, question: str):
    """The shape a colour or place question names (None for other questions)."""
    words = question.replace(IMAGE_TOKEN, "").removesuffix("?").split()
    if "What color is the" in question:
        hits = [s for s in scene.shapes if s.kind == words[-1]]
    elif "Where is the" in question:
        hits = [s for s in scene.shapes if (s.color, s.kind) == (words[-2], words[-1])]
    else:
        return None
    return hits[0] if len(hits) == 1 else None
