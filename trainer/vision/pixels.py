"""The trainer's pixels of a batch: each row's images through the model's image processor, laid out as a
``VisionBatch``.

Each row's images are processed on their own (a list of one row), so a row's pixels do not depend on which rows
share its batch (an image processor pads a batch to its largest image and count).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from trainer.vision.batch import VisionBatch


def row_pixels(image_processor, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(pixel_values [n, C, H, W], pixel_attention_mask [n, H, W] or None) of one row's ``images``."""
    out = image_processor([list(images)], return_tensors="pt")
    values = out["pixel_values"][0]
    mask = out.get("pixel_attention_mask")
    return values, None if mask is None else mask[0]


def vision_batch(image_processor, images_per_row: Sequence[Sequence[Any]], image_token_id: int) -> VisionBatch:
    """The ``VisionBatch`` of rows whose images are ``images_per_row`` (an empty list: a text-only row)."""
    values, masks = [], []
    for images in images_per_row:
        if images:
            v, m = row_pixels(image_processor, images)
            values.append(v)
            masks.append(m)
    if not values:
        return VisionBatch(torch.zeros(0), None, [0] * len(images_per_row), image_token_id)
    if any(m is None for m in masks) and not all(m is None for m in masks):
        raise ValueError("vision_batch: the image processor returned a pixel mask for some rows only")
    if len({tuple(v.shape[1:]) for v in values}) > 1:
        raise ValueError(f"vision_batch: rows' images were resized to different sizes {sorted({tuple(v.shape[1:]) for v in values})}; "
                         "parityrl batches images of one size")
    mask = None if masks[0] is None else torch.cat(masks)
    return VisionBatch(torch.cat(values), mask, [len(x) for x in images_per_row], image_token_id)
