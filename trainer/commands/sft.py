"""`parityrl sft`: load the recipe and check it against its model, refuse to replace an output by accident, run the
SFT stage (trainer.supervised.sft), and map how it ended to exit statuses (0 done; 2 the input was refused)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from trainer.builtin.model_path import check_model_path, model_max_positions
from trainer.builtin.resolve import resolve_model_path
from trainer.config.schema import RecipeError
from trainer.config.supervised import SFTConfig, read_sft_recipe, recipe_rule
from trainer.io.outputs import refuse_existing_output
from trainer.supervised.sft import fit_sft


def load_sft_recipe(path, overrides=(), *, check_paths: bool = True) -> SFTConfig:
    """The recipe (trainer.config.supervised), then, with ``check_paths``, the rules that need its model."""
    cfg = read_sft_recipe(path, overrides)
    if check_paths:
        check_sft_paths(cfg, str(Path(path)))  # named as the loader names it
    return cfg


def check_sft_paths(cfg: SFTConfig, where: str) -> None:
    """The model exists (or is a built-in), and a packed block fits its context."""
    check_model_path(cfg.model.path, where)
    max_pos = model_max_positions(cfg.model.path)
    d = cfg.data
    recipe_rule(where)(not d.packing or max_pos is None or d.block_size <= max_pos, "data.block_size", d.block_size,
                       f"at most the model's context of {max_pos} tokens")


def run_sft(cfg: SFTConfig, *, overwrite: bool = False, resume: bool = False) -> Path:
    """Train and write the model to ``cfg.out_path``; returns that path.

    An existing non-empty ``output_dir`` is refused before anything loads (a previous
    model is never replaced by accident, as ``train-rm`` and ``merge`` do); with
    ``overwrite`` it is replaced, atomically, once the new model is complete. ``resume``
    continues from the newest checkpoint under ``logging.run_dir`` (``train.save_every``).
    """
    if not overwrite:
        refuse_existing_output(cfg.out_path, "output_dir")
    return fit_sft(cfg, resolve_model_path(cfg.model.path), resume=resume, console_log=True)


def run_sft_command(recipe: str, overrides: list[str], *, overwrite: bool, resume: bool) -> int:
    """`parityrl sft`: the exit status, the outcome on stderr / stdout."""
    try:
        cfg = load_sft_recipe(recipe, overrides)
        out = run_sft(cfg, overwrite=overwrite, resume=resume)
    except RecipeError as e:  # the recipe, or data that does not fit it (e.g. fewer tokens than one packed block)
        print(e.lines("parityrl: invalid recipe: "), file=sys.stderr)
        return 2
    except FileExistsError as e:
        print(f"parityrl sft: {e}" + ("" if "--resume" in str(e) else " (or pass --overwrite)"), file=sys.stderr)
        return 2
    except FileNotFoundError as e:  # --resume without a checkpoint
        print(f"parityrl sft: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":  # under torchrun / accelerate launch, rank 0 wrote it
        print(f"sft {'adapter' if cfg.output_format == 'adapter' else 'model'} written to {out}")
    return 0
