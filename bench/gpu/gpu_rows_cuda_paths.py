"""Rows of bench/gpu/gpu_check.py on issue 57 items 1, 6 and 8: truncated sampling under vLLM's sampling mask, the
doctor's ``layers`` check on CUDA, the log-prob kernels' self-check in a child process and the KV cache vLLM sizes.
What they check was read from vLLM 0.32's source and tested on the CPU through vLLM's own classes
(tests/rollout/test_vllm_requests.py, tests/doctor/test_doctor_engine_eager.py, tests/parity/test_self_check_process.py,
tests/trainer/lifecycle/test_kv_cache_default.py); these rows are its first run on a GPU.

- group ``sampling_mask`` (item 1, vLLM's CUDA build), on the built-in tiny model: the engine training starts for a
  truncated recipe (``sampling_supports``: vLLM's ``return_sampling_mask``) generates with top-p 0.9 alone, with
  min-p 0.1 alone, without truncation (the doctor's prefill_decode leg), and scores sequences (the probe's
  ``score()``). Expected: no request refused ("sampling distribution replay requires top_k > 0" was every one of
  them), every truncated sample's sampled tokens inside the kept sets vLLM returned (``check_supports``), finite
  score log-probs, and the top-p sets smaller than the vocabulary.
- group ``kv_default`` (item 8), the same model: an engine started with no ``kv_cache_memory_bytes`` and the recipe's
  default share (0.3). Expected: vLLM's cache holds more tokens than the fixed 256 MiB did (its start-up profile gave
  the cache the rest of the share).
- ``doctor_layers_row`` (item 6, vLLM's CUDA build): ``parityrl doctor`` of grpo_tiny ``--only layers`` (the recipe's
  ``rollout.enforce_eager`` null: CUDA graphs for training). Expected: exit 0, the layers rows PASS (the battery's
  engine ran eagerly; the check was always a SKIP on CUDA before).
- ``self_check_row`` (item 8, CUDA and Triton): the Triton log-prob kernels' first check on this GPU in bf16, in its
  child process. Expected: the kernels pass (``_triton_ready`` True), this process's CUDA context still runs a
  kernel after it; the figure is the check's wall time (a Python start, a CUDA context and the compile).
"""
from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from gpu_rows_common import (
    REPO,
    Row,
    Skip,
    child_main,
    child_rows,
    need_cuda,
    need_vllm_cuda,
    prompt_ids,
    run_process,
    tail,
)

from rollout.support import check_supports
from rollout.types import SamplingSpec

SAMPLING_MASK_ROWS = ("truncated sampling under vLLM's sampling mask",)
KV_DEFAULT_ROWS = ("KV cache sized by vLLM from the share",)
DOCTOR_LAYERS_ROWS = ("doctor layers on CUDA (eager engine)",)
SELF_CHECK_ROWS = ("log-prob kernels' self-check in a child process",)
MAX_LEN = 128
OLD_DEFAULT_KV = 256 * 1024**2


def sampling_mask_group(emit, work_dir: str, model_dir: str) -> None:
    need_vllm_cuda()
    # late: vLLM's engine loads only where the rows run
    from rollout.vllm_engine import VLLMEngine

    def every_request_admitted() -> str:
        engine = VLLMEngine(model_dir, max_model_len=MAX_LEN, kv_cache_memory_bytes=OLD_DEFAULT_KV,
                            gpu_memory_utilization=0.3, sampling_supports=True)
        try:
            prompts, figures = prompt_ids(4, length=12, seed=5), []
            for name, trunc in (("top_p 0.9", dict(top_p=0.9)), ("min_p 0.1", dict(min_p=0.1))):
                r = engine.generate(prompts, SamplingSpec(n=2, max_new_tokens=16, seed=1, **trunc))
                check_supports(r.support, r.completion_ids, None, name)
                sizes = [int(s.sizes.max()) for s in r.support if len(s)]
                figures.append(f"{name}: {sum(map(len, r.completion_ids))} tokens, largest set {max(sizes)}")
                if name.startswith("top_p") and max(sizes) >= engine.llm.model_config.get_vocab_size():
                    raise AssertionError(f"{name}: a kept set as large as the vocabulary")
            plain = engine.generate(prompts, SamplingSpec(n=1, max_new_tokens=8, seed=2))
            scored = engine.score([p + c for p, c in zip(plain.prompt_ids, plain.completion_ids)])
            values = [x for row in scored.logprobs for x in row]
            if not all(math.isfinite(x) for x in values):
                raise AssertionError("score(): a log-prob that is not finite")
            return "; ".join(figures) + f"; untruncated {sum(map(len, plain.completion_ids))} tokens; score() " \
                                        f"{len(values)} finite log-probs"
        finally:
            engine.close()

    emit(SAMPLING_MASK_ROWS[0], every_request_admitted)


def kv_default_group(emit, work_dir: str, model_dir: str) -> None:
    need_vllm_cuda()
    # late: as above
    from rollout.vllm_engine import VLLMEngine
    from trainer.lifecycle.capacity import kv_bytes_per_token

    def sized_by_vllm() -> str:
        engine = VLLMEngine(model_dir, max_model_len=MAX_LEN, gpu_memory_utilization=0.3)
        try:
            c = engine.llm.llm_engine.vllm_config.cache_config
            tokens = int(c.num_gpu_blocks) * int(c.block_size)
            config = json.loads((Path(model_dir) / "config.json").read_text())
            old = OLD_DEFAULT_KV // kv_bytes_per_token(config, 2)
            figure = f"no size given: vLLM's cache holds {tokens} tokens (share 0.3); 256 MiB held {old}"
            if c.kv_cache_memory_bytes is not None or tokens <= old:
                raise AssertionError(f"{figure}; expected no fixed size and more tokens than 256 MiB held")
            return figure
        finally:
            engine.close()

    emit(KV_DEFAULT_ROWS[0], sized_by_vllm)


GROUPS = {"sampling_mask": (SAMPLING_MASK_ROWS, sampling_mask_group),
          "kv_default": (KV_DEFAULT_ROWS, kv_default_group)}


def sampling_mask_rows(tiny: Callable[[], Path]) -> list[Row]:
    need_vllm_cuda()
    return child_rows(Path(__file__), "sampling_mask", SAMPLING_MASK_ROWS, [str(tiny())], cap_s=180)


def kv_default_rows(tiny: Callable[[], Path]) -> list[Row]:
    need_vllm_cuda()
    return child_rows(Path(__file__), "kv_default", KV_DEFAULT_ROWS, [str(tiny())], cap_s=150)


def doctor_layers_row() -> str:
    need_vllm_cuda()
    with tempfile.TemporaryDirectory(prefix="gpu_check_doctor_layers_") as tmp:
        out = Path(tmp) / "report"
        cmd = [sys.executable, "-m", "trainer", "doctor", str(REPO / "recipes" / "grpo_tiny.yaml"),
               "--set", f"logging.run_dir={tmp}/run", "--only", "layers", "--out", str(out)]
        proc = run_process(cmd, cap_s=240, what="parityrl doctor --only layers")
        report = json.loads((out / "doctor.json").read_text()) if (out / "doctor.json").is_file() else None
    if report is None:
        raise AssertionError(f"doctor exit {proc.returncode} without doctor.json: {tail(proc)}")
    findings = report["findings"]
    verdicts = sorted({f["verdict"] for f in findings})
    if proc.returncode != 0 or verdicts != ["PASS"]:
        bad = [f"{f['item']}: {f['verdict']} {f.get('cause', '')[:80]}" for f in findings if f["verdict"] != "PASS"]
        raise AssertionError(f"doctor exit {proc.returncode}; not PASS: {bad[:3]}")
    return f"exit 0, {len(findings)} layers rows PASS on the eager engine"


def self_check_row() -> str:
    device = need_cuda()
    # late: the dispatch imports Triton's kernels where a row checks them
    import parity.logprobs.dispatch as dispatch

    if dispatch.logprobs_triton is None:
        raise Skip("needs Triton (it does not import here)")
    dispatch._TRITON_CHECKED.pop((str(device), torch.bfloat16), None)
    t0 = time.perf_counter()
    ready = dispatch._triton_ready(device, torch.bfloat16)
    seconds = time.perf_counter() - t0
    after = float(torch.ones(1024, device=device).sum())  # this process's context is clean
    figure = f"child check {seconds:.1f} s on {torch.cuda.get_device_name(device)}: " + \
        ("passed" if ready else f"failed ({dispatch._TRITON_CHECKED.get((str(device), torch.bfloat16))})")
    if not ready or after != 1024.0:
        raise AssertionError(figure)
    return figure


if __name__ == "__main__":
    child_main(GROUPS)
