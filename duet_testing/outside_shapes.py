"""Shape scenes drawn by a second, independent program: the demo task's questions on images its generator never makes.

:mod:`duet_testing.demo_tasks` draws with PIL's ``ImageDraw`` on canvases of 48-360 pixels a side (aspect ratio up to
2.5:1). This module rasterises with numpy instead (coverage from 4x4 sub-pixel samples, so every edge is
anti-aliased), on canvases the generator does not use (400-1000 pixels a side, and 3:1 / 1:3), with other palettes
(CSS named colours and a plotting library's ten-colour cycle), equilateral triangles, square-diagonal diamonds, shapes
placed anywhere in their cell that keeps them inside it, and white, grey or paper backgrounds. The questions and
answers are the demo task's (same words, same places). ``duet bench quality --images outside`` scores a model on
them; it is a check of what the demo learned, not training material.
"""

from __future__ import annotations

import random

import numpy as np
from PIL import Image

from duet_testing.demo_tasks import CELL_NAMES, GRID, KINDS, Example, _single

SIZES = ((512, 512), (640, 480), (480, 640), (800, 450), (400, 300), (300, 400), (900, 300), (300, 900),
         (1000, 700), (420, 420))
PALETTES = {
    "css": {"red": (255, 0, 0), "green": (0, 128, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0),
            "purple": (128, 0, 128), "orange": (255, 165, 0)},
    "plot": {"red": (214, 39, 40), "green": (44, 160, 44), "blue": (31, 119, 180), "yellow": (255, 215, 0),
             "purple": (148, 103, 189), "orange": (255, 127, 14)},
}
BACKGROUNDS = ((255, 255, 255), (240, 240, 240), (250, 245, 230))
SUB = 4  # sub-pixel samples per axis


class _Shape:
    def __init__(self, kind: str, color: str, row: int, col: int, x: float, y: float, r: float, rgb) -> None:
        self.kind, self.color, self.row, self.col = kind, color, row, col
        self.x, self.y, self.r, self.rgb = x, y, r, rgb

    @property
    def place(self) -> str:
        return CELL_NAMES[self.row][self.col]


class _Scene:
    """Duck-types :class:`duet_testing.demo_tasks.Scene` for the question makers (shapes in reading order)."""

    def __init__(self, shapes: list[_Shape], width: int, height: int, background) -> None:
        self.shapes, self.width, self.height, self.background = tuple(shapes), width, height, background


def make_scene(rng: random.Random, n: int | None = None) -> _Scene:
    width, height = rng.choice(SIZES)
    palette = PALETTES[rng.choice(sorted(PALETTES))]
    cw, ch = width / GRID, height / GRID
    shapes = []
    for c in sorted(rng.sample(range(GRID * GRID), n or rng.randint(1, 4))):
        row, col = divmod(c, GRID)
        r = rng.uniform(0.25, 0.45) * min(cw, ch)
        x = (col + 0.5) * cw + rng.uniform(-1, 1) * (cw / 2 - r)
        y = (row + 0.5) * ch + rng.uniform(-1, 1) * (ch / 2 - r)
        color = rng.choice(sorted(palette))
        shapes.append(_Shape(rng.choice(KINDS), color, row, col, x, y, r, palette[color]))
    return _Scene(shapes, width, height, rng.choice(BACKGROUNDS))


def render(scene: _Scene) -> Image.Image:
    h, w = scene.height, scene.width
    img = np.empty((h, w, 3), np.float32)
    img[:] = scene.background
    offsets = (np.arange(SUB, dtype=np.float32) + 0.5) / SUB
    for s in scene.shapes:
        x0, x1 = max(0, int(s.x - s.r) - 1), min(w, int(s.x + s.r) + 2)
        y0, y1 = max(0, int(s.y - s.r) - 1), min(h, int(s.y + s.r) + 2)
        ys = (np.arange(y0, y1, dtype=np.float32)[:, None] + offsets[None, :]).reshape(-1)
        xs = (np.arange(x0, x1, dtype=np.float32)[:, None] + offsets[None, :]).reshape(-1)
        inside = _inside(s, xs[None, :] - s.x, ys[:, None] - s.y)
        cover = inside.reshape(y1 - y0, SUB, x1 - x0, SUB).mean(axis=(1, 3))[..., None]
        img[y0:y1, x0:x1] = img[y0:y1, x0:x1] * (1 - cover) + np.asarray(s.rgb, np.float32) * cover
    return Image.fromarray(np.clip(img + 0.5, 0, 255).astype(np.uint8), "RGB")


def _inside(s: _Shape, dx: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """Which sample points (offsets from the centre) the shape covers."""
    r = s.r
    if s.kind == "circle":
        return (dx * dx + dy * dy <= r * r).astype(np.float32)
    if s.kind == "square":
        a = r * 0.8
        return ((np.abs(dx) <= a) & (np.abs(dy) <= a)).astype(np.float32)
    if s.kind == "diamond":
        return (np.abs(dx) + np.abs(dy) <= r).astype(np.float32)
    # equilateral triangle, point up, centred on its circumcentre
    top, base = -r, r / 2
    half = (dy - top) / (base - top) * (r * np.sqrt(3) / 2)
    return ((dy >= top) & (dy <= base) & (np.abs(dx) <= half)).astype(np.float32)


class OutsideExample(Example):
    def images(self) -> list[Image.Image]:
        return [render(s) for s in self.scenes]


def make_dataset(seed: int, n: int, qtypes: tuple[str, ...] = ("color", "count", "position", "describe", "compare")
                 ) -> list[Example]:
    """``n`` examples cycling through ``qtypes`` (balanced), deterministic in ``seed``."""
    rng = random.Random(seed)
    out: list[Example] = []
    for i in range(n):
        qtype = qtypes[i % len(qtypes)]
        if qtype == "compare":
            a, b = rng.sample(range(1, 5), 2)
            out.append(OutsideExample(qtype, (make_scene(rng, a), make_scene(rng, b)),
                                      "<image><image>Which image has more shapes?",
                                      "the first" if a > b else "the second"))
            continue
        while True:
            scene = make_scene(rng)
            qa = _single(rng, scene, qtype)
            if qa is not None:
                out.append(OutsideExample(qtype, (scene,), "<image>" + qa[0], qa[1]))
                break
    return out
