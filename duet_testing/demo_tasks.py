"""The demo task: questions about images of simple shapes, with exact-string answers.

Everything is a pure function of a seed. A scene holds 1-4 shapes (``circle``, ``square``, ``triangle``,
``diamond``) in distinct cells of a 3x3 grid, each with one of six colours and one of two sizes, on a plain or noisy
background. Question types:

* ``color``    -- "What color is the triangle?" -> "red" (the asked kind appears once)
* ``count``    -- "How many shapes are there?" -> "3"
* ``position`` -- "Where is the blue circle?" -> "top left" (the asked colour + kind appears once)
* ``describe`` -- "Describe the image." -> "red circle top left, blue square center" (reading order)
* ``compare``  -- two images, "Which image has more shapes?" -> "the first" / "the second"

Prompts carry one ``<image>`` placeholder per image; the chat template is applied by the caller.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 96
GRID = 3
KINDS = ("circle", "square", "triangle", "diamond")
COLORS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
    "yellow": (235, 205, 30), "purple": (150, 60, 190), "orange": (245, 140, 30),
}
SIZES = {"small": 17, "large": 26}
CELL_NAMES = (("top left", "top", "top right"), ("left", "center", "right"), ("bottom left", "bottom", "bottom right"))
COUNT_WORDS = {1: "1", 2: "2", 3: "3", 4: "4"}
QTYPES = ("color", "count", "position", "describe", "compare")


@dataclass(frozen=True)
class Shape:
    kind: str
    color: str
    size: str
    row: int
    col: int

    @property
    def place(self) -> str:
        return CELL_NAMES[self.row][self.col]


@dataclass(frozen=True)
class Scene:
    shapes: tuple[Shape, ...]
    noisy: bool
    seed: int  # drives the pixel-level jitter and noise


@dataclass(frozen=True)
class Example:
    qtype: str
    scenes: tuple[Scene, ...]
    question: str  # with one "<image>" per scene, in order
    answer: str

    def images(self) -> list[Image.Image]:
        return [render(s) for s in self.scenes]


def make_scene(rng: random.Random, n: int | None = None) -> Scene:
    n = n or rng.randint(1, 4)
    cells = rng.sample(range(GRID * GRID), n)
    shapes = tuple(Shape(rng.choice(KINDS), rng.choice(list(COLORS)), rng.choice(list(SIZES)), c // GRID, c % GRID)
                   for c in sorted(cells))
    return Scene(shapes, noisy=rng.random() < 0.5, seed=rng.randrange(2**31))


def render(scene: Scene) -> Image.Image:
    """Draw the scene (deterministic in ``scene.seed``)."""
    rng = np.random.default_rng(scene.seed)
    if scene.noisy:
        base = rng.integers(200, 256, size=3)
        pixels = np.clip(base + rng.normal(0, 12, (IMAGE_SIZE, IMAGE_SIZE, 3)), 0, 255).astype(np.uint8)
        img = Image.fromarray(pixels, "RGB")
    else:
        img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), tuple(int(v) for v in rng.integers(225, 256, size=3)))
    draw = ImageDraw.Draw(img)
    cell = IMAGE_SIZE / GRID
    for s in scene.shapes:
        r = SIZES[s.size] / 2
        cx = (s.col + 0.5) * cell + rng.uniform(-2.5, 2.5)
        cy = (s.row + 0.5) * cell + rng.uniform(-2.5, 2.5)
        fill = COLORS[s.color]
        if s.kind == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        elif s.kind == "square":
            draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
        elif s.kind == "triangle":
            draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)
        else:
            draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)
    return img


def describe(scene: Scene) -> str:
    return ", ".join(f"{s.color} {s.kind} {s.place}" for s in scene.shapes)


def _unique(scene: Scene, key) -> list[Shape]:
    values = [key(s) for s in scene.shapes]
    return [s for s, v in zip(scene.shapes, values, strict=True) if values.count(v) == 1]


def _single(rng: random.Random, scene: Scene, qtype: str) -> tuple[str, str] | None:
    """(question without the image placeholder, answer) of ``qtype`` about ``scene``; None if it has no such
    question (no uniquely identifiable shape)."""
    if qtype == "count":
        return "How many shapes are there?", COUNT_WORDS[len(scene.shapes)]
    if qtype == "describe":
        return "Describe the image.", describe(scene)
    if qtype == "color":
        choices = _unique(scene, lambda s: s.kind)
        if choices:
            s = rng.choice(choices)
            return f"What color is the {s.kind}?", s.color
        return None
    if qtype == "position":
        choices = _unique(scene, lambda s: (s.color, s.kind))
        if choices:
            s = rng.choice(choices)
            return f"Where is the {s.color} {s.kind}?", s.place
        return None
    raise ValueError(f"unknown question type {qtype!r} (known: {', '.join(QTYPES)})")


def make_example(rng: random.Random, qtype: str | None = None) -> Example:
    """One example of ``qtype`` (uniformly chosen when None)."""
    qtype = qtype or rng.choice(QTYPES)
    if qtype == "compare":
        a, b = rng.sample(range(1, 5), 2)
        s1, s2 = make_scene(rng, a), make_scene(rng, b)
        return Example(qtype, (s1, s2), "<image><image>Which image has more shapes?",
                       "the first" if a > b else "the second")
    while True:
        scene = make_scene(rng)
        qa = _single(rng, scene, qtype)
        if qa is not None:
            return Example(qtype, (scene,), "<image>" + qa[0], qa[1])


@dataclass(frozen=True)
class Conversation:
    """Training material: one scene and several question/answer turns about it (the image in the first turn)."""

    scenes: tuple[Scene, ...]
    turns: tuple[tuple[str, str], ...]  # (question, answer); the first question carries the image placeholder(s)

    def images(self) -> list[Image.Image]:
        return [render(s) for s in self.scenes]


def make_conversation(rng: random.Random, max_turns: int = 4) -> Conversation:
    """A compare question (alone), or 1..max_turns single-image questions about one scene in random order, so
    every single-image question type is also trained in the first turn exactly as it is asked at test time."""
    if rng.random() < 1 / len(QTYPES):
        e = make_example(rng, "compare")
        return Conversation(e.scenes, ((e.question, e.answer),))
    scene = make_scene(rng)
    kinds = [q for q in QTYPES if q != "compare"]
    rng.shuffle(kinds)
    turns = [qa for q in kinds if (qa := _single(rng, scene, q)) is not None][: rng.randint(1, max_turns)]
    turns[0] = ("<image>" + turns[0][0], turns[0][1])
    return Conversation((scene,), tuple(turns))


def make_dataset(seed: int, n: int, qtypes: tuple[str, ...] = QTYPES) -> list[Example]:
    """``n`` examples cycling through ``qtypes`` (balanced), deterministic in ``seed``."""
    rng = random.Random(seed)
    return [make_example(rng, qtypes[i % len(qtypes)]) for i in range(n)]


def corpus() -> list[str]:
    """Every string the task can produce (for training the tokenizer)."""
    texts = ["How many shapes are there?", "Describe the image.", "Which image has more shapes?", "the first",
             "the second", *COUNT_WORDS.values()]
    for kind in KINDS:
        texts.append(f"What color is the {kind}?")
        for color in COLORS:
            texts.append(f"Where is the {color} {kind}?")
            for row in CELL_NAMES:
                texts.extend(f"{color} {kind} {place}" for place in row)
    return texts
