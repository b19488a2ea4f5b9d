"""The demo task: questions about images of simple shapes, with exact-string answers.

Everything is a pure function of a seed. A scene holds 1-4 shapes (``circle``, ``square``, ``triangle``,
``diamond``) in distinct cells of a 3x3 grid over the image, each with one of six colours, on a plain, noisy or
graded background. Two styles:

* ``varied`` (the default, the shipped Qwen3-VL-MoE demo's): any canvas from 48 to 360 pixels a side (aspect ratios
  1:2.5 to 2.5:1), shapes sized relative to their cell, centred anywhere in it that keeps them mostly inside, colours
  drawn around two prototypes per name, sometimes outlined or anti-aliased;
* ``grid96`` (the LLaVA fixture's): 96x96, each shape at its cell's centre (a few pixels of jitter), two fixed sizes.

A shape's place is the cell its centre lies in. Question types:

* ``color``    -- "What color is the triangle?" -> "red" (the asked kind appears once)
* ``count``    -- "How many shapes are there?" -> "3"
* ``position`` -- "Where is the blue circle?" -> "top left" (the asked colour + kind appears once)
* ``describe`` -- "Describe the image." -> "red circle top left, blue square center" (reading order)
* ``compare``  -- two images, "Which image has more shapes?" -> "the first" / "the second"

Prompts carry one ``<image>`` placeholder per image; the chat template is applied by the caller.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 96  # the grid96 style's canvas
GRID = 3
STYLES = ("varied", "grid96")
MIN_SIDE, MAX_SIDE, MAX_ASPECT = 48, 360, 2.5  # the varied style's canvases
REL_RADIUS = (0.25, 0.48)  # the varied style's shape radius, as a fraction of the cell's shorter side
KINDS = ("circle", "square", "triangle", "diamond")
COLORS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
    "yellow": (235, 205, 30), "purple": (150, 60, 190), "orange": (245, 140, 30),
}
SIZES = {"small": 17, "large": 26}  # grid96 diameters; varied: relative to the cell
# a second prototype per colour name (the CSS / PIL named colour, or the nearest that keeps the six apart)
ALT_COLORS = {
    "red": (255, 0, 0), "green": (0, 128, 0), "blue": (0, 0, 255),
    "yellow": (255, 220, 0), "purple": (128, 0, 128), "orange": (255, 165, 0),
}
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
    # varied style: centre and radius as fractions of the canvas (x of its width, y and r of its height) and the fill
    x: float | None = None
    y: float | None = None
    r: float | None = None
    rgb: tuple[int, int, int] | None = None

    @property
    def place(self) -> str:
        return CELL_NAMES[self.row][self.col]


@dataclass(frozen=True)
class Scene:
    shapes: tuple[Shape, ...]
    noisy: bool
    seed: int  # drives the pixel-level jitter and noise
    width: int = IMAGE_SIZE
    height: int = IMAGE_SIZE
    style: str = "grid96"


@dataclass(frozen=True)
class Example:
    qtype: str
    scenes: tuple[Scene, ...]
    question: str  # with one "<image>" per scene, in order
    answer: str

    def images(self) -> list[Image.Image]:
        return [render(s) for s in self.scenes]


def make_scene(rng: random.Random, n: int | None = None, style: str = "varied") -> Scene:
    """A scene of ``n`` shapes (1-4 at random when None) in the given style (see the module docstring)."""
    if style not in STYLES:
        raise ValueError(f"unknown scene style {style!r} (known: {', '.join(STYLES)})")
    n = n or rng.randint(1, 4)
    cells = sorted(rng.sample(range(GRID * GRID), n))
    if style == "grid96":
        shapes = tuple(Shape(rng.choice(KINDS), rng.choice(list(COLORS)), rng.choice(list(SIZES)), c // GRID, c % GRID)
                       for c in cells)
        return Scene(shapes, noisy=rng.random() < 0.5, seed=rng.randrange(2**31))
    short = math.exp(rng.uniform(math.log(MIN_SIDE), math.log(300)))
    long = min(MAX_SIDE, short * math.exp(rng.uniform(0.0, math.log(MAX_ASPECT))))
    width, height = (round(short), round(long)) if rng.random() < 0.5 else (round(long), round(short))
    cw, ch = width / GRID, height / GRID
    shapes = []
    for c in cells:
        row, col = divmod(c, GRID)
        rel = rng.uniform(*REL_RADIUS)
        r = rel * min(cw, ch)
        mx, my = min(0.5, 0.85 * r / cw), min(0.5, 0.85 * r / ch)  # the centre keeps most of the shape in its cell
        x = min(max((col + rng.uniform(mx, 1 - mx)) * cw, r), width - r)  # and all of it on the canvas
        y = min(max((row + rng.uniform(my, 1 - my)) * ch, r), height - r)
        name = rng.choice(list(COLORS))
        t = rng.random()
        rgb = tuple(int(min(255, max(0, (1 - t) * a + t * b + rng.gauss(0, 10))))
                    for a, b in zip(COLORS[name], ALT_COLORS[name], strict=True))
        shapes.append(Shape(rng.choice(KINDS), name, "small" if rel < 0.34 else "large", row, col,
                            x / width, y / height, r / min(width, height), rgb))
    return Scene(tuple(shapes), noisy=rng.random() < 0.4, seed=rng.randrange(2**31), width=width, height=height,
                 style="varied")


def render(scene: Scene) -> Image.Image:
    """Draw the scene (deterministic in ``scene.seed``)."""
    if scene.style == "varied":
        return _render_varied(scene)
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
        _draw(draw, s.kind, cx, cy, r, COLORS[s.color])
    return img


def _render_varied(scene: Scene) -> Image.Image:
    """Background plain, graded or white; shapes sometimes outlined; a third of the scenes drawn at 3x and
    downscaled (anti-aliased edges); noise over everything when ``scene.noisy``."""
    rng = np.random.default_rng(scene.seed)
    k = 3 if rng.random() < 0.35 else 1
    w, h = scene.width * k, scene.height * k
    background = rng.integers(3)
    base = rng.integers(215, 256, size=3).astype(np.float32)
    if background == 0:
        img = Image.new("RGB", (w, h), tuple(int(v) for v in base))
    elif background == 1:
        other = rng.integers(215, 256, size=3).astype(np.float32)
        ramp = np.linspace(0.0, 1.0, h if rng.random() < 0.5 else w, dtype=np.float32)
        ramp = ramp[:, None, None] if len(ramp) == h else ramp[None, :, None]
        pixels = np.broadcast_to(base + (other - base) * ramp, (h, w, 3))
        img = Image.fromarray(pixels.astype(np.uint8), "RGB")
    else:
        img = Image.new("RGB", (w, h), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    for s in scene.shapes:
        outline = None
        if rng.random() < 0.25:
            outline = (0, 0, 0) if rng.random() < 0.5 else tuple(int(v * 0.55) for v in s.rgb)
        _draw(draw, s.kind, s.x * w, s.y * h, s.r * min(w, h), s.rgb, outline=outline,
              width=max(1, round(k * rng.uniform(1.0, 2.5))), stretch=rng.uniform(0.85, 1.15))
    if k > 1:
        img = img.resize((scene.width, scene.height), Image.Resampling.BOX)
    if scene.noisy:
        pixels = np.asarray(img, dtype=np.float32) + rng.normal(0, rng.uniform(4, 14), (scene.height, scene.width, 3))
        img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    return img


def _draw(draw: ImageDraw.ImageDraw, kind: str, cx: float, cy: float, r: float, fill, *, outline=None,
          width: int = 1, stretch: float = 1.0) -> None:
    """One shape of radius ``r`` centred at (cx, cy); ``stretch`` widens a triangle's base or a diamond's waist."""
    if kind == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill, outline=outline, width=width)
    elif kind == "square":
        a = r if stretch == 1.0 else 0.9 * r
        draw.rectangle([cx - a, cy - a, cx + a, cy + a], fill=fill, outline=outline, width=width)
    elif kind == "triangle":
        b = r * stretch
        draw.polygon([(cx, cy - r), (cx + b, cy + r), (cx - b, cy + r)], fill=fill, outline=outline, width=width)
    else:
        b = r * min(1.0, stretch)
        draw.polygon([(cx, cy - r), (cx + b, cy), (cx, cy + r), (cx - b, cy)], fill=fill, outline=outline,
                     width=width)


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


def make_example(rng: random.Random, qtype: str | None = None, style: str = "varied") -> Example:
    """One example of ``qtype`` (uniformly chosen when None) in scene ``style``."""
    qtype = qtype or rng.choice(QTYPES)
    if qtype == "compare":
        a, b = rng.sample(range(1, 5), 2)
        s1, s2 = make_scene(rng, a, style), make_scene(rng, b, style)
        return Example(qtype, (s1, s2), "<image><image>Which image has more shapes?",
                       "the first" if a > b else "the second")
    while True:
        scene = make_scene(rng, style=style)
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


def make_conversation(rng: random.Random, max_turns: int = 4, style: str = "varied", min_turns: int = 1
                      ) -> Conversation:
    """A compare question (alone), or ``min_turns``..``max_turns`` single-image questions about one scene in random
    order (fewer where the scene leaves a question ambiguous), so every single-image question type is also trained
    in the first turn exactly as it is asked at test time."""
    if rng.random() < 1 / len(QTYPES):
        e = make_example(rng, "compare", style)
        return Conversation(e.scenes, ((e.question, e.answer),))
    scene = make_scene(rng, style=style)
    kinds = [q for q in QTYPES if q != "compare"]
    rng.shuffle(kinds)
    turns = [qa for q in kinds if (qa := _single(rng, scene, q)) is not None][: rng.randint(min_turns, max_turns)]
    turns[0] = ("<image>" + turns[0][0], turns[0][1])
    return Conversation((scene,), tuple(turns))


def make_dataset(seed: int, n: int, qtypes: tuple[str, ...] = QTYPES, style: str = "varied") -> list[Example]:
    """``n`` examples cycling through ``qtypes`` (balanced), deterministic in ``seed``."""
    rng = random.Random(seed)
    return [make_example(rng, qtypes[i % len(qtypes)], style) for i in range(n)]


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
