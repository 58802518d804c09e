"""Learning per step, parityrl vs TRL's GRPOTrainer at the demo's settings (issue 48): the reward's rise per seed.

    PYTHONPATH=. python bench/learning/bench_learning_vs_trl.py --seeds 0 1 2 3 4 --steps 40 --schedule constant
    # TRL: pip install --no-deps 'trl==1.16.*'

The settings (recipes/grpo_tiny.yaml's, in float32): the built-in tiny model, LoRA r 16 alpha 32 on every linear
layer, the built-in arithmetic task's 64-problem pool (generated from the seed, as parityrl does) rendered with the
chat template, 16 prompts x 8 completions x 24 new tokens at temperature 1, lr 2e-3, no KL; TRL with loss_type
dapo (its default; parityrl's token_mean is the same normaliser) and HF generate, parityrl with its vLLM engine.
Everything else is each trainer's default: the point is what a user of either gets. Held-out evaluation is off.
The learning-rate schedule is the one default in which the two differ (TRL: Transformers' linear decay to 0,
parityrl: constant; docs/algorithms.md): ``--schedule constant|linear`` gives both trainers the same one.

Each run is a process of its own. The rise is the mean reward of the last 5 steps minus that of the first 5. A step
sees 16 of the pool's 64 problems, and which 16 moves its mean reward by about 0.07, so the rise of one run carries
that noise from its first and last windows' extra step; the epoch rise (the last 4 steps minus the first 4: whole
passes over the pool, so the problems' difficulty cancels) and the mean reward over all steps are printed beside it.
``--summarize`` prints the same from the per-step rewards a ``--work`` directory kept, without running anything.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Sequence

from trainer.builtin.resolve import resolve_model_path
from trainer.data.datasets import chat_messages, load_prompt_dataset
from trainer.models.policy import load_tokenizer

# bench_vs_trl (the speed comparison, bench/speed/) holds both sides' runners: this script reuses them
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "speed"))
from bench_vs_trl import run_parityrl, trl_grpo  # noqa: E402 - bench/speed/ on sys.path first

PROMPTS, GROUP, TOKENS, POOL, WINDOW = 16, 8, 24, 64, 5


def parityrl_rewards(seed: int, steps: int, work: Path, extra: Sequence[str] = (),
                     schedule: str | None = None) -> list[float]:
    sets = [f"train.steps={steps}", f"train.seed={seed}", "model.dtype=float32", "checkpoint.every=0",
            f"name=learning-vs-trl-{seed}", *([f"train.lr_schedule={schedule}"] if schedule else []), *extra]
    rows = run_parityrl(sets, work / f"parityrl-{seed}", log=work / f"parityrl-{seed}.log")
    return [r["reward/mean"] for r in rows if "reward/mean" in r]


def trl_rewards(seed: int, steps: int, work: Path, schedule: str | None = None) -> list[float]:
    """TRL in a process of its own (this script with --trl-worker); its per-step mean reward."""
    out = work / f"trl-{seed}.json"
    with open(work / f"trl-{seed}.log", "w") as log:
        subprocess.run([sys.executable, __file__, "--trl-worker", str(out), "--seeds", str(seed), "--steps", str(steps)]
                       + (["--schedule", schedule] if schedule else []),
                       check=True, stdout=log, stderr=subprocess.STDOUT)
    return json.loads(out.read_text())


def trl_worker(seed: int, steps: int, out: Path, schedule: str | None = None) -> None:
    """One TRL run; writes the list of its steps' mean rewards to ``out``."""
    from transformers import TrainerCallback

    tokenizer = load_tokenizer(resolve_model_path("builtin:tiny"))
    data = load_prompt_dataset("builtin:arithmetic", split="train", prompt_column="prompt", answer_column="answer",
                               num_examples=POOL, seed=seed, builtin_kwargs={})
    # conversational prompts: TRL renders them with the chat template, as parityrl's data.use_chat_template does
    data = data.map(lambda row: {"prompt": chat_messages(tokenizer, row["prompt"], None)})
    rewards: list[float] = []

    class Rewards(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    trl_grpo(out.parent, data, steps=steps, batch=PROMPTS * GROUP, tokens=TOKENS, seed=seed, callbacks=[Rewards()],
             lora={"r": 16, "lora_alpha": 32, "target_modules": "all-linear"},
             # recomputing activations changes no number, only the time
             gradient_checkpointing=False, **({"lr_scheduler_type": schedule} if schedule else {})).train()
    out.write_text(json.dumps(rewards))


def rise(rewards: list[float]) -> float:
    return statistics.mean(rewards[-WINDOW:]) - statistics.mean(rewards[:WINDOW])


def epoch_rise(rewards: list[float]) -> float:
    """The mean reward of the last pass over the pool minus the first's (``POOL // PROMPTS`` steps each)."""
    n = POOL // PROMPTS
    return statistics.mean(rewards[-n:]) - statistics.mean(rewards[:n])


STATISTICS = {"rise": rise, "epoch rise": epoch_rise, "mean reward": statistics.mean}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--only", choices=["parityrl", "trl"], help="run one trainer only")
    p.add_argument("--work", type=Path, help="keep each run's log and per-step rewards (<trainer>-<seed>.json) here "
                   "instead of a temporary directory")
    p.add_argument("--schedule", choices=["constant", "linear"],
                   help="the learning-rate schedule of both trainers (TRL's lr_scheduler_type, parityrl's "
                   "train.lr_schedule; no warm-up); default: each trainer's own (TRL linear, parityrl constant)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override for parityrl's runs (repeatable), e.g. train.lr_schedule=linear")
    p.add_argument("--summarize", action="store_true",
                   help="read each run's per-step rewards from --work instead of running")
    p.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        return trl_worker(args.seeds[0], args.steps, args.trl_worker, args.schedule)
    if args.summarize and not args.work:
        p.error("--summarize reads the runs of a --work directory: give it")
    if args.steps < 2 * WINDOW:
        p.error(f"--steps must be at least {2 * WINDOW} (the first and last {WINDOW} steps)")
    runs = {"parityrl": partial(parityrl_rewards, extra=args.set, schedule=args.schedule),
            "TRL": partial(trl_rewards, schedule=args.schedule)}
    if args.only:
        runs = {k: v for k, v in runs.items() if k.lower() == args.only}
    if args.summarize:
        runs = {name: partial(saved_rewards, name=name) for name in runs}
    try:
        import trl
    except ImportError:
        if "TRL" in runs and not args.summarize:
            print("TRL is not installed (pip install --no-deps trl): TRL's runs are skipped")
            runs.pop("TRL")
        trl = None
    print(f"{PROMPTS} prompts x {GROUP} completions x {TOKENS} tokens, tiny model fp32, LoRA r 16 all-linear, lr 2e-3, "
          f"{args.steps} steps, lr schedule {args.schedule or 'each trainer default (TRL linear, parityrl constant)'}; "
          f"rise = mean reward of the last {WINDOW} steps - the first {WINDOW}"
          + (f"; parityrl with {' '.join(args.set)}" if args.set else "")
          + (f"; TRL {trl.__version__}" if trl else ""), flush=True)
    values: dict[str, dict[str, list[float]]] = {stat: {k: [] for k in runs} for stat in STATISTICS}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            line = [f"seed {seed}:"]
            for name, fn in runs.items():
                r = fn(seed, args.steps, work)
                (work / f"{name.lower()}-{seed}.json").write_text(json.dumps(r))
                for stat, f in STATISTICS.items():
                    values[stat][name].append(f(r))
                line.append(f"{name} {r[0]:.2f}..{r[-1]:.2f} rise {rise(r):+.3f} (epoch rise {epoch_rise(r):+.3f}, "
                            f"mean {statistics.mean(r):.3f})")
            print("  ".join(line), flush=True)
    for stat, by_trainer in values.items():
        means = {k: statistics.mean(v) for k, v in by_trainer.items()}
        print(f"{stat}: " + "  ".join(f"{k} {means[k]:+.3f}{standard_error(v)}" for k, v in by_trainer.items())
              + (f"  parityrl / TRL {means['parityrl'] / means['TRL']:.2f}" if len(means) == 2 else ""))


def saved_rewards(seed: int, steps: int, work: Path, name: str) -> list[float]:
    """The per-step rewards a run of ``name`` (parityrl, TRL) with ``seed`` left in ``work``."""
    path = work / f"{name.lower()}-{seed}.json"
    if not path.is_file():
        raise SystemExit(f"{path}: no such run (run it first with --work {work})")
    r = json.loads(path.read_text())
    if len(r) != steps:
        raise SystemExit(f"{path}: {len(r)} steps, expected --steps {steps}")
    return r


def standard_error(values: list[float]) -> str:
    """`` ± s/sqrt(n)`` of a mean over seeds: each run samples differently, so seed-to-seed spread is the noise a
    difference between the two trainers must exceed."""
    return f" ± {statistics.stdev(values) / len(values) ** 0.5:.3f}" if len(values) > 1 else ""


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
