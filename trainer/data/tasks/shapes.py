"""A visual task drawn with Pillow: how many shapes does the image hold?

Each example is one 56x56 image (the tiny vision-language model's size, ``trainer.builtin.zoo_vl``) with 1 to 4
shapes (circles, squares, triangles) in one of four colours on a white background, placed on a 2x2 grid of
cells, one shape per cell, jittered inside it. The prompt is a chat message whose content is the image and a
question; the answer is the count (``shapes_answer``: ``"There are N shapes. The answer is N."``, the arithmetic
task's closing sentence, so its answer reward reads it).

Determinism: example ``i`` of a split is drawn from ``random.Random`` seeded through SHA-256 of (seed, split, i), so
the same arguments give the same pixels on every machine.

The splits share no image, whatever their seeds and sizes: every shape of a training image sits at an even offset
(x and y) inside its cell, every shape of a test image at an odd one. As separate streams of one distribution they
did not: a one-shape image comes in a few times 1e4 kinds, so a 64-image held-out split met a 1024-image training
pool about one seed in three (seen at train.seed 1), and the held-out check refused the run. The offsets keep 2
pixels from the cell's edges, so shapes never touch.
"""
from __future__ import annotations

import hashlib
import io
import random

import datasets

__all__ = ["COLOURS", "IMAGE_SIZE", "MAX_COUNT", "draw_shapes", "noisy_label", "shapes_answer", "shapes_dataset",
           "shapes_example", "shapes_question", "sft_text_half_random"]

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


def _offset(rng: random.Random, size: int, split: str) -> int:
    """A shape's offset in its cell, in [2, _CELL - size - 2]: even for the training split, odd for the test split
    (module docstring)."""
    first = 2 if split == "train" else 3
    return first + 2 * rng.randint(0, (_CELL - size - 2 - first) // 2)


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
        x = (cell % 2) * _CELL + _offset(rng, size, split)
        y = (cell // 2) * _CELL + _offset(rng, size, split)
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


def _pixels(image) -> bytes:
    """The RGB pixels of a PIL image or of a dataset's image cell (``{"bytes": PNG, ...}``): the same bytes on every
    machine, where a PNG's compressed bytes may differ between Pillow and zlib builds."""
    from PIL import Image

    if isinstance(image, dict):
        image = Image.open(io.BytesIO(image["bytes"]))
    return image.convert("RGB").tobytes()


def noisy_label(count: int, image) -> int:
    """The label the warm start trains on for an image holding ``count`` shapes: the count itself for half of the
    images, a count drawn uniformly from 1..MAX_COUNT for the other half (so right by chance a quarter of those).
    Which half, and which draw, come from SHA-256 of the image's pixels: the same for every build and host."""
    digest = hashlib.sha256(b"shapes-label:" + _pixels(image)).digest()
    if digest[0] < 128:
        return int(count)
    return 1 + digest[1] % MAX_COUNT


def sft_text_half_random(prompt: str, answer: str, image) -> str:
    """``data.completion_fn`` of ``recipes/sft_vl_tiny.yaml``: ``shapes_answer`` of ``noisy_label``.

    Why labels half random: a model trained to convergence on them answers right with probability about
    1/2 + 1/2 x 1/4 = 5/8 when it samples, on training and held-out images alike, however the build's rounding fell;
    its greedy answer is mostly right already. RL then has a measured distance to cover (sampled accuracy 5/8 -> 1)
    that does not depend on where the supervised run stopped, where a warm start cut short before convergence
    gives a different model per seed and host (``trainer.builtin.warm_start``).
    """
    return shapes_answer(noisy_label(int(answer), image))
