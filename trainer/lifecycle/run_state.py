"""A run directory's own state: its writer, its recorded recipe, which checkpoint a resume takes.

- A write of the run directory's first files that fails (a full disk at the start: the lock,
  ``recipe.yaml``) raises ``write_failure.StartNotWritten``, exit status 6 with one sentence.
- ``claim_run_dir``: the lock (one writer, trainer/io/run_lock.py), then the partial
  ``.tmp_step_*`` folders of unfinished checkpoint writes are removed, and a resume's
  recipe is compared with the recorded one (refused before anything loads).
- ``recipe.yaml``: the resolved recipe the run started with (``to_dict``), written once;
  ``recipe_changes.jsonl``: one line per resume, the step and every key that changed.
- A resume applies every changed key, printing each (``resuming with train.learning_rate
  0.05 (was 0.002)``), except ``REFUSED``: keys that would make the checkpoint
  meaningless. Keys of the optimizer's state (``OPTIMIZER_KEYS``) are written into the
  restored optimizer and schedule (otherwise the restored state would silently win); the
  others are read from the recipe every step anyway.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import yaml

from trainer.config import RunConfig, to_dict
from trainer.io import checkpoint as ckpt
from trainer.io.run_lock import LOCK_FILE, RunLock, RunStateError, check_free, claim
from trainer.io.write_failure import writing_at_start

RECIPE_FILE = "recipe.yaml"
CHANGES_FILE = "recipe_changes.jsonl"

# key (or section prefix ending in '.') -> why a resume cannot change it
REFUSED = {
    "model.": "the checkpoint's adapter belongs to this model, dtype and LoRA shape",
    "algorithm.name": "the checkpoint's optimizer (and critic) state was built by this algorithm",
    "algorithm.group_size": "the data position and per-step sample seeds are counted in groups of this size",
    "precision.recipe": "the adapter was trained under this precision recipe (FP8 layers are part of the model)",
    "data.": "the checkpoint's data position indexes this dataset",
    "rollout.max_staleness": "a checkpoint of an off-policy run holds the next k batches and their behaviour adapters",
    "rollout.prompts_per_step": "the checkpoint's data position counts batches of this size",
    "train.seed": "the data order and mini-batch shuffles of the run derive from it",
}
# The run's location: the same by definition when resuming it.
IGNORED = ("name", "logging.run_dir")
OPTIMIZER_KEYS = ("train.learning_rate", "train.weight_decay", "train.adam_betas")


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _refusal(key: str) -> Optional[str]:
    for k, why in REFUSED.items():
        if key == k or (k.endswith(".") and key.startswith(k)):
            return why
    return None


def recorded_recipe(run_dir: Path) -> Optional[dict[str, Any]]:
    """The flat recipe the run uses now: ``recipe.yaml`` with every recorded resume's changes; None if unrecorded."""
    path = Path(run_dir) / RECIPE_FILE
    if not path.is_file():
        return None
    flat = _flat(yaml.safe_load(path.read_text()) or {})
    changes = Path(run_dir) / CHANGES_FILE
    for line in changes.read_text().splitlines() if changes.is_file() else []:
        for key, c in json.loads(line)["changes"].items():
            flat[key] = c["now"]
    return flat


def resume_changes(cfg: RunConfig) -> list[tuple[str, Any, Any]]:
    """(key, was, now) of each key this resume changes; RunStateError naming the refused ones."""
    was = recorded_recipe(cfg.run_dir)
    if was is None:
        return []
    now = _flat(to_dict(cfg))
    changes = [(k, was.get(k), now.get(k)) for k in sorted(set(was) | set(now))
               if k not in IGNORED and was.get(k) != now.get(k)]
    refused = [f"{k} {now_v!r} (was {was_v!r}): {_refusal(k)}" for k, was_v, now_v in changes if _refusal(k)]
    if refused:
        raise RunStateError(f"{cfg.run_dir}: --resume cannot change " + "; ".join(refused)
                            + f" (the run's recipe: {cfg.run_dir / RECIPE_FILE}; start a new run to change these)")
    return changes


def check_run_dir(cfg: RunConfig, *, resume: bool) -> None:
    """A resume needs a usable checkpoint, a fresh run a directory without one (one line each, exit status 2);
    a directory another process runs on is named as such first."""
    check_free(cfg.run_dir)
    if resume:
        choose_checkpoint(cfg.run_dir, verbose=False)
    else:
        refuse_existing_run(cfg)


def refuse_existing_run(cfg: RunConfig) -> int:
    """A fresh run's directory holds no checkpoint: its start step, 0; else ``FileExistsError`` (nothing written)."""
    if ckpt.step_dirs(cfg.run_dir):
        raise FileExistsError(existing_run_message(cfg, "pass --resume to continue it"))
    return 0


def existing_run_message(cfg: RunConfig, resume_hint: str) -> str:
    """Why a fresh run cannot start over the checkpoints in its directory, with the way out that fits: the resume
    (``resume_hint``) for the same recipe, a name of its own for one that changes what a resume cannot (another
    model, algorithm, ...: ``REFUSED``)."""
    was = recorded_recipe(cfg.run_dir) or {}
    now = _flat(to_dict(cfg))
    other = [f"{k} {now.get(k)!r} (it ran {was[k]!r})" for k in sorted(was)  # what the recorded recipe says
             if k not in IGNORED and was[k] != now.get(k) and _refusal(k)]
    if other:
        return (f"{cfg.run_dir} already holds the checkpoints of another run: this one changes {'; '.join(other[:3])}, "
                "which a resume cannot; give it a name of its own (--set name=<new name>) or another "
                "logging.run_dir (nothing was overwritten)")
    return f"{cfg.run_dir} already holds checkpoints: {resume_hint}, or choose another name / logging.run_dir " \
           "(nothing was overwritten)"


def claim_run_dir(cfg: RunConfig, *, resume: bool) -> RunLock:
    """Lock the run directory, remove partial checkpoint folders, refuse a resume that changes a refused key."""
    with writing_at_start(cfg.run_dir, Path(cfg.run_dir) / LOCK_FILE):  # the run directory's first writes
        lock = claim(cfg.run_dir)
    try:
        if lock.note:
            print(lock.note, flush=True)
        for p in ckpt.remove_partial_checkpoints(cfg.run_dir) if lock.held else []:
            print(f"note: removed {p}, the partial folder of a checkpoint write that never finished", flush=True)
        if resume:
            resume_changes(cfg)
    except BaseException:
        lock.release()
        raise
    return lock


def choose_checkpoint(run_dir: Path, *, verbose: bool) -> Path:
    """The newest verified checkpoint; notes for the newer ones skipped; FileNotFoundError (one line) if none."""
    path, skipped = ckpt.usable_checkpoint(run_dir)
    if path is None:
        why = "; ".join(f"{p.name}: {w}" for p, w in skipped) or "there is none"
        raise FileNotFoundError(f"--resume: no usable checkpoint under {ckpt.checkpoints_dir(run_dir)} ({why})")
    for p, why in skipped if verbose else []:
        print(f"note: skipped {p} ({why}); resuming from the newest complete one, {path.name}", flush=True)
    return path


def record_recipe(run, *, resumed: bool) -> None:
    """Fresh run: write ``recipe.yaml``. Resume: apply and print each change, append it to ``recipe_changes.jsonl``."""
    cfg: RunConfig = run.cfg
    run_dir = Path(cfg.run_dir)
    first = not (run_dir / RECIPE_FILE).is_file()
    changes = resume_changes(cfg) if resumed and not first else []
    _apply_to_optimizer(cfg, run.optimizer, run.scheduler, [k for k, _, _ in changes])
    if not run.is_main:
        return
    if not resumed or first:
        if resumed:
            print(f"note: {run_dir} has no {RECIPE_FILE} (an older run); recording this resume's recipe", flush=True)
        with writing_at_start(run_dir, run_dir / RECIPE_FILE):
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / RECIPE_FILE).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return
    for key, was, now in changes:
        print(f"resuming with {key} {now!r} (was {was!r})", flush=True)
    with writing_at_start(run_dir, run_dir / CHANGES_FILE), open(run_dir / CHANGES_FILE, "a") as f:
        f.write(json.dumps({"resumed_at_step": run.start_step, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                            "changes": {k: {"was": was, "now": now} for k, was, now in changes}}) + "\n")


def _apply_to_optimizer(cfg: RunConfig, optimizer, scheduler, keys: list[str]) -> None:
    """Write changed optimizer hyper-parameters over the restored state (LR through the schedule's base)."""
    t = cfg.train
    if "train.learning_rate" in keys:
        scheduler.base_lrs = [t.learning_rate for _ in scheduler.base_lrs]
        factors = [f(scheduler.last_epoch) for f in scheduler.lr_lambdas]
        for group, factor in zip(optimizer.param_groups, factors):
            group["initial_lr"] = t.learning_rate
            group["lr"] = t.learning_rate * factor
        scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    for group in optimizer.param_groups:
        if "train.weight_decay" in keys:
            group["weight_decay"] = t.weight_decay
        if "train.adam_betas" in keys:
            group["betas"] = tuple(t.adam_betas)
