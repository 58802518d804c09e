"""Rows of bench/gpu/gpu_check.py on the colocated vLLM engine's memory and speed (issue 44 items 7, 8 and 11).

Each group runs in a child process (``python bench/gpu/gpu_rows_engine.py GROUP OUT.jsonl MODEL_DIR``) with
vLLM's CUDA build, on a Qwen2.5-0.5B-shaped random model (group ``two_engines``: a small model):

- group ``engine``, one engine as training starts it on CUDA (sleep mode, CUDA graphs, a 1 GiB KV cache, share 0.3),
  the trainer's LoRA policy loaded first on the same GPU (``lora_policy``: an update as large as the weights' spread):
  ``ENGINE_ROWS[0]`` the GPU memory vLLM takes at start (free memory before and after ``LLM()``) is at least what
  ``trainer.lifecycle.capacity``'s GPU rule counts for it (its weights and ``kv_cache_memory_bytes``; the rule is a
  lower bound): the overhead is printed;
  ``[1]`` ``release_memory()`` (sleep level 1) frees at least 90% of weights + KV cache; the trainer's sync
  (``sync_weights``: weights woken, loaded chunk by chunk, KV cache woken) then gives samples whose log-probs match
  the trainer's scoring of them (parity/mae < 0.02), where the same engine before the sync was off by > 0.1 (the
  check can tell a stale engine apart);
  ``[2]`` every parameter of the engine keeps its address across sleep, wake and the sync (vLLM's reload copies into
  the original storage, so the CUDA graphs captured at start stay valid) and the post-sync MAE above holds while the
  engine replays graphs (``enforce_eager`` off);
  ``[3]`` generation speed with CUDA graphs and, in a second engine, eager (64 prompts x up to 128 tokens): both
  printed, no threshold (a benchmark).
- group ``two_engines``: two engines at the recipe's default share (``RolloutConfig.gpu_memory_utilization``, the
  one ``start_vllm`` gives an engine not told otherwise) and vLLM's own KV sizing, in one process, both start
  (vLLM's free-memory check at start) and generate. Eager, to start in seconds: the share is the point.
- group ``float32``: ``parityrl compare`` in float32 (vLLM's float32 attention on CUDA runs TF32 dots): the MAE
  printed beside the CPU floor of the bf16 recipe's float32 (``mae_floor``); passes when finite.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Callable

import torch
from gpu_rows_common import (
    KV_BYTES,
    Row,
    child_main,
    child_rows,
    engine_mae,
    lora_policy,
    need_vllm_cuda,
    prompt_ids,
    prompts_file,
)

from rollout.types import SamplingSpec
from trainer.builtin.model_files import parameter_count, safetensors_header, weight_files
from trainer.config import RolloutConfig
from trainer.precision import recipe_for

ENGINE_ROWS = ("vLLM's GPU memory >= the capacity rule's bound", "sleep / wake around the trainer's update",
               "CUDA graphs: weights in place across a sync", "CUDA graphs vs eager: generation speed")
TWO_ENGINES_ROWS = ("two engines at the default GPU share",)
FLOAT32_ROWS = ("float32 engine vs trainer (TF32 attention)",)
GiB = 2**30
MAE_LIMIT = 0.02  # engine vs trainer in bf16 on the same weights (tests/rollout/test_vllm_engine.py's bound)
STALE_FLOOR = 5 * MAE_LIMIT  # the unsynced engine must be at least this far off, or the check cannot tell


def _weight_bytes(model_dir: str) -> int:
    """The engine's weights in bf16, counted as the capacity rule counts them (safetensors headers)."""
    files, problem = weight_files(Path(model_dir))
    if problem:
        raise RuntimeError(problem)
    return 2 * parameter_count([safetensors_header(f)[0] for f in files])


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _param_ptrs(model) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in model.named_parameters()}


def _eager(engine) -> object:
    config = getattr(getattr(engine.llm, "llm_engine", None), "vllm_config", None)
    return getattr(getattr(config, "model_config", None), "enforce_eager", "unknown")


def _tokens_per_s(engine) -> float:
    engine.generate(prompt_ids(4, seed=5), SamplingSpec(n=1, max_new_tokens=16, seed=5))  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(prompt_ids(64, seed=6), SamplingSpec(n=1, max_new_tokens=128, seed=6))
    torch.cuda.synchronize()
    return sum(len(c) for c in out.completion_ids) / (time.perf_counter() - t0)


def engine_group(emit, work_dir: str, model_dir: str) -> None:
    need_vllm_cuda()
    # late: vLLM's engine and the trainer's side load only where they run
    from rollout.vllm_engine import VLLMEngine
    from trainer.models.policy import load_tokenizer
    from trainer.sampling.engines import sync_weights

    device = torch.device("cuda")
    policy = lora_policy(model_dir, device)  # the trainer's weights first, as a run loads them
    pad = load_tokenizer(model_dir).pad_token_id
    bound = _weight_bytes(model_dir) + KV_BYTES
    prompts, spec = prompt_ids(16), SamplingSpec(n=2, max_new_tokens=32, seed=0)
    options = dict(dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=KV_BYTES, gpu_memory_utilization=0.3)
    state: dict = {}

    def capacity() -> str:
        free0 = _free()
        state["engine"] = VLLMEngine(model_dir, enable_sleep_mode=True, **options)
        taken = free0 - _free()
        figure = (f"vLLM took {taken / GiB:.2f} GiB at start; the capacity rule counts {bound / GiB:.2f} GiB "
                  f"(weights + rollout.kv_cache_memory_bytes {KV_BYTES / GiB:.0f} GiB): overhead "
                  f"{(taken - bound) / GiB:+.2f} GiB")
        if taken < bound:
            raise AssertionError(f"{figure}: below the rule's bound, which must be a lower bound")
        return figure

    emit(ENGINE_ROWS[0], capacity)
    if "engine" not in state:
        raise RuntimeError("the engine did not start (see the first row of its group)")
    engine = state["engine"]

    def sleep_wake() -> str:
        control = engine_mae(engine.generate(prompts, spec), policy, pad, device)
        state["ptrs_before"] = engine.llm.apply_model(_param_ptrs)[0]
        before = _free()
        engine.release_memory()
        freed = _free() - before
        sync_weights(engine, policy, dtype=torch.bfloat16)
        state["ptrs_after"] = engine.llm.apply_model(_param_ptrs)[0]
        state["mae"] = mae = engine_mae(engine.generate(prompts, spec), policy, pad, device)
        figure = (f"release_memory freed {freed / GiB:.2f} GiB (weights + KV {bound / GiB:.2f} GiB); after the "
                  f"sync parity/mae {mae:.2e} vs the trainer (before it {control:.2e})")
        bad = [] if freed >= 0.9 * bound else [f"freed less than 90% of {bound / GiB:.2f} GiB"]
        bad += [] if mae < MAE_LIMIT else [f"post-sync MAE not below {MAE_LIMIT}"]
        bad += [] if control > STALE_FLOOR else [f"the unsynced engine is within {STALE_FLOOR}: the check cannot "
                                                 "tell a stale engine apart"]
        if bad:
            raise AssertionError(f"{figure}: " + "; ".join(bad))
        return figure

    emit(ENGINE_ROWS[1], sleep_wake)

    def graphs_in_place() -> str:
        if "ptrs_after" not in state:
            raise RuntimeError("needs the sleep / wake row's sync, which did not run to its end")
        before, after = state["ptrs_before"], state["ptrs_after"]
        moved = sorted(n for n in before if after.get(n) != before[n])
        figure = (f"enforce_eager {_eager(engine)}: {len(moved)} of {len(before)} parameters moved across sleep, wake "
                  f"and the sync; post-sync parity/mae {state['mae']:.2e}")
        if moved or not state["mae"] < MAE_LIMIT or _eager(engine) is not False:
            raise AssertionError(f"{figure} (e.g. {moved[:3]})")
        return figure

    emit(ENGINE_ROWS[2], graphs_in_place)

    def speed() -> str:
        graphs = _tokens_per_s(engine)
        engine.close()
        eager_engine = VLLMEngine(model_dir, enforce_eager=True, **options)
        try:
            eager = _tokens_per_s(eager_engine)
        finally:
            eager_engine.close()
        return (f"64 prompts x up to 128 new tokens (prefill included): CUDA graphs {graphs:.0f} tokens/s, eager "
                f"{eager:.0f} tokens/s ({graphs / eager:.2f}x)")

    emit(ENGINE_ROWS[3], speed)


def two_engines_group(emit, work_dir: str, model_dir: str) -> None:
    need_vllm_cuda()
    # late: imports vLLM's engine
    from trainer.sampling.engines import start_vllm

    def both() -> str:
        engines, taken = [], []
        try:
            for seed in (0, 1):
                free = _free()
                engines.append(start_vllm(model_dir, precision="bf16", dtype="bfloat16", max_model_len=256,
                                          seed=seed, work_dir=work_dir, enforce_eager=True))
                taken.append(free - _free())
            made = [e.generate(prompt_ids(4), SamplingSpec(n=2, max_new_tokens=8, seed=0)) for e in engines]
        finally:
            for e in engines:
                e.close()
        return (f"gpu_memory_utilization {RolloutConfig.gpu_memory_utilization} (the default) each: both started "
                f"({taken[0] / GiB:.1f} and {taken[1] / GiB:.1f} GiB) and generated "
                f"{sum(len(m) for m in made)} samples")

    emit(TWO_ENGINES_ROWS[0], both)


def float32_group(emit, work_dir: str, model_dir: str) -> None:
    need_vllm_cuda()
    # late: `parityrl compare`'s module imports matplotlib and openpyxl
    from trainer.diagnostics.compare import run_compare

    def compare() -> str:
        prompts = prompts_file(Path(work_dir) / "prompts.txt", 8)
        summary = run_compare(model_dir, str(prompts), str(Path(work_dir) / "compare"), dtype="float32",
                              precision="bf16", max_new_tokens=32, n=2, seed=0, kv_cache_bytes=KV_BYTES)
        mae = summary["metrics"]["parity/mae"]
        floor = recipe_for("bf16").mae_floor["float32"].mae
        figure = (f"Qwen2.5-0.5B shape in float32: parity/mae {mae:.2e} over {summary['num_tokens']} tokens; "
                  f"the CPU floor (bf16 recipe, float32) {floor:.0e}")
        if not math.isfinite(mae):
            raise AssertionError(figure)
        return figure

    emit(FLOAT32_ROWS[0], compare)


GROUPS = {"engine": (ENGINE_ROWS, engine_group), "two_engines": (TWO_ENGINES_ROWS, two_engines_group),
          "float32": (FLOAT32_ROWS, float32_group)}


def engine_rows(shaped: Callable[[], Path]) -> list[Row]:
    need_vllm_cuda()
    return child_rows(Path(__file__), "engine", ENGINE_ROWS, [str(shaped())], cap_s=420)


def two_engines_rows(tiny: Callable[[], Path]) -> list[Row]:
    need_vllm_cuda()
    return child_rows(Path(__file__), "two_engines", TWO_ENGINES_ROWS, [str(tiny())], cap_s=240)


def float32_rows(shaped: Callable[[], Path]) -> list[Row]:
    need_vllm_cuda()
    return child_rows(Path(__file__), "float32", FLOAT32_ROWS, [str(shaped())], cap_s=300)

if __name__ == "__main__":
    child_main(GROUPS)
