"""On-policy distillation against GRPO on the task reward alone, same budget: the student's held-out mean@k.

    python bench/learning/bench_opd.py [--steps N] [--set key=value ...]     (N: the recipe's train.steps unless given)

Three runs of ``parityrl train`` through the real CLI, each in a process of its own:

* ``teacher``: the recipe's ``teacher.path``'s held-out figures (the evaluation before step 1 of a 1-step run);
* ``opd``: ``recipes/opd_tiny.yaml`` (the student ``builtin:tiny-tools`` distilled from ``builtin:tiny-tools-teacher``);
* ``grpo``: the same recipe with ``algorithm.name=grpo`` and no teacher (the task reward alone).

``opd`` and ``grpo`` run side by side (the same machine load for both). Prints the student's eval/mean@k before
and after each, the teacher's, the share of the student-teacher gap each closed, wall time, and the opd run's
distill/* and teacher_parity/* (the run's precision: bf16 unless --set model.dtype=float32).
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

from trainer.config.load import read_recipe

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "opd_tiny.yaml"
KEY = "eval/mean@4"


def launch(name: str, out: Path, overrides: list[str]) -> subprocess.Popen:
    sets = [f"name={name}", f"logging.run_dir={out / name}", "logging.wandb.mode=disabled", "checkpoint.every=0",
            *overrides]
    cmd = [sys.executable, "-m", "trainer.cli", "train", str(RECIPE)] + [a for s in sets for a in ("--set", s)]
    log = open(out / f"{name}.log", "w")
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "WANDB_MODE": "disabled"})


def records(out: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]


def evals(rows: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r[KEY]) for r in rows if KEY in r]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=None, help="train.steps of both runs (default: the recipe's)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="an override for both runs")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench_opd_"))
    common = [*([f"train.steps={args.steps}"] if args.steps else []), *args.sets]
    teacher_path = read_recipe(RECIPE, args.sets).teacher.path
    t0 = time.perf_counter()
    teacher = launch("teacher", out, [*common, "train.steps=1", "algorithm.name=grpo", "teacher.path=null",
                                      f"model.path={teacher_path}"])
    if teacher.wait():
        sys.exit(f"teacher run failed: {out / 'teacher.log'}")
    starts = {}
    procs = {}
    for name, extra in (("opd", []), ("grpo", ["algorithm.name=grpo", "teacher.path=null"])):
        starts[name] = time.perf_counter()
        procs[name] = launch(name, out, [*common, *extra])
    walls = {}
    for name, p in procs.items():
        if p.wait():
            for other in procs.values():  # the side-by-side run would go on alone, holding the cores
                other.kill()
            sys.exit(f"{name} run failed: {out / (name + '.log')}")
        walls[name] = time.perf_counter() - starts[name]
    teacher_k = evals(records(out, "teacher"))[0][1]
    print(f"runs in {out} ({time.perf_counter() - t0:.0f} s in all); {KEY} on the held-out test split")
    print(f"teacher {teacher_path}: {teacher_k:.3f}")
    for name in procs:
        rows = records(out, name)
        e = evals(rows)
        (s0, first), (s1, last) = e[0], e[-1]
        gap = teacher_k - first
        closed = (last - first) / gap if gap else float("nan")
        print(f"{name:5s} step {s0} {first:.3f} -> step {s1} {last:.3f}  ({' '.join(f'{v:.3f}' for _, v in e)}); "
              f"gap to the teacher closed {closed:+.0%}; wall {walls[name]:.0f} s")
    rows = [r for r in records(out, "opd") if "distill/reverse_kl" in r]
    first, last = rows[0], rows[-1]
    par = [r for r in rows if "teacher_parity/mae" in r]
    print(f"opd distill/reverse_kl {first['distill/reverse_kl']:.4f} -> {last['distill/reverse_kl']:.4f}, "
          f"top1_agree {first.get('distill/top1_agree', float('nan')):.3f} -> "
          f"{last.get('distill/top1_agree', float('nan')):.3f}")
    if par:  # the steps that measured the teacher's numerics (the probe's)
        mae = [r["teacher_parity/mae"] for r in par]
        noise = [r["distill/teacher_noise_frac"] for r in par]
        print(f"opd teacher_parity/mae mean {sum(mae) / len(mae):.2e} max {max(mae):.2e}; teacher_noise_frac mean "
              f"{sum(noise) / len(noise):.3f} max {max(noise):.3f} ({len(par)} steps measured)")


if __name__ == "__main__":
    main()
