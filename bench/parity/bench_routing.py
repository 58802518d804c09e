"""Rollout routing replay on random mixture-of-experts models: parity with and without it, and its cost.

    python bench/parity/bench_routing.py [--steps 3] [--families qwen2_moe,qwen3_moe,mixtral,olmoe] [--dense qwen3,mistral]

Every run is ``parityrl train recipes/grpo_tiny.yaml`` (GRPO, bf16, vLLM colocated, LoRA) on a random model of
the architecture zoo (``trainer.builtin.zoo``: 2 layers, weights at std 0.2, so routers have near-ties), for
``--steps`` steps, in its own process, evaluation off. Per MoE family three runs, same seed:

* ``off``: no routes asked of the engine (prefix caching on): the baseline of the step time;
* ``measure``: the engine's routes captured and compared with the trainer's own choice, not replayed;
* ``on``: replayed (``parity.routing_replay: on``).

Printed per run, over its steps: parity/mae, parity/kl_k3 (means), the worst token |d| (parity/max_abs, max),
the routing agreement and the share of tokens that differ in at least one layer, and the median step time of
the steps after the first (the first also scores the batch without replay: ``parity/unreplayed/*``). Then, per
family, kl_k3 on / measure (goal <= 0.3) and the dense models' worst token |d| for scale.

The step times of separate runs differ by more than replay costs (the runs' policies diverge after step 1, and
a 2-core machine's timings wander by 20-30%), so the cost of replay is timed in this process on fixed work,
alternating, medians of ``--repeats`` (``timing``): the same generate call on two vLLM engines of the model,
without and with routes (capture + prefix caching off), and the same LoRA forward + backward of the resulting
batch without and with its routes replayed. Goal: with / without <= 1.05.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before anything imports vllm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rollout.types import SamplingSpec  # noqa: E402
from trainer.builtin.zoo import ensure_arch_model  # noqa: E402


def run(model_dir: Path, mode: str, steps: int, out: Path) -> dict:
    run_dir = out / f"{model_dir.name}-{mode}"
    cmd = [sys.executable, "-m", "trainer.train", str(ROOT / "recipes/grpo_tiny.yaml"),
           "--set", f"model.path={model_dir}", "--set", f"train.steps={steps}", "--set", "eval.every=0",
           "--set", f"logging.run_dir={run_dir}", "--set", "logging.wandb.mode=disabled",
           "--set", f"parity.routing_replay={mode}", "--set", "checkpoint.every=0"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) >= 1 and "parity/mae" in r]

    def mean(key):
        vals = [r[key] for r in rows if key in r]
        return statistics.fmean(vals) if vals else float("nan")

    return {"mae": mean("parity/mae"), "kl_k3": mean("parity/kl_k3"),
            "worst": max(r["parity/max_abs"] for r in rows),
            "agree": mean("parity/routing_agree"), "any_diff": mean("parity/routing_tokens_any_diff"),
            "step_s": statistics.median(r["perf/step_s"] for r in rows[1:]) if len(rows) > 1 else rows[0]["perf/step_s"],
            "unreplayed_kl_k3": mean("parity/unreplayed/kl_k3"), "kl_k3_first": rows[0]["parity/kl_k3"]}


def timing(model_dir: Path, repeats: int) -> dict:
    """Medians (s) of one grpo_tiny-shaped rollout (16 prompts x 8 samples, 40 prompt and up to 24 new tokens)
    without / with routes, and of the LoRA forward + backward of that batch without / with replay."""
    from rollout.vllm_engine import VLLMEngine
    from trainer.config import LoraConfig, RolloutConfig
    from trainer.measurement.scoring import forward
    from trainer.models.batch import batch_from_rollouts
    from trainer.models.policy import add_lora, load_base_model
    from trainer.models.routing_replay import RoutingReplay

    share = RolloutConfig.gpu_memory_utilization  # CUDA: the recipe's (VLLMEngine has no default of its own)
    plain = VLLMEngine(model_dir, max_model_len=128, gpu_memory_utilization=share)
    routed = VLLMEngine(model_dir, max_model_len=128, return_routes=True, gpu_memory_utilization=share)
    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 500, (40,), generator=g).tolist() for _ in range(16)]
    spec = SamplingSpec(n=8, temperature=1.0, max_new_tokens=24, seed=1)
    t = {"rollout": ([], []), "train": ([], [])}
    for _ in range(repeats + 1):  # the first round warms up
        for k, engine in enumerate((plain, routed)):
            t0 = time.perf_counter()
            rollouts = engine.generate(prompts, spec)
            t["rollout"][k].append(time.perf_counter() - t0)
    plain.close()
    routed.close()
    model = add_lora(load_base_model(str(model_dir), "bfloat16"), LoraConfig())
    RoutingReplay(model)
    with_routes = batch_from_rollouts(rollouts, pad_id=0)
    batches = (replace(with_routes, routes=None), with_routes)
    model.train()
    for _ in range(repeats + 1):
        for k, batch in enumerate(batches):
            t0 = time.perf_counter()
            lp = forward(model, batch, temperature=1.0)[0]
            (lp * batch.mask).sum().backward()
            t["train"][k].append(time.perf_counter() - t0)
    return {f"{what}_{side}": statistics.median(v[k][1:]) for what, v in t.items()
            for k, side in enumerate(("without", "with"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--families", default="qwen2_moe,qwen3_moe,mixtral,olmoe")
    ap.add_argument("--dense", default="qwen3,mistral")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timing-only", action="store_true", help="only the cost of replay on fixed work")
    args = ap.parse_args()
    families = [a for a in args.families.split(",") if a]
    if not args.timing_only:
        runs(args, families)
    print(f"\nthe cost of replay on fixed work (medians of {args.repeats}; goal: with / without <= 1.05)")
    print(f"{'model':<11} {'rollout s':>17} {'train fwd+bwd s':>17} {'both':>6}")
    for arch in families:
        r = timing(ensure_arch_model(arch, dtype="bfloat16"), args.repeats)
        both = (r["rollout_with"] + r["train_with"]) / (r["rollout_without"] + r["train_without"])
        print(f"{arch:<11} {r['rollout_without']:.3f} -> {r['rollout_with']:.3f}   "
              f"{r['train_without']:.3f} -> {r['train_with']:.3f}   {both:>5.2f}x", flush=True)


def runs(args, families: list[str]) -> None:
    """The training runs of the module docstring, and their table."""
    out = Path(tempfile.mkdtemp(prefix="bench_routing-"))
    print(f"{'model':<11} {'mode':<8} {'mae':>9} {'kl_k3':>9} {'worst|d|':>9} {'agree':>7} {'any_diff':>9} "
          f"{'step s':>7}")
    results = {}
    for arch in [a for a in args.dense.split(",") if a]:
        r = run(ensure_arch_model(arch, dtype="bfloat16"), "off", args.steps, out)
        results[(arch, "off")] = r
        print(f"{arch:<11} {'dense':<8} {r['mae']:>9.2e} {r['kl_k3']:>9.2e} {r['worst']:>9.3f} {'-':>7} {'-':>9} "
              f"{r['step_s']:>7.2f}", flush=True)
    for arch in families:
        model_dir = ensure_arch_model(arch, dtype="bfloat16")
        for mode in ("off", "measure", "on"):
            r = results[(arch, mode)] = run(model_dir, mode, args.steps, out)
            print(f"{arch:<11} {mode:<8} {r['mae']:>9.2e} {r['kl_k3']:>9.2e} {r['worst']:>9.3f} "
                  f"{r['agree']:>7.4f} {r['any_diff']:>9.4f} {r['step_s']:>7.2f}", flush=True)
    print("\nkl_k3 with replay / without (goal <= 0.3)")
    for arch in families:
        on, measure = results[(arch, "on")], results[(arch, "measure")]
        print(f"{arch:<11} runs: {on['kl_k3'] / measure['kl_k3']:.2f}   step 1's batch: replayed "
              f"{on['kl_k3_first']:.2e} / unreplayed {on['unreplayed_kl_k3']:.2e} = "
              f"{on['kl_k3_first'] / on['unreplayed_kl_k3']:.2f}")
    print(f"(runs in {out})")


if __name__ == "__main__":
    main()
