"""Parity on a vision-language model: the vLLM engine against Transformers' forward, prompts with and without images.

The tiny Idefics3 of ``trainer.builtin.zoo_vl`` (random init, std 0.2) in one in-process vLLM engine per dtype samples
``--n`` completions of ``--tokens`` tokens for ``--prompts`` shapes-task prompts with their image
(``trainer.data.tasks.shapes``) and as many text-only prompts (seeded, temperature 1). The prompts go to vLLM as token
ids with one ``<image>`` placeholder per image and the image itself (``VLLMEngine.generate(..., images=)``); vLLM's
processor expands the placeholder. Transformers' processor expands the same prompt text with the same image; the two
expanded id sequences must be equal, and the pixels Transformers scores with are its processor's.

Printed per dtype: the expanded prompt ids equal or not, then the mean |engine - trainer| of the sampled tokens'
log-probs (temperature 1; the trainer's: the token batch of the engine's expanded ids, the images through the
trainer's processor, ``completion_logprobs`` with the image features at the placeholders, ``trainer.vision``) over the
prompts with images and over those without. ``--json`` writes the same.

    PYTHONPATH=. .venv/bin/python bench/parity/vl_parity.py --dtypes float32 bfloat16

Engines start one after another in this process: run it as its own process.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def _prompts(processor, count: int):
    """(texts, images per prompt, answers): ``count`` shapes prompts with their image, then ``count`` text-only."""
    from trainer.data.tasks.shapes import shapes_example, shapes_question

    texts, images = [], []
    for i in range(count):
        ex = shapes_example(i, split="test")
        texts.append(processor.apply_chat_template(shapes_question(), add_generation_prompt=True))
        images.append([ex["image"]])
    for i in range(count):
        question = [{"role": "user", "content": f"Is {i + 3} more than {2 * i}?"}]
        texts.append(processor.apply_chat_template(question, add_generation_prompt=True))
        images.append([])
    return texts, images


def trainer_inputs(processor, texts, images):
    """Each prompt as the trainer scores it: its processor's expanded ids and its images' pixels."""
    from trainer.vision.identity import TrainerInputs
    from trainer.vision.pixels import prompt_pixels

    return [TrainerInputs(ids=list(processor(text=[t], images=[im] if im else None)["input_ids"][0]),
                          pixels=prompt_pixels(processor.image_processor, im)) for t, im in zip(texts, images)]


def planted_faults(engine, path, processor, texts, ids, images, dtype) -> dict:
    """The identity check's first line for each planted fault: the trainer's processor resizing to 42 pixels; the
    engine's request without its image (the placeholder stays, as text)."""
    from transformers import AutoProcessor

    from rollout.types import SamplingSpec
    from trainer.vision.identity import input_differences

    spec = SamplingSpec(n=1, temperature=1.0, max_new_tokens=2, seed=0)
    r = engine.generate(ids[:1], spec, images=images[:1])
    small = AutoProcessor.from_pretrained(path)
    small.image_processor.size = {"longest_edge": 42}
    small.image_processor.max_image_size = {"longest_edge": 42}
    other = input_differences(r, trainer_inputs(small, texts[:1], images[:1]), processor.image_token_id, dtype)
    dropped = engine.generate(ids[:1], spec, images=[[]])
    missing = input_differences(dropped, trainer_inputs(processor, texts[:1], images[:1]), processor.image_token_id,
                                dtype)
    return {"other_processor": other[:1], "image_dropped": missing[:1]}


def run(dtype: str, prompts: int, n: int, tokens: int, faults: bool = False) -> dict:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from rollout.types import SamplingSpec
    from rollout.vllm_engine import VLLMEngine, image_options
    from trainer.builtin.zoo_vl import ensure_vl_model
    from trainer.models.batch import batch_from_rollouts
    from trainer.models.policy import completion_logprobs
    from trainer.vision.identity import check_inputs
    from trainer.vision.pixels import vision_batch

    path = str(ensure_vl_model(dtype="float32"))
    processor = AutoProcessor.from_pretrained(path)
    texts, images = _prompts(processor, prompts)
    ids = [processor.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    engine = VLLMEngine(path, dtype=dtype, max_model_len=128, seed=0, kv_cache_memory_bytes=64 * 1024**2,
                        **image_options(1))
    try:
        r = engine.generate(ids, SamplingSpec(n=n, temperature=1.0, max_new_tokens=tokens, seed=0), images=images)
        planted = planted_faults(engine, path, processor, texts, ids, images, getattr(torch, dtype)) if faults else {}
    finally:
        engine.close()
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    # the trainer's side: its processor's ids and pixels, checked against what the engine consumed, then scored: the
    # token batch of the engine's expanded ids, the fused log-prob kernel with the features at the placeholders
    t0 = time.perf_counter()
    expected = trainer_inputs(processor, texts, images)
    t1 = time.perf_counter()
    identity = check_inputs(r, expected, processor.image_token_id, getattr(torch, dtype), step=1)
    t2 = time.perf_counter()
    batch = batch_from_rollouts(r, pad_id=processor.tokenizer.pad_token_id)
    batch.vision = vision_batch([expected[s // n].pixels for s in range(len(r.prompt_ids))],
                                model.config.image_token_id)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, batch, temperature=1.0)
    t3 = time.perf_counter()
    diff = ((lp - batch.rollout_logprobs).abs() * batch.mask)
    errors = {"image": [], "text": []}
    for s in range(len(r.prompt_ids)):
        errors["image" if images[s // n] else "text"] += diff[s][batch.mask[s] > 0].tolist()
    return {"dtype": dtype, **identity, "expanded_ids_equal": all(list(p) == expected[s // n].ids
                                                                   for s, p in enumerate(r.prompt_ids)),
            "prompt_tokens_with_image": len(r.prompt_ids[0]), "prompt_tokens_before_expansion": len(ids[0]),
            "prompt_tokens_text_only": len(ids[prompts]),
            "trainer_processing_s": t1 - t0, "identity_check_s": t2 - t1, "scoring_s": t3 - t2,
            **{f"mae_{k}": sum(v) / len(v) for k, v in errors.items()},
            **{f"max_{k}": max(v) for k, v in errors.items()}, **{f"tokens_{k}": len(v) for k, v in errors.items()},
            **({"faults": planted} if faults else {})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--faults", action="store_true", help="also plant the identity check's faults (one engine call "
                    "each) and print the line each one stops with")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for dtype in args.dtypes:
        row = run(dtype, args.prompts, args.n, args.tokens, args.faults)
        rows.append(row)
        print(f"{dtype:9s} expanded ids equal: {row['expanded_ids_equal']} (prompt with image "
              f"{row['prompt_tokens_before_expansion']} -> {row['prompt_tokens_with_image']} tokens, text-only {row['prompt_tokens_text_only']}); engine vs trainer "
              f"MAE with image {row['mae_image']:.3g} ({row['tokens_image']} tokens, max {row['max_image']:.3g}), "
              f"without {row['mae_text']:.3g} ({row['tokens_text']} tokens, max {row['max_text']:.3g})", flush=True)
        print(f"{'':9s} mm/inputs_equal {row['mm/inputs_equal']} over {row['mm/images']:.0f} images; identity check "
              f"{row['identity_check_s'] * 1e3:.2f} ms, the trainer's processing {row['trainer_processing_s'] * 1e3:.1f} "
              f"ms, scoring {row['scoring_s'] * 1e3:.1f} ms", flush=True)
        for name, lines in row.get("faults", {}).items():
            print(f"{'':9s} planted {name}: {lines[0] if lines else 'NOT CAUGHT'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
