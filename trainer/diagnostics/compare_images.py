"""`parityrl compare --image-column COLUMN`: a vision-language model's prompts run with their images on both sides,
as a training step runs them (trainer/vision/).

The engine gets each prompt's unexpanded ids (one placeholder per image, ``trainer.vision.prompts``) and its images,
and expands them itself; before anything is scored, every sample's expanded ids, image count, pixel fingerprints and
placeholder spans are checked against the trainer's processor's (``trainer.vision.identity``: the check a training
step makes). The trainer then scores the engine's expanded ids with its processor's pixel tensors at the
placeholders. Why the check comes first: where the two sides' inputs part, the log-prob gap measures other prompts,
not the numerics, so a difference stops compare (``InputsDiffer``) naming the sample, the image and the quantity.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from rollout.hf_engine import HFEngine
from rollout.types import Rollouts
from rollout.vllm_engine import image_options
from trainer.diagnostics.compare_inputs import CompareError, load_image_column
from trainer.distributed.data_parallel import DataParallel
from trainer.vision.batch import VisionBatch
from trainer.vision.identity import InputsDiffer, differences_line, input_differences
from trainer.vision.parity import image_split_metrics
from trainer.vision.pixels import samples_vision_batch
from trainer.vision.prompts import EncodedPrompts, VisionPrompts
from trainer.vision.support import vision_language_type


def refuse_settings(*, engine, adapter, use_chat_template: Optional[bool]) -> None:
    """CompareError for the settings images cannot run with, before anything loads."""
    if engine == "hf" or isinstance(engine, HFEngine):
        raise CompareError("engine = 'hf' with image_column: the HF engine takes no images; expected the vLLM engine "
                           "(--engine vllm), which a vision-language run uses")
    if adapter is not None:
        raise CompareError("adapter with image_column: not built yet (the adapter's two modes run text prompts); "
                           "expected one of them")
    if use_chat_template is False:
        raise CompareError("use_chat_template = False with image_column: a prompt's images are parts of the chat "
                           "template's user turn; expected the template (--chat-template auto or on)")


@dataclass
class CompareImages:
    """A comparison's prompts with their images: ``vision`` how they were rendered (the model's processor),
    ``encoded`` the engine's unexpanded ids and images and the trainer's side of each prompt."""

    vision: VisionPrompts
    encoded: EncodedPrompts
    column: str

    @property
    def expanded_ids(self) -> list[list[int]]:
        """Per prompt, its ids with each image's placeholder expanded (what the context holds)."""
        return [e.ids for e in self.encoded.expected]

    def engine_options(self) -> dict:
        """The options an engine started for these prompts needs (room for the most images a prompt holds)."""
        return image_options(max(1, max(len(x) for x in self.encoded.images)))

    def check(self, rollouts: Rollouts, dtype: torch.dtype) -> None:
        """Raises ``InputsDiffer`` unless every sample's consumed prompt is the trainer's (``dtype``: the engine's
        model dtype, which its pixels ran in)."""
        problems = input_differences(rollouts, self.encoded.expected, self.vision.image_token_id, dtype)
        if problems:
            raise InputsDiffer(f"the engine's inputs are not the trainer's: {differences_line(problems)}")

    def vision_batch(self, rollouts: Rollouts, device) -> VisionBatch:
        """The trainer's pixel tensors of every sample, row by row (sample s answers prompt s // n)."""
        pixels = [e.pixels for e in self.encoded.expected]
        return samples_vision_batch(pixels, rollouts.group_size, len(rollouts), self.vision.image_token_id).to(device)

    def summary(self, rollouts: Rollouts, vision: VisionBatch, lp_t, lp_r, mask) -> tuple[str, dict]:
        """The summary's ``vision_language`` line and its ``images`` section: the counts, the inputs' verdict, and
        the parity of the samples with images apart from those without (``trainer.vision.parity``)."""
        held = [len(x) for x in self.encoded.images]
        with_images, images = sum(1 for n in held if n), sum(held)
        line = (f"prompts run with their images on both sides: {with_images} of {len(held)} prompts held {images} "
                f"image(s); every sample's expanded ids, image count, pixel fingerprints and placeholder spans "
                f"checked identical to the trainer's processor's ({len(rollouts)} samples); the trainer's forward "
                f"ran the pixel tensors")
        split = image_split_metrics(DataParallel(), lp_t, lp_r, mask, vision.per_row)
        return line, {"column": self.column, "prompts_with_images": with_images, "images": images,
                      "samples_checked": len(rollouts), "inputs_equal": True, **split}


def prompts_with_images(model_dir: str, prompts: list[str], prompts_path: str | Path, *,
                        image_column: str, prompt_column: str, num_prompts: Optional[int],
                        system_prompt: Optional[str], max_prompt_tokens: Optional[int]) -> CompareImages:
    """``prompts`` with their images from ``image_column``, rendered as training renders them; CompareError for a
    text-only model, a missing column, or a row whose images cannot be read or whose expanded prompt is too long."""
    from transformers import AutoConfig, AutoProcessor

    model_type = AutoConfig.from_pretrained(model_dir).model_type
    if not vision_language_type(model_type):
        raise CompareError(f"image_column = {image_column!r}: {model_dir!r} is a text-only model (model_type "
                           f"{model_type!r}); images need a vision-language model (docs/vision-language.md)")
    values = load_image_column(prompts_path, image_column=image_column, prompt_column=prompt_column,
                               num_prompts=num_prompts)
    vision = VisionPrompts(AutoProcessor.from_pretrained(model_dir), image_column, system_prompt=system_prompt,
                           max_prompt_tokens=max_prompt_tokens)
    try:
        encoded = vision.encode([{"prompt": p, image_column: v} for p, v in zip(prompts, values)])
    except ValueError as e:
        raise CompareError(f"prompts file {str(prompts_path)!r}: {e}") from None
    return CompareImages(vision, encoded, image_column)
