"""The images of a token batch: their pixel tensors in row order, and how many belong to each row.

A row's images fill, in order, the image placeholder positions of its prompt (``image_token_id`` in the prompt
columns, which the engine expanded). The completion columns are never image slots: a policy can sample the
placeholder id, which the engine then embeds as text (``trainer.vision.embeddings``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VisionBatch:
    """pixel_values: [N, C, H, W] every row's images, row after row (N = sum of ``per_row``; an image split into
    crops is several of them, ``trainer.vision.pixels``); pixel_attention_mask: [N, H, W] 1 on real pixels (None: all
    real); per_row: [S] tensors of each row (the vision tower's inputs, whose features fill its placeholders in order);
    image_token_id: the placeholder id the prompts hold, one per image token."""

    pixel_values: torch.Tensor
    pixel_attention_mask: torch.Tensor | None
    per_row: list[int]
    image_token_id: int

    def __post_init__(self) -> None:
        if sum(self.per_row) != self.pixel_values.shape[0]:
            raise ValueError(f"VisionBatch: {self.pixel_values.shape[0]} images for rows holding {sum(self.per_row)} "
                             f"({self.per_row})")

    def select(self, idx) -> "VisionBatch":
        """The images of rows ``idx`` (a slice, or row indices), in that order."""
        rows = range(len(self.per_row))[idx] if isinstance(idx, slice) else [int(i) for i in idx]
        starts = [0]
        for n in self.per_row:
            starts.append(starts[-1] + n)
        picked = [j for r in rows for j in range(starts[r], starts[r + 1])]
        at = torch.tensor(picked, dtype=torch.long)
        return VisionBatch(self.pixel_values[at], None if self.pixel_attention_mask is None else
                           self.pixel_attention_mask[at], [self.per_row[r] for r in rows], self.image_token_id)

    def to(self, device) -> "VisionBatch":
        mask = None if self.pixel_attention_mask is None else self.pixel_attention_mask.to(device)
        return VisionBatch(self.pixel_values.to(device), mask, self.per_row, self.image_token_id)
