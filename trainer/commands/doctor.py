"""`parityrl doctor RECIPE` (or `--model PATH`): the recipe's engine and trainer on its model, precision and data,
the battery of checks (``trainer.doctor``), one table, ``doctor.json`` and plots in ``--out``, and an exit status a
CI can gate on (docs/doctor.md): 0 something passed and nothing failed, 2 the input was refused, 4 the engine cannot
load the model, 8 a check failed, 9 nothing was checked (no check passed or failed)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from parity.report import check_out_dir
from trainer.config import RecipeError
from trainer.diagnostics.doctor_report import table, write_json
from trainer.doctor.battery import exit_status, hook_checks, run_checks, select, summary
from trainer.doctor.context import Doctor
from trainer.io import third_party_output
from trainer.lifecycle.preflight import load_recipe

# A bare model (--model without a recipe) is examined with the demo recipe's settings and prompts.
DEFAULT_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "grpo_tiny.yaml"


def doctor_config(recipe: Optional[str], overrides: Sequence[str], model: Optional[str]):
    """The recipe with ``--set`` applied (``--model`` replaces ``model.path``); a ``RecipeError`` for bad input."""
    sets = list(overrides) + ([f"model.path={model}"] if model else [])
    return load_recipe(recipe or DEFAULT_RECIPE, sets)


def run_doctor(recipe: Optional[str], overrides: Sequence[str] = (), *, model: Optional[str] = None,
               out: str | Path = "doctor-report", only: Optional[Sequence[str]] = None, overwrite: bool = False,
               engine=None, say=None) -> int:
    """Run the battery and print its table; returns the exit status. ``engine``: an already started engine holding
    the recipe model's weights (tests), used and left open."""
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        cfg = doctor_config(recipe, overrides, model)
        checks = select(only)
        out = check_out_dir(out, overwrite)
    except RecipeError as e:
        print(e.lines("parityrl doctor: invalid recipe: "), file=sys.stderr)
        return 2
    except (ValueError, FileExistsError) as e:
        print(f"parityrl doctor: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    third_party_output.attach(out)  # when the console is filtered (the command line): engine.log in the report
    doc = Doctor(cfg, out, engine=engine, say=say, hook_checks=hook_checks(checks))
    try:
        findings, seconds = run_checks(doc, checks)
    finally:
        doc.close()
    status = exit_status(findings, doc.engine_error)
    header = {"recipe": str(recipe or DEFAULT_RECIPE), "model": cfg.model.path, "model_dir": doc.model_dir,
              "dtype": cfg.model.dtype, "precision": cfg.precision.recipe, "engine": cfg.rollout.engine,
              "device": doc.device, **({"engine_error": doc.engine_error} if doc.engine_error else {})}
    path = write_json(out, findings, status=status, header=header, seconds=seconds)
    print(f"=== parityrl doctor: {cfg.model.path} ({cfg.model.dtype}, precision {cfg.precision.recipe}, "
          f"{cfg.rollout.engine} engine) ===")
    print(table(findings))
    if doc.engine_error:
        print(f"the engine cannot load this model: {doc.engine_error}")
    print(f"{summary(findings, status)}; exit status {status}; report {path}")
    return status
