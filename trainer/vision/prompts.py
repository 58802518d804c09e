"""A vision-language prompt batch: each row's images read from its image column, its question rendered by the chat
template with one image placeholder per image, and the trainer's own side of it (the processor's expanded ids and
pixels) for the input identity check and the forward.

The engine gets the unexpanded ids (one placeholder per image) and the images, and expands them itself; the trainer
scores the engine's expanded ids (``Rollouts.prompt_ids``) once ``trainer.vision.identity`` has found them equal to
its processor's. A prompt whose text already holds the placeholder is rendered as it is (the images fill its
placeholders in order); any other gets the placeholders before its text, as the chat template's image parts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from trainer.config.schema import RecipeError
from trainer.data.datasets import chat_messages
from trainer.vision.identity import TrainerInputs
from trainer.vision.images import row_images
from trainer.vision.pixels import prompt_pixels
from trainer.vision.support import vision_language_type


@dataclass
class EncodedPrompts:
    """ids: per prompt its unexpanded ids (the engine's input); images: per prompt its images; expected: per prompt
    the trainer's side (``TrainerInputs``)."""

    ids: list[list[int]]
    images: list[list[Any]]
    expected: list[TrainerInputs]


class VisionPrompts:
    """How a run turns vision-language rows into prompts: the model's processor, the recipe's image column, system
    prompt and prompt budget (on the expanded ids: what the context holds)."""

    def __init__(self, processor, image_column: str, *, system_prompt: str | None = None,
                 max_prompt_tokens: int | None = None, max_images: int | None = None,
                 settings: dict | None = None) -> None:
        self.processor = processor
        # data.image_processor: passed to every processor call, as vLLM passes its mm_processor_kwargs to its own
        self.settings = dict(settings or {})
        self.tokenizer = processor.tokenizer
        self.image_column = image_column
        self.system_prompt = system_prompt
        self.max_prompt_tokens = max_prompt_tokens
        self.max_images = max_images
        self.placeholder = str(processor.image_token)
        self.image_token_id = int(processor.image_token_id)

    def render(self, prompt: str, count: int) -> str:
        """The chat template's text of ``prompt`` with ``count`` images (placeholders before the text, unless it
        holds them)."""
        messages = chat_messages(self.tokenizer, prompt, self.system_prompt)
        if count and self.placeholder not in prompt:
            messages[-1] = {"role": "user", "content": [{"type": "image"}] * count + [{"type": "text", "text": prompt}]}
        return self.processor.apply_chat_template(messages, add_generation_prompt=True)

    def encode(self, rows: Sequence[dict], first_row: int = 0) -> EncodedPrompts:
        """``rows`` (each with ``prompt`` and the image column) as prompts; ``first_row``: the index of ``rows[0]``
        in the data, for the errors. Raises ValueError naming the row whose placeholders and images disagree, or
        whose expanded prompt exceeds the budget."""
        ids, images, expected = [], [], []
        for k, row in enumerate(rows):
            where = f"row {first_row + k}"
            if self.image_column not in row:
                raise ValueError(f"{where}: no column {self.image_column!r} (data.image_column); the rows hold "
                                 f"{sorted(row)}")
            imgs = row_images(row[self.image_column], self.image_column, first_row + k)
            if self.max_images is not None and len(imgs) > self.max_images:
                raise ValueError(f"{where}: {len(imgs)} images, more than data.max_images_per_prompt = "
                                 f"{self.max_images}")
            text = self.render(row["prompt"], len(imgs))
            raw = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            holders = raw.count(self.image_token_id)
            if holders != len(imgs):
                raise ValueError(f"{where}: its prompt holds {holders} image placeholder(s) ({self.placeholder!r}) "
                                 f"for {len(imgs)} image(s) in data.image_column {self.image_column!r}")
            full = list(self.processor(text=[text], images=[imgs] if imgs else None,
                                       **(self.settings if imgs else {}))["input_ids"][0])
            if self.max_prompt_tokens is not None and len(full) > self.max_prompt_tokens:
                raise ValueError(f"{where}: its prompt is {len(full)} tokens with its {len(imgs)} image(s) expanded, "
                                 f"more than data.max_prompt_tokens = {self.max_prompt_tokens}")
            ids.append(list(raw))
            images.append(imgs)
            expected.append(TrainerInputs(ids=full, pixels=prompt_pixels(self.processor.image_processor, imgs,
                                                                         self.settings)))
        return EncodedPrompts(ids, images, expected)


def check_prompt_rows(vision: VisionPrompts, rows, where: str) -> None:
    """Every row of ``rows`` encoded as a batch will be, before the engine starts: a row whose placeholders and
    images disagree, with too many images, or whose expanded prompt exceeds the budget is refused (RecipeError)
    naming it, instead of stopping a run in its middle."""
    for i in range(len(rows)):
        try:
            vision.encode([rows[i]], first_row=i)
        except ValueError as e:
            raise RecipeError(f"{where}: {e}") from None


def vision_prompts(cfg, model_dir: str) -> VisionPrompts | None:
    """The run's ``VisionPrompts`` when the recipe names an image column (checked against the model: a
    vision-language one), None for text prompts. Before the model loads: the processor alone is read."""
    from transformers import AutoConfig, AutoProcessor

    column = cfg.data.image_column
    if column is None:
        return None
    model_type = AutoConfig.from_pretrained(model_dir).model_type
    if not vision_language_type(model_type):
        raise RecipeError(f"data.image_column = {column!r}: model.path {cfg.model.path!r} is a text-only model "
                          f"(model_type {model_type!r}); images need a vision-language model (docs/vision-language.md)")
    processor = AutoProcessor.from_pretrained(model_dir)
    settings = cfg.data.image_processor or {}
    unknown = [k for k in settings if not hasattr(processor.image_processor, k)]
    if unknown:
        ip = processor.image_processor
        known = sorted(k for k in dir(ip) if not k.startswith("_") and isinstance(
            getattr(ip, k, None), (bool, int, float, str, dict, list, tuple, type(None))))
        raise RecipeError(f"data.image_processor.{unknown[0]}: not a setting of {model_dir}'s image processor "
                          f"({type(processor.image_processor).__name__}); its settings: {', '.join(known)}")
    return VisionPrompts(processor, column, system_prompt=cfg.data.system_prompt,
                         max_prompt_tokens=cfg.data.max_prompt_tokens, max_images=cfg.data.max_images_per_prompt,
                         settings=settings)
