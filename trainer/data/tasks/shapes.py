"""A visual task drawn with Pillow: how many shapes does the image hold?

Each example is one 56x56 image (the tiny vision-language model's size, ``trainer.builtin.zoo_vl``) with 1 to 4
shapes (circles, squares, triangles) in one of four colours on a white background, placed on a 2x2 grid of
cells, one shape per cell, jittered inside it. The prompt is a chat message whose content is the image and a
question; the answer is the count (``shapes_answer``: ``"There are N shapes. The answer is N."``, the arithmetic
task's closing sentence, so its answer reward reads it).

Determinism: example ``i`` of a split is drawn from ``random.Random`` seeded through SHA-256 of (seed, split, i), so
the same arguments give the same pixels on every machine. The two splits are separate streams of one distribution:
a shape has 12,432 looks (3 kinds x 4 colours x sizes 10-16 with their offsets in a cell), so one-shape images come
in about 5e4 kinds and a held-out one repeats one of N training images with probability about N / 5e4; two or more
shapes make repeats negligible (about 9e8 kinds for two).
"""
from __future__ import annotations

import hashlib
import random

import datasets

__all__ = ["COLOURS", "IMAGE_SIZE", "MAX_COUNT", "draw_shapes", "shapes_answer", "shapes_dataset", "shapes_example",
           "shapes_question"]

IMAGE_SIZE = 56
MAX_COUNT = 4
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (30, 60, 220), "black": (0, 0, 0)}
_SHAPES = ("circle", "square", "triangle")
_CELL = IMAGE_SIZE // 2
_QUESTION = "How many shapes are in the image?"


def _rng(seed: int, split: str, index: int) -> random.Random:
    digest = hashlib.sha256(f"shapes:{seed}:{split}:{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def draw_shapes(shapes: list[tuple[str, str, int, int, int]]):
    """A PIL image of ``(kind, colour, x, y, size)`` shapes (top-left corner, side) on white."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for kind, colour, x, y, size in shapes:
        if kind not in _SHAPES or colour not in COLOURS:
            raise ValueError(f"shape ({kind!r}, {colour!r}): expected a kind of {_SHAPES} and a colour of "
                             f"{sorted(COLOURS)}")
        box, fill = (x, y, x + size, y + size), COLOURS[colour]
        if kind == "circle":
            draw.ellipse(box, fill=fill)
        elif kind == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=fill)
    return image


def shapes_example(index: int, seed: int = 0, split: str = "train") -> dict:
    """Example ``index`` of ``split``: ``{"image": PIL image, "count": int, "shapes": [...]}``."""
    if split not in ("train", "test"):
        raise ValueError(f"split = {split!r}: expected 'train' or 'test'")
    rng = _rng(seed, split, index)
    count = rng.randint(1, MAX_COUNT)
    cells = rng.sample(range(4), count)
    shapes = []
    for cell in cells:
        size = rng.randint(10, 16)
        x = (cell % 2) * _CELL + rng.randint(2, _CELL - size - 2)
        y = (cell // 2) * _CELL + rng.randint(2, _CELL - size - 2)
        shapes.append((rng.choice(_SHAPES), rng.choice(sorted(COLOURS)), x, y, size))
    return {"image": draw_shapes(shapes), "count": count, "shapes": shapes}


def shapes_question() -> list[dict]:
    """The prompt's messages: one user turn holding the image placeholder, then the question."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": _QUESTION}]}]


def shapes_answer(count: int) -> str:
    """The completion that answers ``count``."""
    return "There is 1 shape. The answer is 1." if count == 1 else f"There are {count} shapes. The answer is {count}."


def shapes_dataset(num_examples: int, *, seed: int = 0, split: str = "train") -> datasets.Dataset:
    """``num_examples`` rows of ``split``: ``prompt`` (the question), ``image`` (PNG in a ``datasets.Image`` column:
    lossless, decoded to the same pixels), ``answer`` (the count, as the arithmetic task's reward reads it)."""
    if not isinstance(num_examples, int) or num_examples < 1:
        raise ValueError(f"num_examples = {num_examples!r}: expected an integer >= 1")
    examples = [shapes_example(i, seed=seed, split=split) for i in range(num_examples)]
    features = datasets.Features({"prompt": datasets.Value("string"), "image": datasets.Image(),
                                  "answer": datasets.Value("string")})
    return datasets.Dataset.from_dict({"prompt": [_QUESTION] * num_examples, "image": [e["image"] for e in examples],
                                       "answer": [str(e["count"]) for e in examples]}, features=features)
