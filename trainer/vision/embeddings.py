"""The decoder's input embeddings of a vision-language batch: token embeddings, with the image features written
into the prompt's placeholder positions, and nowhere else.

Why not the model's own merge (Transformers' ``inputs_merger``): it scatters image features into every position
holding the placeholder id, completions included. A policy can sample that id (a random-init one does, often); vLLM
embeds a sampled id as text, since only the prompt's placeholder ranges are image positions there. Merging by id would
score another sequence than the engine sampled, or fail outright (more positions than features). Here the slots are
the placeholder ids in the prompt columns only.
"""
from __future__ import annotations

import torch

from trainer.vision.batch import VisionBatch
from trainer.vision.support import SUPPORTED


def image_slots(input_ids: torch.Tensor, prompt_len: int, image_token_id: int) -> torch.Tensor:
    """[S, T] bool: the prompt's placeholder positions (columns before ``prompt_len`` holding ``image_token_id``)."""
    prompt = torch.arange(input_ids.shape[1], device=input_ids.device) < prompt_len
    return (input_ids == image_token_id) & prompt


def image_features(backbone, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """[N, tokens, hidden]: each of the N images [N, C, H, W] through ``backbone``'s vision tower and projector, in
    ``dtype``; the trainer's image features wherever it needs them (the forward, ``parityrl doctor``'s images check)."""
    mask = None if pixel_attention_mask is None else pixel_attention_mask[None]
    return backbone.get_image_features(pixel_values[None].to(dtype), mask, return_dict=True).pooler_output


def merged_embeddings(backbone, input_ids: torch.Tensor, prompt_len: int, vision: VisionBatch) -> torch.Tensor:
    """[S, T, H] the decoder's input: ``backbone``'s token embeddings with each row's images' features in its prompt's
    placeholder positions, in order. Raises ValueError naming the row whose placeholders and images disagree."""
    name = type(backbone).__name__
    if name not in SUPPORTED.values():
        # each supported backbone's get_image_features(pixel_values [B, N, C, H, W], pixel_attention_mask) returns
        # every image's projected features as pooler_output [N, tokens, hidden], in placeholder order
        raise TypeError(f"{name}: parityrl merges image features for {', '.join(SUPPORTED.values())} backbones only")
    embeds = backbone.get_input_embeddings()(input_ids)
    if not vision.per_row or not sum(vision.per_row):
        return embeds
    slots = image_slots(input_ids, prompt_len, vision.image_token_id)
    feats = image_features(backbone, vision.pixel_values, vision.pixel_attention_mask, embeds.dtype)
    per_image = feats.shape[1]
    for row, (n_slots, n_images) in enumerate(zip(slots.sum(1).tolist(), vision.per_row)):
        if n_slots != n_images * per_image:
            raise ValueError(f"row {row}: its prompt holds {n_slots} image placeholder positions for {n_images} "
                             f"image(s) of {per_image} tokens each (expected {n_images * per_image})")
    # row-major slots take the images row after row, each image's tokens in order
    return embeds.masked_scatter(slots[..., None], feats.reshape(-1, feats.shape[-1]).to(embeds.dtype))
