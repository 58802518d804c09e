"""Learning at staleness: the demo task at rollout.max_staleness k, each off-policy objective, several seeds.

    python bench/learning/bench_staleness.py [--k 0,1,2,4] [--objectives behaviour_clip,decoupled,m2po]
        [--seeds 0,1,2] [--steps N] [--parallel 2] [--set key=value ...] [--report FOLDER]

Each run is ``parityrl train recipes/grpo_tools_tiny.yaml`` through the real CLI, in a process of its own, with
``rollout.max_staleness=k``, ``algorithm.off_policy=<objective>`` and ``train.seed=<seed>``; ``--parallel`` runs
side by side, each on ``train.cpu_threads=1`` (the same machine load for all). At k = 0 the objectives are one
update (each reduces to the on-policy surrogate), so k = 0 runs once per seed. Prints every run's reward gain
(mean of the last 5 steps minus the first 5), held-out eval/mean@4 at every evaluation, its worst five steps'
reward (a collapse that recovers before the last evaluation shows only there) and its staleness/kl_k3, then
per (k, objective) the means over seeds and the held-out rise as a share of k = 0's: AReaL's question (arXiv 2505.24298) of whether
an off-policy objective keeps the on-policy run's learning at staleness k.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "grpo_tools_tiny.yaml"
KEY = "eval/mean@4"


def runs(ks: list[int], objectives: list[str], seeds: list[int]) -> list[tuple[int, str, int]]:
    out = []
    for seed in seeds:
        for k in ks:
            for objective in (objectives[:1] if k == 0 else objectives):
                out.append((k, objective, seed))
    return out


def command(out: Path, k: int, objective: str, seed: int, common: list[str]) -> tuple[str, list[str]]:
    name = f"k{k}_{objective}_s{seed}"
    sets = [f"name={name}", f"logging.run_dir={out / name}", "logging.wandb.mode=disabled", "checkpoint.every=0",
            f"rollout.max_staleness={k}", f"algorithm.off_policy={objective}", f"train.seed={seed}", *common]
    return name, [sys.executable, "-m", "trainer.cli", "train", str(RECIPE)] + [a for s in sets for a in ("--set", s)]


def worst_window(values: list[float], width: int = 5) -> tuple[float, int]:
    """The lowest mean of ``width`` consecutive values and the 1-based index its window ends at: a collapse that
    recovers before the last evaluation shows here and nowhere else in the summary."""
    if len(values) < width:
        raise ValueError(f"worst_window: {len(values)} values, fewer than the window's {width}")
    means = [sum(values[i - width:i]) / width for i in range(width, len(values) + 1)]
    low = min(means)
    return low, means.index(low) + width


def summary(out: Path, name: str) -> dict:
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0 and "reward/mean" in r]
    rewards = [r["reward/mean"] for r in steps]
    evals = [(r["step"], r[KEY]) for r in rows if KEY in r]
    kl = [r.get("staleness/kl_k3", 0.0) for r in steps]
    low, low_step = worst_window(rewards)
    return {"reward_gain": sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5, "eval_first": evals[0][1],
            "eval_last": evals[-1][1], "eval_rise": evals[-1][1] - evals[0][1], "evals": evals,
            "reward_worst5": low, "reward_worst5_step": steps[low_step - 1]["step"],
            "kl_k3_mean": sum(kl) / len(kl), "kl_k3_max": max(kl),
            "lag_max": max((r.get("staleness/lag", 0.0) for r in steps), default=0.0)}


def report(out: Path, ks: list[int], objectives: list[str], seeds: list[int], walls: dict[str, float]) -> None:
    """Every run's line, then the table per (k, objective): means over seeds, the held-out rise as a share of
    k = 0's, and the mean of each run's worst five steps' reward."""
    table: dict[tuple[int, str], list[dict]] = {}
    names = [f"k{k}_{o}_s{seed}" for k, o, seed in runs(ks, objectives, seeds)]
    missing = [n for n in names if not (out / n / "metrics.jsonl").is_file()]
    if missing:
        found = sorted(p.parent.name for p in out.glob("*/metrics.jsonl"))
        raise SystemExit(f"{out}: no metrics.jsonl for {', '.join(missing)} (the runs --k, --objectives and --seeds "
                         f"name); the folder holds {', '.join(found) or 'no run'}")
    for k, objective, seed in runs(ks, objectives, seeds):
        name = f"k{k}_{objective}_s{seed}"
        s = summary(out, name)
        table.setdefault((k, objective), []).append(s)
        curve = " -> ".join(f"{v:.3f}" for _, v in s["evals"])
        wall = f"  wall {walls[name]:.0f} s" if name in walls else ""
        print(f"{name:28s} reward gain {s['reward_gain']:+.3f}  held-out {curve} ({s['eval_rise']:+.3f})  "
              f"worst 5 steps' reward {s['reward_worst5']:.3f} (to step {s['reward_worst5_step']})  "
              f"staleness/kl_k3 {s['kl_k3_mean']:.1e} (max {s['kl_k3_max']:.1e})  max lag {s['lag_max']:.0f}{wall}")
    base = table.get((0, objectives[0]))
    base_rise = sum(s["eval_rise"] for s in base) / len(base) if base else 0.0
    print("\n| k | objective | seeds | reward gain | held-out rise | share of k = 0's rise | worst 5 steps' reward |"
          "\n|---|---|---|---|---|---|---|")
    for (k, objective), rows in table.items():
        gain = sum(s["reward_gain"] for s in rows) / len(rows)
        rise = sum(s["eval_rise"] for s in rows) / len(rows)
        worst = sum(s["reward_worst5"] for s in rows) / len(rows)
        # without k = 0 among the runs (an invocation of k > 0 only) there is no rise to compare with
        share = f"{rise / base_rise:.0%}" if base and base_rise else "–"
        print(f"| {k} | {'any (on-policy)' if k == 0 else objective} | {len(rows)} | {gain:+.3f} | {rise:+.3f} | "
              f"{share} | {worst:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", default="0,1,2,4", help="the staleness values (comma separated)")
    ap.add_argument("--objectives", default="behaviour_clip,decoupled,m2po")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=None, help="train.steps (default: the recipe's)")
    ap.add_argument("--parallel", type=int, default=2, help="runs side by side")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="an override for every run")
    ap.add_argument("--report", type=Path, default=None,
                    help="print the summary of the runs already in this folder (an earlier invocation's) and stop")
    args = ap.parse_args()
    ks = [int(x) for x in args.k.split(",")]
    objectives, seeds = args.objectives.split(","), [int(x) for x in args.seeds.split(",")]
    if args.report is not None:
        report(args.report, ks, objectives, seeds, {})
        return
    common = [*([f"train.steps={args.steps}"] if args.steps else []), "train.cpu_threads=1", *args.sets]
    out = Path(tempfile.mkdtemp(prefix="bench_staleness_"))
    queue = [command(out, k, o, s, common) for k, o, s in runs(ks, objectives, seeds)]
    t0, live, walls, failed = time.perf_counter(), {}, {}, []
    while queue or live:
        while queue and len(live) < args.parallel:
            name, cmd = queue.pop(0)
            log = open(out / f"{name}.log", "w")
            live[name] = (subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env={**os.environ, "WANDB_MODE": "disabled"}), time.perf_counter())
        time.sleep(1.0)
        for name, (proc, start) in list(live.items()):
            if proc.poll() is not None:
                walls[name] = time.perf_counter() - start
                if proc.returncode:
                    failed.append(name)
                del live[name]
    if failed:
        sys.exit(f"runs failed: {', '.join(failed)} (logs in {out})")
    print(f"runs in {out} ({time.perf_counter() - t0:.0f} s in all); {KEY} on the held-out test split")
    report(out, ks, objectives, seeds, walls)


if __name__ == "__main__":
    main()
