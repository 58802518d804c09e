"""Wall time of one training step split by phase, for the vLLM and the HF rollout engine.

    python bench/speed/bench_step.py [--recipe recipes/grpo_tiny.yaml] [--steps 6] [--set key=value ...]

Runs the recipe for a few steps with each engine in this process (the first step,
which includes engine warm-up, is reported separately and left out of the means) and
prints the mean seconds per phase — rollout, reward, forward/backward/optimizer,
weight sync — plus rollout tokens/s, and the ratio vLLM / HF for each. The phase times
are the loop's own `perf/*` metrics, so this measures exactly what a run logs.
"""
import argparse
import os
import statistics
import tempfile

PHASES = ["perf/rollout_s", "perf/reward_s", "perf/train_s", "perf/sync_s", "perf/step_s", "perf/rollout_tokens_per_s"]


def run(recipe: str, engine: str, steps: int, overrides: list[str]) -> list[dict]:
    from trainer.lifecycle.preflight import load_recipe
    from trainer.rl.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_recipe(recipe, [f"rollout.engine={engine}", f"train.steps={steps}", f"logging.run_dir={tmp}/run",
                                   "logging.wandb.mode=disabled", "checkpoint.every=0", *overrides])
        return train(cfg).history


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/grpo_tiny.yaml")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    results = {}
    for engine in ("vllm", "hf"):
        h = run(args.recipe, engine, args.steps, args.overrides)
        results[engine] = {k: statistics.mean(r[k] for r in h[1:]) for k in PHASES}
        results[engine]["first_step_s"] = h[0]["perf/step_s"]
    print(f"\nmean over steps 2..{args.steps} (step 1, with warm-up, shown apart)")
    print(f"{'phase':<28}{'vllm':>12}{'hf':>12}{'vllm/hf':>10}")
    for k in PHASES + ["first_step_s"]:
        v, h = results["vllm"][k], results["hf"][k]
        print(f"{k:<28}{v:>12.3f}{h:>12.3f}{v / h if h else float('nan'):>10.2f}")
    v = results["vllm"]
    share = {k: v[k] / v["perf/step_s"] for k in PHASES[:4]}
    print("vllm step split: " + ", ".join(f"{k.split('/')[1][:-2]} {100 * s:.0f}%" for k, s in share.items()))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
