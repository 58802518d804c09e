"""Input identity of a vision-language batch: for every sample, the prompt the engine consumed is the one the trainer
scores -- the same expanded ids, the same number of images, each image's pixel tensor the same bits and its
placeholder span where the trainer's ids hold it. Checked on every batch before an update uses it; a difference
stops the run with one line naming the sample, the image and the quantity.

Why every batch: the two sides expand and preprocess images with separate code (vLLM's multimodal processor in its
front end, the trainer's Transformers processor), and where they part nothing else fails: a prompt with another
number of image tokens trains on shifted positions, other pixels train on another image (TRL #6401, verl #2996,
vLLM RFC #51472). Cost: a SHA-256 over each image's pixels on each side and a comparison of ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from parity.input_digest import tensor_digest
from trainer.vision.pixels import PromptPixels


class InputsDiffer(RuntimeError):
    """The engine consumed another prompt than the trainer scores (the message names the sample and the quantity)."""


@dataclass(frozen=True)
class TrainerInputs:
    """One prompt as the trainer scores it: its processor's expanded ids and its images' pixels."""

    ids: list[int]
    pixels: PromptPixels


def _first_difference(a: Sequence[int], b: Sequence[int]) -> str:
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    engine = a[at] if at < len(a) else "end"
    trainer = b[at] if at < len(b) else "end"
    return f"first difference at position {at}: engine {engine}, trainer {trainer}"


def _spans(ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(first, last + 1) of each run of ``image_token_id`` in ``ids``."""
    runs, start = [], None
    for i, t in enumerate(list(ids) + [None]):
        if t == image_token_id and start is None:
            start = i
        elif t != image_token_id and start is not None:
            runs.append((start, i))
            start = None
    return runs


def input_differences(rollouts, expected: Sequence[TrainerInputs], image_token_id: int,
                      dtype: torch.dtype) -> list[str]:
    """One line per sample whose consumed prompt differs from ``expected[sample // group_size]`` (the first
    quantity that differs); [] when every sample's inputs are identical. ``dtype``: what the engine ran the pixels in
    (its model dtype), the trainer's pixels are fingerprinted in it."""
    g, problems = rollouts.group_size, []
    digests = [[tensor_digest(e.pixels.image_values(j), dtype) for j in range(e.pixels.count)] for e in expected]
    for s, ids in enumerate(rollouts.prompt_ids):
        i, want = s // g, expected[s // g]
        consumed = rollouts.images[s] if rollouts.images else []
        where = f"sample {s} (prompt {i})"
        if len(consumed) != want.pixels.count:
            problems.append(f"{where}: the engine consumed {len(consumed)} image(s), the trainer's prompt holds "
                            f"{want.pixels.count}")
            continue
        if list(ids) != list(want.ids):
            problems.append(f"{where}: expanded prompt ids differ: engine {len(ids)} ids, trainer's processor "
                            f"{len(want.ids)} ({_first_difference(ids, want.ids)})")
            continue
        spans = _spans(want.ids, image_token_id)
        for j, image in enumerate(consumed):
            if image.digest != digests[i][j]:
                problems.append(f"{where}, image {j}: pixel tensors differ (engine {image.dtype} {list(image.shape)} "
                                f"sha256 {image.digest[:12]}, trainer's {list(want.pixels.image_values(j).shape)} "
                                f"sha256 {digests[i][j][:12]})")
                break
            first, end = spans[j] if j < len(spans) else (-1, -1)
            if not image.offset <= first < end <= image.offset + image.length:
                problems.append(f"{where}, image {j}: the engine's placeholder span [{image.offset}, "
                                f"{image.offset + image.length}) does not hold the trainer's image tokens at "
                                f"[{first}, {end})")
                break
    return problems


def differences_line(problems: Sequence[str]) -> str:
    """``input_differences``' lines in one: the first sample's, and how many more differ ("" for none)."""
    if not problems:
        return ""
    return problems[0] + (f" ({len(problems) - 1} more sample(s) differ)" if len(problems) > 1 else "")


def check_inputs(rollouts, expected: Sequence[TrainerInputs], image_token_id: int, dtype: torch.dtype,
                 step: int) -> dict[str, float]:
    """``{"mm/inputs_equal": 1.0, "mm/images": n}`` when every sample's inputs are identical; else raises
    ``InputsDiffer`` with the first sample's line and how many samples differ."""
    problems = input_differences(rollouts, expected, image_token_id, dtype)
    if problems:
        raise InputsDiffer(f"step {step}: the engine's inputs are not the trainer's: {differences_line(problems)}")
    return {"mm/inputs_equal": 1.0, "mm/images": float(sum(len(x) for x in rollouts.images))}
