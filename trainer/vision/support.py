"""Which vision-language models parityrl trains: by ``model_type``, known from config.json before anything loads."""
from __future__ import annotations

from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

# model_type -> the backbone class whose image features ``trainer.vision.embeddings`` merges: one global view per
# image, 1-D RoPE positions, features from ``get_image_features(pixel_values, pixel_attention_mask)``. Qwen-VL
# (M-RoPE position ids, an image grid beside the pixels) is not among them yet (docs/vision-language.md).
SUPPORTED = {"idefics3": "Idefics3Model", "smolvlm": "SmolVLMModel"}


def vision_language_type(model_type: str) -> bool:
    """A model_type Transformers builds as an image-text-to-text model and not as a causal LM."""
    return model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def auto_model_class(model_type: str):
    """The Transformers auto class that builds ``model_type``: image-text-to-text for a vision-language model, else
    the causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if vision_language_type(model_type) else AutoModelForCausalLM


def vision_language_problem(model_type: str) -> str | None:
    """Why a vision-language ``model_type`` cannot be trained here, or None when it can (or is not one)."""
    if not vision_language_type(model_type) or model_type in SUPPORTED:
        return None
    return (f"config.json: model_type {model_type!r} is a vision-language model parityrl does not train yet; "
            f"supported: {', '.join(sorted(SUPPORTED))} (docs/vision-language.md)")
