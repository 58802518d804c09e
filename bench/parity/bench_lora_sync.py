"""LoRA in the engine: the adapter served as such (``rollout.lora_sync: adapter``) against the merged weights
(``merged``), on the same runs, in one invocation (docs/precision.md "LoRA in the engine").

    python bench/parity/bench_lora_sync.py [--steps 20] [--lr 5e-5] [--smollm2-steps 6] [--repeats 5]
                                    [--parts runs,bytes,timing,numerics]

- ``runs``: GRPO, ``recipes/grpo_tiny.yaml`` in BF16 at learning rate ``--lr`` for ``--steps`` steps with each
  mode (same seed, each its own colocated vLLM engine): mean ``parity/kl_k3`` over the first 5 and the last 5 steps
  and their ratio (the goal: <= 1.3 with ``adapter``), ``parity/mae``, and what merging costs
  (``sync/merge_update_error``, ``sync/merge_unchanged_frac``, means over the steps). Then the same pair on
  SmolLM2-135M in BF16 (``recipes/grpo_smollm2_cpu.yaml``, 2 prompts a step) for ``--smollm2-steps`` steps.
- ``bytes``: Qwen2.5-7B's shapes on the meta device, LoRA r 16 on every linear: the bytes one sync sends in each
  mode, counted by the export paths themselves (``rollout.adapters.export_lora_adapter``,
  ``rollout.weight_export.iter_merged_lora_weights``).
- ``timing``: one sync of each mode into a started engine, tiny model and SmolLM2 (medians of ``--repeats``).
- ``numerics``: one fixed adapter on the tiny model (lora_B ~ N(0, 0.02)), the same sampled tokens scored by the
  engine and the trainer: the engine's BF16 LoRA against the trainer's float32 adapter (PEFT's default) and a
  BF16 one, and the merged BF16 engine against the float32 adapter.

Ratios and figures only; nothing here is a timed assertion.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

FIRST = 5  # steps averaged at each end of a run


def run(recipe: str, mode: str, overrides: list[str]) -> list[dict]:
    from trainer.lifecycle.preflight import load_recipe
    from trainer.rl.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_recipe(recipe, [f"rollout.lora_sync={mode}", f"logging.run_dir={tmp}/run", "eval.every=0",
                                   "logging.wandb.mode=disabled", "checkpoint.every=0", "logging.samples_every=0",
                                   *overrides])
        return train(cfg).history


def summarize(h: list[dict]) -> dict:
    def mean(key, rows):
        vals = [r[key] for r in rows if key in r]
        return statistics.mean(vals) if vals else float("nan")

    n = min(FIRST, len(h) // 2)
    first, last = mean("parity/kl_k3", h[:n]), mean("parity/kl_k3", h[-n:])
    return {"steps": len(h), "kl_first": first, "kl_last": last, "kl_ratio": last / first if first else float("nan"),
            "mae": mean("parity/mae", h), "merge_err": mean("sync/merge_update_error", h),
            "unchanged": mean("sync/merge_unchanged_frac", h), "sync_bytes": mean("perf/sync_bytes", h),
            "sync_s": mean("perf/sync_s", h), "reward_first": mean("reward/mean", h[:n]),
            "reward_last": mean("reward/mean", h[-n:])}


def print_runs(title: str, rows: dict) -> None:
    print(f"\n{title}")
    print(f"{'mode':<9}{'steps':>6}{'kl_k3 1-5':>12}{'kl_k3 last 5':>14}{'ratio':>8}{'mae':>11}"
          f"{'merge err':>11}{'unchanged':>11}{'sync MB':>9}{'reward first/last':>20}")
    for mode, s in rows.items():
        print(f"{mode:<9}{s['steps']:>6}{s['kl_first']:>12.2e}{s['kl_last']:>14.2e}{s['kl_ratio']:>8.2f}"
              f"{s['mae']:>11.2e}{s['merge_err']:>11.3f}{s['unchanged']:>11.3f}{s['sync_bytes'] / 1e6:>9.2f}"
              f"{s['reward_first']:>10.3f} / {s['reward_last']:.3f}")


def runs(args) -> None:
    lr = [f"train.learning_rate={args.lr}"]
    tiny = {m: summarize(run("recipes/grpo_tiny.yaml", m, [f"train.steps={args.steps}", *lr]))
            for m in ("adapter", "merged")}
    print_runs(f"tiny model, BF16, lr {args.lr}, {args.steps} GRPO steps", tiny)
    if args.smollm2_steps:
        sets = [f"train.steps={args.smollm2_steps}", "model.dtype=bfloat16", "rollout.prompts_per_step=2", *lr]
        smol = {m: summarize(run("recipes/grpo_smollm2_cpu.yaml", m, sets)) for m in ("adapter", "merged")}
        print_runs(f"SmolLM2-135M, BF16, lr {args.lr}, {args.smollm2_steps} GRPO steps", smol)


def qwen7b_bytes() -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rollout.adapters import export_lora_adapter
    from rollout.weight_export import iter_merged_lora_weights, payload_bytes
    from trainer.config import LoraConfig
    from trainer.models.policy import add_lora

    # Qwen2.5-7B's config.json
    cfg = Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                      num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)
    with torch.device("meta"):
        policy = add_lora(AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16), LoraConfig(r=16, alpha=32))
    adapter = export_lora_adapter(policy, version=1, dtype=torch.bfloat16, device=None).nbytes
    merged = payload_bytes(iter_merged_lora_weights(policy, dtype=torch.bfloat16))
    print(f"\nQwen2.5-7B shapes, LoRA r 16 on every linear, BF16: one sync sends {adapter / 1e6:.1f} MB as an adapter, "
          f"{merged / 1e9:.2f} GB merged: adapter / merged = {adapter / merged:.4f} ({100 * adapter / merged:.2f}%)")


def _policy(model_dir: str, dtype: str, seed: int = 0, std: float = 0.02):
    import torch

    from trainer.config import LoraConfig
    from trainer.models.policy import add_lora, load_base_model

    policy = add_lora(load_base_model(model_dir, dtype, "cpu"), LoraConfig())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std, generator=g)
    return policy


def timing(args) -> None:
    import torch

    from rollout.adapters import adapter_config
    from rollout.vllm_engine import VLLMEngine
    from trainer.builtin.resolve import resolve_model_path
    from trainer.sampling.engines import sync_adapter, sync_weights

    print(f"\none sync into a started engine (median of {args.repeats}, seconds; MB sent)")
    print(f"{'model':<16}{'adapter s':>11}{'merged s':>10}{'ratio':>8}{'adapter MB':>12}{'merged MB':>11}")
    for name in ("builtin:tiny", "builtin:smollm2-135m"):
        model_dir = resolve_model_path(name)
        policy = _policy(model_dir, "bfloat16")
        targets = adapter_config(policy)["target_modules"]
        with VLLMEngine(model_dir, dtype="bfloat16", max_model_len=256, max_lora_rank=16,
                        lora_target_modules=targets) as engine:
            times = {"adapter": [], "merged": []}
            sent = {}
            for i in range(args.repeats):
                t = time.perf_counter()
                sent["adapter"] = sync_adapter(engine, policy, version=i + 1)["perf/sync_bytes"]
                times["adapter"].append(time.perf_counter() - t)
                t = time.perf_counter()
                sent["merged"] = sync_weights(engine, policy, dtype=torch.bfloat16)["perf/sync_bytes"]
                times["merged"].append(time.perf_counter() - t)
        a, m = statistics.median(times["adapter"]), statistics.median(times["merged"])
        print(f"{name:<16}{a:>11.4f}{m:>10.4f}{a / m:>8.3f}{sent['adapter'] / 1e6:>12.2f}{sent['merged'] / 1e6:>11.2f}")


def numerics(args) -> None:
    import torch

    from parity.metrics import compare
    from rollout.adapters import adapter_config, export_lora_adapter
    from rollout.types import SamplingSpec
    from rollout.vllm_engine import VLLMEngine
    from rollout.weight_export import iter_merged_lora_weights
    from trainer.builtin.resolve import resolve_model_path
    from trainer.measurement.scoring import score_batch
    from trainer.models.batch import batch_from_rollouts

    model_dir = resolve_model_path("builtin:tiny")
    policy = _policy(model_dir, "bfloat16")
    bf16_adapter = copy.deepcopy(policy)  # the same A and B (add_lora draws A from the global RNG)
    with torch.no_grad():  # PEFT computes the branch in its weights' dtype: BF16 weights, a BF16 branch
        for name, p in bf16_adapter.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(3, 500, (24,), generator=g).tolist() for _ in range(16)]
    spec = SamplingSpec(n=4, temperature=1.0, max_new_tokens=24, seed=2)

    def parity(model, rollouts) -> dict:
        batch = batch_from_rollouts(rollouts, 0, "cpu")
        s = score_batch(model, batch, micro_batch_size=16, temperature=1.0)
        return compare(s.logprobs, batch.rollout_logprobs, batch.mask)

    with VLLMEngine(model_dir, dtype="bfloat16", max_model_len=128, max_lora_rank=16,
                    lora_target_modules=adapter_config(policy)["target_modules"]) as engine:
        base = engine.generate(prompts, spec)
        engine.load_adapter(export_lora_adapter(policy, version=1, dtype=engine.adapter_dtype))
        served = engine.generate(prompts, spec)
        engine.load_weights(iter_merged_lora_weights(policy, dtype=torch.bfloat16))
        merged = engine.generate(prompts, spec)
    with policy.disable_adapter():
        floor = parity(policy, base)
    rows = {"engine base vs trainer base (the BF16 floor)": floor,
            "engine BF16 adapter vs trainer float32 adapter": parity(policy, served),
            "engine BF16 adapter vs trainer BF16 adapter": parity(bf16_adapter, served),
            "engine merged BF16 vs trainer float32 adapter": parity(policy, merged)}
    print("\none adapter (lora_B ~ N(0, 0.02), r 16, every linear), tiny model, 16 prompts x 4 samples x 24 tokens")
    print(f"{'':<52}{'mae':>11}{'kl_k3':>11}{'max |d|':>10}")
    for k, m in rows.items():
        print(f"{k:<52}{m['parity/mae']:>11.3e}{m['parity/kl_k3']:>11.3e}{m['parity/max_abs']:>10.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--smollm2-steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--parts", default="runs,bytes,timing,numerics")
    args = p.parse_args()
    parts = args.parts.split(",")
    for part, fn in (("bytes", lambda: qwen7b_bytes()), ("numerics", lambda: numerics(args)),
                     ("timing", lambda: timing(args)), ("runs", lambda: runs(args))):
        if part in parts:
            fn()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
