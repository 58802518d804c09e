"""Learning at staleness: the demo task at rollout.max_staleness k, each off-policy objective, several seeds.

    python bench/learning/bench_staleness.py [--k 0,1,2,4] [--objectives behaviour_clip,decoupled,m2po]
        [--seeds 0,1,2] [--steps N] [--parallel 2] [--set key=value ...]

Each run is ``parityrl train recipes/grpo_tools_tiny.yaml`` through the real CLI, in a process of its own, with
``rollout.max_staleness=k``, ``algorithm.off_policy=<objective>`` and ``train.seed=<seed>``; ``--parallel`` runs
side by side, each on ``train.cpu_threads=1`` (the same machine load for all). At k = 0 the objectives are one
update (each reduces to the on-policy surrogate), so k = 0 runs once per seed. Prints every run's reward gain
(mean of the last 5 steps minus the first 5) and held-out eval/mean@4 before and after, then per (k, objective)
the means over seeds and the held-out rise as a share of k = 0's: AReaL's question (arXiv 2505.24298) of whether
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


def summary(out: Path, name: str) -> dict:
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0 and "reward/mean" in r]
    rewards = [r["reward/mean"] for r in steps]
    evals = [r[KEY] for r in rows if KEY in r]
    return {"reward_gain": sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5, "eval_first": evals[0], "eval_last": evals[-1],
            "eval_rise": evals[-1] - evals[0],
            "lag_max": max((r.get("staleness/lag", 0.0) for r in steps), default=0.0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", default="0,1,2,4", help="the staleness values (comma separated)")
    ap.add_argument("--objectives", default="behaviour_clip,decoupled,m2po")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=None, help="train.steps (default: the recipe's)")
    ap.add_argument("--parallel", type=int, default=2, help="runs side by side")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="an override for every run")
    args = ap.parse_args()
    ks = [int(x) for x in args.k.split(",")]
    objectives, seeds = args.objectives.split(","), [int(x) for x in args.seeds.split(",")]
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
    table: dict[tuple[int, str], list[dict]] = {}
    for k, objective, seed in runs(ks, objectives, seeds):
        name = f"k{k}_{objective}_s{seed}"
        s = summary(out, name)
        table.setdefault((k, objective), []).append(s)
        print(f"{name:28s} reward gain {s['reward_gain']:+.3f}  held-out {s['eval_first']:.3f} -> {s['eval_last']:.3f} "
              f"({s['eval_rise']:+.3f})  max lag {s['lag_max']:.0f}  wall {walls[name]:.0f} s")
    base = table.get((0, objectives[0]))
    base_rise = sum(s["eval_rise"] for s in base) / len(base) if base else float("nan")
    print("\n| k | objective | seeds | reward gain | held-out rise | share of k = 0's rise |\n|---|---|---|---|---|---|")
    for (k, objective), rows in table.items():
        gain = sum(s["reward_gain"] for s in rows) / len(rows)
        rise = sum(s["eval_rise"] for s in rows) / len(rows)
        share = rise / base_rise if base_rise else float("nan")
        print(f"| {k} | {'any (on-policy)' if k == 0 else objective} | {len(rows)} | {gain:+.3f} | {rise:+.3f} | "
              f"{share:.0%} |")


if __name__ == "__main__":
    main()
