"""A small random-init vision-language model, built offline: Idefics3 (a SigLIP vision tower, a pixel-shuffle
projector, a Llama decoder) with the tiny byte-level tokenizer and an Idefics3 processor.

Why Idefics3: vLLM 0.32's CPU build serves it without torchvision, which its Qwen2.5-VL and Qwen3-VL processors
import and which PyPI ships only as a CUDA build that does not import beside a CPU torch; and Transformers 5 holds
its processor (no remote code). Its image path has what makes vision-language parity hard elsewhere: a processor
that resizes and normalises on the host, one placeholder expanded into several tokens, a projector between two
models.

Sizes: 56x56 images in 14x14 patches (16 patches), pixel-shuffled by 2 into 4 image tokens; vision hidden 64, 2
layers; the text side the architecture zoo's Llama (hidden 64, 2 layers, 2 heads of 32: a vLLM CPU attention head
size, 1 KV head), so its parity reads beside the zoo's text-only figures (bench/RESULTS.md). One image becomes 7 tokens: ``<fake_token_around_image><global-img>`` + 4 ``<image>`` +
``<fake_token_around_image>``. Image splitting is off (one global view): a 56-pixel image has nothing to split.

Weights are re-drawn at std 0.2 with non-zero biases (``trainer.builtin.zoo``: at std 0.02 the outputs are near
uniform and a numerics bug would be invisible), norms around 1, so images move the log-probs measurably. Untrained:
for the engine/trainer paths of a vision-language model and their parity, not for learning anything.
"""
from __future__ import annotations

import json
from pathlib import Path

from trainer.builtin.tiny import CHAT_TEMPLATE, build_tokenizer, default_cache_dir, file_lock
from trainer.builtin.zoo import INIT_STD

__all__ = ["IMAGE_SIZE", "IMAGE_TOKENS", "VL_MODEL_NAME", "VL_MAX_POSITIONS", "build_vl_model", "ensure_vl_model"]

VL_MODEL_NAME = "builtin:zoo-idefics3"
# it after the warm start recipes/sft_vl_tiny.yaml (trainer.builtin.warm_start): what grpo_vl_tiny.yaml trains
TINY_VL_NAME = "builtin:tiny-vl"
VL_VERSION = 2  # bump when the config, the init or the processor changes: the cache key
IMAGE_SIZE = 56
PATCH_SIZE = 14
SCALE_FACTOR = 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # placeholders per image after pixel shuffle
VL_MAX_POSITIONS = 256
_TEXT_VOCAB = 512  # the tiny tokenizer fills exactly this many ids; the image tokens come after
# what Idefics3Processor writes around an image; <end_of_utterance> it adds itself, unused by the chat template
IMAGE_SPECIALS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>")
# the tiny chat template, with a message's content also a list of parts: {"type": "image"} renders the processor's
# single <image> placeholder (the processor, or vLLM, expands it), {"type": "text"} its text
VL_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}",
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ eos_token }}")


def build_vl_model(seed: int = 0):
    """(model float32, processor) of the tiny Idefics3."""
    import torch
    import transformers

    tok = build_tokenizer(_TEXT_VOCAB, VL_MAX_POSITIONS)
    tok.add_special_tokens({"additional_special_tokens": list(IMAGE_SPECIALS)})
    tok.chat_template = VL_CHAT_TEMPLATE
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    text = dict(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=VL_MAX_POSITIONS,
                rms_norm_eps=1e-5, tie_word_embeddings=False, **ids)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    config = transformers.Idefics3Config(vision_config=vision, text_config=text, scale_factor=SCALE_FACTOR,
                                         image_token_id=tok.convert_tokens_to_ids("<image>"),
                                         tie_word_embeddings=False, **ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Idefics3ForConditionalGeneration(config).float()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(1.0, INIT_STD / 2)
                elif name.endswith("bias"):
                    p.normal_(0.1, INIT_STD / 2)
                else:
                    p.normal_(0.0, INIT_STD)
    model.generation_config = transformers.GenerationConfig(**ids)
    longest = {"longest_edge": IMAGE_SIZE}
    images = transformers.Idefics3ImageProcessorPil(do_image_splitting=False, size=longest, max_image_size=longest)
    processor = transformers.Idefics3Processor(images, tok, image_seq_len=IMAGE_TOKENS, chat_template=VL_CHAT_TEMPLATE)
    return model, processor


def vl_model_dir(cache_dir: str | Path | None = None, dtype: str = "float32") -> Path:
    """Where ``ensure_vl_model`` builds the tiny Idefics3 (built or not)."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return root / f"zoo-vl-v{VL_VERSION}-idefics3-{dtype}"


def ensure_vl_model(cache_dir: str | Path | None = None, dtype: str = "float32") -> Path:
    """Build the tiny Idefics3 once into the cache (weights in ``dtype``, the processor beside them); its directory."""
    import torch

    out = vl_model_dir(cache_dir, dtype)
    root = out.parent
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / ".zoo-vl-idefics3.lock"):
        if (out / "zoo.json").is_file():
            return out
        model, processor = build_vl_model()
        model = model.to(getattr(torch, dtype))
        model.config.dtype = getattr(torch, dtype)
        tmp = out.with_name(out.name + ".tmp")
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        # the class it was built with, by name: Transformers' default for "Idefics3ImageProcessor" is the
        # torchvision build, which without torchvision falls back to this one with a warning on every load
        config = tmp / "processor_config.json"
        saved = json.loads(config.read_text())
        saved["image_processor"]["image_processor_type"] = type(processor.image_processor).__name__
        config.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
        (tmp / "zoo.json").write_text(json.dumps({"arch": "idefics3", "version": VL_VERSION}))
        tmp.rename(out)
    return out
