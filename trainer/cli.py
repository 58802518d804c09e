"""`parityrl` command line: train, sft.

    parityrl train recipes/grpo_tiny.yaml [--set train.steps=5 ...] [--resume]
    parityrl sft recipes/sft_tiny.yaml [--set ...]
    accelerate launch -m trainer.train recipes/grpo_tiny.yaml [--set ...]

Recipes are validated before any model or engine starts; a bad recipe exits
with status 2 and one line naming the file, key, value and expectation.
"""
from __future__ import annotations

import argparse
import os
import sys

from trainer.config import RecipeError


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="path to a YAML recipe (see recipes/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set train.steps=5 (repeatable; values parsed as YAML)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parityrl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="RL training (GRPO) with vLLM rollouts and per-step parity metrics")
    _add_recipe_args(t)
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the run directory")
    s = sub.add_parser("sft", help="supervised fine-tuning (the warm start before RL)")
    _add_recipe_args(s)
    return parser


def run_train(argv: list[str] | None = None, prog: str = "parityrl train") -> int:
    p = argparse.ArgumentParser(prog=prog)
    _add_recipe_args(p)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    return _train(args)


def _train(args) -> int:
    from trainer.config import load_recipe

    try:
        cfg = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        print(f"parityrl: invalid recipe: {e}", file=sys.stderr)
        return 2
    from trainer.loop import ParityLimitExceeded, train

    try:
        train(cfg, resume=args.resume)
    except (FileExistsError, FileNotFoundError) as e:  # run-directory state: a user decision, not a crash
        print(f"parityrl: {e}", file=sys.stderr)
        return 2
    except ParityLimitExceeded as e:
        print(f"parityrl: stopped: {e}", file=sys.stderr)
        return 3
    return 0


def _sft(args) -> int:
    from trainer.sft import load_sft_recipe, run_sft

    try:
        cfg = load_sft_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        print(f"parityrl: invalid recipe: {e}", file=sys.stderr)
        return 2
    out = run_sft(cfg)
    print(f"sft model written to {out}")
    return 0


def quiet_third_party() -> None:
    """Keep the console for parityrl's progress lines; engines' own logs stay available by setting the variables."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> int:
    # vLLM runs in this process next to the trainer; its V1 engine must not fork a
    # worker process (set before vllm is imported anywhere).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    quiet_third_party()
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return _train(args)
    return _sft(args)


if __name__ == "__main__":
    sys.exit(main())
