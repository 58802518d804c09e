"""Rows of bench/gpu/gpu_check.py that train or run the trainer on the Qwen2.5-0.5B-shaped model (``QWEN05_SHAPE``).

- ``grpo_steps`` (CUDA): ``parityrl train recipes/grpo_tiny.yaml`` for ``--steps`` steps with ``rollout.engine=hf``,
  LoRA r 32: step time and ``perf/peak_memory_gb``;
- ``checkpointing_memory`` (CUDA): one LoRA forward + backward of 8 x 2048 tokens with and without
  ``train.gradient_checkpointing``: peak extra memory of each (``torch.cuda``'s allocator statistics) and the
  step-time cost; passes when checkpointing lowers the peak;
- ``precision_step`` (CUDA and vLLM's CUDA build): one step of ``grpo_tiny`` for a precision recipe
  (trainer/precision/registry.py; model.dtype the recipe's first), the FP8 recipes on the shaped model (vLLM's
  block-FP8 layers refuse the tiny model's shapes), the others on the tiny model: engine start, sleep / wake, weight
  sync, the probe and the step's parity; a recipe that refuses the machine it runs on at load (exit 2) is skipped
  with its reason.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from gpu_rows_common import Skip, need_cuda, need_vllm_cuda, tail, train

from trainer.precision.registry import recipe_for


def grpo_steps(model_dir: Path, steps: int) -> str:
    with tempfile.TemporaryDirectory(prefix="gpu_check_grpo_") as tmp:
        proc, rows = train("grpo_tiny.yaml", [f"model.path={model_dir}", "rollout.engine=hf", "eval.every=0",
                                              f"train.steps={steps}", "model.lora.r=32", "model.lora.alpha=64",
                                              "rollout.max_new_tokens=128", "train.micro_batch_size=32"],
                           Path(tmp), cap_s=600)
    if proc.returncode != 0 or len(rows) < steps:
        raise AssertionError(f"exit {proc.returncode}, {len(rows)}/{steps} steps: {tail(proc)}")
    step_s = statistics.median(r["perf/step_s"] for r in rows[1:] or rows)  # the first step warms up
    peak = max(r.get("perf/peak_memory_gb") or 0.0 for r in rows)
    return (f"Qwen2.5-0.5B shape, LoRA r 32, 128 samples x <=128 tokens: {len(rows)} steps, "
            f"median step {step_s:.1f} s (after the first), peak {peak:.1f} GiB")


def checkpointing_memory(model_dir: Path, rows: int = 8, tokens: int = 2048) -> str:
    """Peak extra memory of one LoRA forward + backward without and with gradient checkpointing."""
    device = need_cuda()
    # late: Transformers and PEFT take seconds to import; only a GPU runs this row
    from trainer.config.schema import LoraConfig
    from trainer.models.batch import build_token_batch
    from trainer.models.checkpointing import enable_gradient_checkpointing, hf_model
    from trainer.models.policy import add_lora, completion_logprobs, load_base_model

    policy = add_lora(load_base_model(str(model_dir), "bfloat16", device), LoraConfig(r=32, alpha=64)).train()
    g = torch.Generator().manual_seed(0)
    prompt = 64
    ids = lambda n: torch.randint(3, 512, (n,), generator=g).tolist()  # noqa: E731
    batch = build_token_batch([ids(prompt) for _ in range(rows)], [ids(tokens - prompt) for _ in range(rows)], pad_id=0,
                              device=device)
    out = {}
    for on in (False, True):
        if on:
            enable_gradient_checkpointing(policy)
        else:
            hf_model(policy).gradient_checkpointing_disable()
        times = []
        try:
            for _ in range(3):  # the first call warms up; peak from the last
                policy.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                t0 = time.perf_counter()
                lp, _ = completion_logprobs(policy, batch, temperature=1.0)
                (-(lp * batch.mask).sum() / batch.mask.sum()).backward()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                del lp
            out[on] = (peak, statistics.median(times[1:]))
        except torch.OutOfMemoryError:
            out[on] = None
            torch.cuda.empty_cache()
    label = f"{rows} x {tokens} tokens, LoRA r 32"
    if out[True] is None:
        raise AssertionError(f"{label}: out of memory with checkpointing")
    on_gb, on_s = out[True]
    if out[False] is None:
        return f"{label}: without OOM, with {on_gb:.1f} GiB ({on_s:.2f} s)"
    off_gb, off_s = out[False]
    figure = f"{label}: {off_gb:.1f} GiB -> {on_gb:.1f} GiB, step {off_s:.2f} s -> {on_s:.2f} s ({on_s / off_s - 1:+.0%})"
    if not on_gb < off_gb:
        raise AssertionError(figure)
    return figure




def precision_step(name: str, shaped: Callable[[], Path]) -> str:
    need_vllm_cuda()
    recipe = recipe_for(name)
    dtype = recipe.dtypes[0]
    # vLLM's CUDA block-FP8 layers need 128-divisible shapes (rollout.fp8_weights.check_cuda_block_shapes): the
    # FP8 recipes run on the Qwen2.5-0.5B-shaped model, the others on the recipe's own tiny model
    model = [f"model.path={shaped()}"] if recipe.block_fp8_on_cuda else []
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{name}_") as tmp:
        proc, rows = train("grpo_tiny.yaml", [f"precision.recipe={name}", f"model.dtype={dtype}", "train.steps=1",
                                              "eval.every=0", *model], Path(tmp), cap_s=420)
    if proc.returncode == 2:  # the recipe refused the machine or its setup at load: documented, not a failure
        raise Skip(f"refused at load: {tail(proc)}")
    if proc.returncode != 0 or not rows:
        raise AssertionError(f"exit {proc.returncode}: {tail(proc)}")
    r = rows[-1]
    return (f"{'Qwen2.5-0.5B shape' if model else 'tiny model'}, model.dtype {dtype}: 1 step "
            f"{r.get('perf/step_s', float('nan')):.1f} s, parity/mae {r.get('parity/mae', float('nan')):.2e}, "
            f"probe/mae {r.get('probe/mae', float('nan')):.2e}, sync {r.get('perf/sync_s', float('nan')):.2f} s")
