"""``parity/images/*`` and ``parity/text/*``: a vision-language batch's parity apart for the samples whose prompt
holds images and those whose prompt holds none, pooled over every rank.

Why apart: an image adds a path the text-only samples do not take (the vision tower, the projector, the features
written at the placeholders), so a mismatch of the image path shows as the images' level leaving the text's, which
the batch's mean dilutes in proportion to the text-only share.
"""
from __future__ import annotations

import torch


def image_split_metrics(dp, train: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, per_row: list[int]) -> dict:
    """The parity measures of the rows with images (``per_row[i]`` > 0) and of the rest, each where it has tokens."""
    with_images = torch.tensor([n > 0 for n in per_row], dtype=mask.dtype, device=mask.device)[:, None]
    out = {}
    for prefix, rows in (("parity/images/", with_images), ("parity/text/", 1 - with_images)):
        part = dp.pooled_parity(train, engine, mask * rows, prefix=prefix)
        out.update(part if part[prefix + "num_tokens"] else {prefix + "num_tokens": 0.0})
    return out
