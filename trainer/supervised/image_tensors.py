"""A vision-language batch's images through ``transformers.Trainer``: the collator hands the Trainer a dict of
tensors, which it moves to the device; the loss rebuilds the ``VisionBatch`` from it.

Keys: ``pixel_values`` [N, C, H, W], ``images_per_row`` [S] and, when the processor gives one,
``pixel_attention_mask`` [N, H, W]. A text batch adds none.
"""
from __future__ import annotations

import torch

from trainer.vision.batch import VisionBatch


def image_tensors(vision: VisionBatch | None) -> dict:
    """The collator's part of ``vision`` (empty for a text batch)."""
    if vision is None:
        return {}
    out = {"pixel_values": vision.pixel_values, "images_per_row": torch.tensor(vision.per_row, dtype=torch.long)}
    if vision.pixel_attention_mask is not None:
        out["pixel_attention_mask"] = vision.pixel_attention_mask
    return out


def batch_images(inputs: dict, image_token_id: int) -> VisionBatch:
    """The ``VisionBatch`` that ``image_tensors`` put into ``inputs`` (after the Trainer moved it)."""
    return VisionBatch(inputs["pixel_values"], inputs.get("pixel_attention_mask"),
                       [int(n) for n in inputs["images_per_row"].tolist()], image_token_id)
