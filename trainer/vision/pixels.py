"""The trainer's pixels of a batch: each prompt's images through the model's image processor, laid out per row as a
``VisionBatch``.

Each prompt's images are processed on their own (a batch of one row), so a prompt's pixels do not depend on which
prompts share its batch (an image processor pads a batch to its largest image and count). A group's samples share
their prompt's tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from trainer.vision.batch import VisionBatch


@dataclass(frozen=True)
class PromptPixels:
    """One prompt's images as the trainer runs them: pixel_values [v, C, H, W], pixel_attention_mask [v, H, W] or
    None, where v is the number of views (v = 0: a text-only prompt). ``views``: per image, how many of the tensors
    are its own, in order (an image split into crops: its crops, then its global view); None: one view per image."""

    values: torch.Tensor
    mask: torch.Tensor | None
    views: tuple[int, ...] | None = None

    @property
    def num_views(self) -> int:
        """The tensors [v] the vision tower runs: each image's views, image after image."""
        return int(self.values.shape[0]) if self.values.dim() > 1 else 0

    @property
    def count(self) -> int:
        """The images (what the prompt's placeholders and the engine's request count)."""
        return len(self.views) if self.views is not None else self.num_views

    def image_values(self, j: int) -> torch.Tensor:
        """Image ``j``'s views [its views, C, H, W]: what the engine runs for it, as one tensor."""
        per = self.views if self.views is not None else (1,) * self.num_views
        start = sum(per[:j])
        return self.values[start:start + per[j]]


def prompt_pixels(image_processor, images: Sequence[Any], settings: dict | None = None) -> PromptPixels:
    """``images`` (one prompt's, in placeholder order) through ``image_processor``, with the run's settings
    (``data.image_processor``)."""
    if not images:
        return PromptPixels(torch.zeros(0), None)
    # an image processor that splits images (Idefics3, SmolVLM) says each image's grid of crops when asked: its views
    # are then rows x cols crops and the global view, or the global view alone (a grid of 0)
    grid = {"return_row_col_info": True} if hasattr(image_processor, "return_row_col_info") else {}
    out = image_processor([list(images)], return_tensors="pt", **grid, **(settings or {}))
    mask = out.get("pixel_attention_mask")
    views = None
    if "rows" in out and "cols" in out:
        views = tuple(r * c + 1 if r * c else 1 for r, c in zip(out["rows"][0], out["cols"][0]))
    return PromptPixels(out["pixel_values"][0], None if mask is None else mask[0], views)


def vision_batch(rows: Sequence[PromptPixels], image_token_id: int) -> VisionBatch:
    """The ``VisionBatch`` of rows whose pixels are ``rows`` (a group's samples repeat their prompt's)."""
    held = [r for r in rows if r.count]
    if not held:
        return VisionBatch(torch.zeros(0), None, [0] * len(rows), image_token_id)
    if len({r.mask is None for r in held}) > 1:
        raise ValueError("vision_batch: the image processor returned a pixel mask for some prompts only")
    sizes = sorted({tuple(r.values.shape[1:]) for r in held})
    if len(sizes) > 1:
        raise ValueError(f"vision_batch: prompts' images were resized to different sizes {sizes}; parityrl batches "
                         "images of one size")
    mask = None if held[0].mask is None else torch.cat([r.mask for r in held])
    return VisionBatch(torch.cat([r.values for r in held]), mask, [r.num_views for r in rows], image_token_id)


def samples_vision_batch(pixels: Sequence[PromptPixels], group_size: int, num_samples: int,
                         image_token_id: int) -> VisionBatch:
    """The ``VisionBatch`` of a rollout batch's ``num_samples`` samples, sample s answering prompt s // group_size
    (``pixels``: per prompt)."""
    return vision_batch([pixels[s // group_size] for s in range(num_samples)], image_token_id)
