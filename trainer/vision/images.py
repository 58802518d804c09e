"""A dataset row's images, from what its image column holds: a PIL image, a file path, encoded bytes, a Hugging Face
``datasets.Image`` value (``{"bytes", "path"}``), or a list of those (several images, in placeholder order).

Every image is read whole and converted to RGB here, once, so the engine and the trainer get the same decoded
pixels: a lazily decoded file or an image in another mode would be decoded again by each side's processor.
"""
from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any


def _one(value: Any, where: str):
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, dict) and ("bytes" in value or "path" in value):
        return _one(value.get("bytes") or value.get("path"), where)
    elif isinstance(value, (bytes, bytearray)):
        try:
            image = Image.open(io.BytesIO(value))
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"{where}: the bytes are not an image Pillow reads ({e})") from None
    elif isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"{where}: image file {str(path)!r} does not exist")
        try:
            image = Image.open(path)
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"{where}: {str(path)!r} is not an image Pillow reads ({e})") from None
    else:
        raise ValueError(f"{where}: {type(value).__name__} is not an image (expected a PIL image, a file path, "
                         "encoded bytes, or a list of those)")
    image.load()
    return image if image.mode == "RGB" else image.convert("RGB")


def row_images(value: Any, column: str, row: int) -> list:
    """The images of ``row`` (its ``column`` value) as RGB PIL images, in order; [] for None or an empty list."""
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    return [_one(v, f"data.image_column {column!r}, row {row}" + (f", image {j}" if len(values) > 1 else ""))
            for j, v in enumerate(values)]


def image_column_problems(rows, column: str, limit: int = 3) -> list[str]:
    """The first ``limit`` rows of ``rows`` (a dataset) whose ``column`` holds something that is not an image, one
    line each; every image is decoded."""
    problems = []
    for i, row in enumerate(rows):
        try:
            row_images(row[column], column, i)
        except ValueError as e:
            problems.append(str(e))
            if len(problems) >= limit:
                break
    return problems


def prompt_identity(row: dict, image_column: str | None, index: int = 0) -> tuple:
    """What makes two rows the same prompt: the text, and with images their pixels (decoded, as RGB): one question
    asked of several images (the shapes task's) is several prompts."""
    if image_column is None:
        return (row["prompt"],)
    images = row_images(row.get(image_column), image_column, index)
    return (row["prompt"], *(hashlib.sha256(im.tobytes() + repr(im.size).encode()).hexdigest() for im in images))
