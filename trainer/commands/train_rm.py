"""`parityrl train-rm`: load the recipe and check it against its model and data, refuse to replace an output, train
the reward model (trainer.supervised.reward_model), and map how it ended to exit statuses (0 done; 2 the input was
refused)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from trainer.builtin.model_path import check_model_path, model_max_positions
from trainer.builtin.resolve import resolve_model_path
from trainer.config.schema import RecipeError
from trainer.config.supervised import RMConfig, read_rm_recipe, recipe_rule
from trainer.data.datasets import single_split_source
from trainer.io.outputs import refuse_existing_output
from trainer.supervised.reward_model import train_reward_model


def load_rm_recipe(path, overrides=(), *, check_paths: bool = True) -> RMConfig:
    """The recipe (trainer.config.supervised), then, with ``check_paths``, the rules that need its data and model."""
    cfg = read_rm_recipe(path, overrides)
    if check_paths:
        check_rm_paths(cfg, str(Path(path)))  # named as the loader names it
    return cfg


def check_rm_paths(cfg: RMConfig, where: str) -> None:
    """A single-file data source holds out rows (it has no second split); the model exists (or is a built-in) and
    a pair fits its context."""
    need = recipe_rule(where)
    d = cfg.data
    need(d.eval_split is None or not single_split_source(d.source), "data.eval_split", d.eval_split,
         f"null for {d.source!r}: a single file has one split, so the held-out rows must come from "
         "data.eval_fraction")
    check_model_path(cfg.model.path, where)
    max_pos = model_max_positions(cfg.model.path)
    need(max_pos is None or d.max_tokens <= max_pos, "data.max_tokens", d.max_tokens,
         f"at most the model's context of {max_pos} tokens")


def run_train_rm(cfg: RMConfig, *, resume: bool = False) -> Path:
    """Train a reward model per ``cfg`` and write it to ``cfg.out_path`` (atomically); returns that path.

    An existing non-empty ``output_dir`` is refused before anything loads: fail in seconds, not after training.
    """
    refuse_existing_output(cfg.out_path, "output_dir")
    return train_reward_model(cfg, resolve_model_path(cfg.model.path), resume=resume, console_log=True)


def run_train_rm_command(recipe: str, overrides: list[str], *, resume: bool) -> int:
    """`parityrl train-rm`: the exit status, the outcome on stderr / stdout."""
    try:
        cfg = load_rm_recipe(recipe, overrides)
        out = run_train_rm(cfg, resume=resume)
    except RecipeError as e:
        print(e.lines("parityrl: invalid recipe: "), file=sys.stderr)
        return 2
    except (FileExistsError, FileNotFoundError) as e:
        print(f"parityrl train-rm: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print(f"reward model written to {out}")
    return 0
