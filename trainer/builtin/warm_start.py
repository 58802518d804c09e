"""The warm-started built-in models, each the tiny model after one supervised recipe, built once into the cache
under a hash of the recipe's text and of the model it starts from.

- ``builtin:tiny``: ``builtin:tiny-base`` after ``parityrl sft recipes/sft_tiny.yaml`` (the arithmetic task's
  completion format).
- ``builtin:tiny-tools``: ``builtin:tiny`` after ``parityrl sft recipes/sft_tools_tiny.yaml`` (multi-turn
  episodes of ``builtin:arithmetic_tools`` that call the calculator, ``data.messages_fn``).
- ``builtin:tiny-teacher``: ``builtin:tiny`` after ``parityrl sft recipes/sft_teacher_tiny.yaml`` (the same task,
  trained longer): an on-policy distillation teacher for the arithmetic task.
- ``builtin:tiny-tools-teacher``: ``builtin:tiny-tools`` after ``parityrl sft recipes/sft_tools_teacher_tiny.yaml``
  (the same episodes, trained longer): the on-policy distillation teacher of ``recipes/opd_tiny.yaml``.

Both budgets are short on purpose: RL starts from a poor but non-zero reward.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trainer.builtin.tiny import default_cache_dir, ensure_tiny_base, file_lock, tiny_base_dir
from trainer.config.supervised import read_sft_recipe
from trainer.supervised.sft import fit_sft

REPO_ROOT = Path(__file__).resolve().parents[2]
# Part of the cache key: a change to how the warm start trains (not only to its recipe) must rebuild it.
# 2: transformers.Trainer's loop and schedule (trainer.supervised.hf_trainer).
WARM_START_CODE_VERSION = b"2"


@dataclass(frozen=True)
class WarmStart:
    name: str  # the model.path that resolves to it
    recipe: Path
    base: str  # the model.path the recipe must start from: part of the cache key, so checked
    prefix: str  # of its cache directory's name
    what: str  # in the line printed while it builds
    # wall time per step on 2 idle CPU cores, said when the build starts (measured 2026-11-27 from an empty cache:
    # builtin:tiny's 300 steps 18 s, builtin:tiny-tools' 200 steps 46 s); None: only its progress lines are shown
    seconds_per_step: Optional[float] = None


WARM_STARTS = {w.name: w for w in (
    WarmStart("builtin:tiny", REPO_ROOT / "recipes" / "sft_tiny.yaml", "builtin:tiny-base", "tiny-sft",
              "the default model", seconds_per_step=18 / 300),
    WarmStart("builtin:tiny-tools", REPO_ROOT / "recipes" / "sft_tools_tiny.yaml", "builtin:tiny", "tiny-tools-sft",
              "builtin:tiny-tools", seconds_per_step=46 / 200),
    # the distillation teacher of recipes/opd_tiny.yaml (docs/distillation.md): builtin:tiny's tokenizer, trained longer
    WarmStart("builtin:tiny-teacher", REPO_ROOT / "recipes" / "sft_teacher_tiny.yaml", "builtin:tiny",
              "tiny-teacher-sft", "builtin:tiny-teacher"),
    # the teacher of recipes/opd_tiny.yaml's tool-using episodes: builtin:tiny-tools trained further
    WarmStart("builtin:tiny-tools-teacher", REPO_ROOT / "recipes" / "sft_tools_teacher_tiny.yaml",
              "builtin:tiny-tools", "tiny-tools-teacher-sft", "builtin:tiny-tools-teacher"),
)}
WARM_START_RECIPE = WARM_STARTS["builtin:tiny"].recipe
WARM_START_BASE = WARM_STARTS["builtin:tiny"].base


def _warm_start(name: str) -> WarmStart:
    if name not in WARM_STARTS:
        raise ValueError(f"{name!r} is not a warm-started built-in model; expected one of {', '.join(WARM_STARTS)}")
    return WARM_STARTS[name]


def _base_key(base: str) -> bytes:
    """What identifies the model a warm start starts from: its cache directory (itself named by a hash)."""
    if base == "builtin:tiny-base":
        return str(tiny_base_dir()).encode()
    return str(warm_start_dir(base)).encode()


def warm_start_dir(name: str = "builtin:tiny") -> Path:
    ws = _warm_start(name)
    if not ws.recipe.is_file():
        raise FileNotFoundError(f"{ws.recipe}: the warm-start recipe of {ws.name} is missing "
                                "(parityrl must be run from its source checkout / an editable install)")
    key = hashlib.sha256(ws.recipe.read_bytes() + _base_key(ws.base) + WARM_START_CODE_VERSION).hexdigest()[:12]
    return default_cache_dir() / f"{ws.prefix}-{key}"


def ensure_warm_started(name: str) -> Path:
    """The directory of the warm-started built-in ``name``, building it (and the model it starts from) first if
    it is not in the cache."""
    out = warm_start_dir(name)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Serialise builds between processes (two ranks, or a test session and a demo).
    with file_lock(out.parent / f".{out.name}.lock"):
        if (out / "config.json").is_file():  # another process finished it while we waited
            return out
        if launched_rank():
            _build_in_a_child(name)
        else:
            _build(name, out)
    return out


def ensure_warm_started_tiny() -> Path:
    return ensure_warm_started("builtin:tiny")


def _base_dir(base: str) -> Path:
    return ensure_tiny_base() if base == "builtin:tiny-base" else ensure_warm_started(base)


def _build(name: str, out: Path) -> None:
    """Train the warm start ``name`` into ``out`` (the caller holds its build lock)."""
    ws = _warm_start(name)
    base_dir = _base_dir(ws.base)  # before this one's line: a first run builds the chain in order
    # said before the first progress line so that a first run does not look hung (the SFT's own lines follow)
    steps = read_sft_recipe(ws.recipe, []).train.steps
    took = (f"about {ws.seconds_per_step * steps:.0f} s on 2 idle CPU cores" if ws.seconds_per_step
            else "its progress follows")
    print(f"building {ws.what} (once, into the model cache): warm start {ws.recipe.name}, {steps} supervised steps "
          f"({took}) -> {out}", flush=True)
    # the stage's run directory (metrics.jsonl) is a scratch folder of the cache, no wandb run
    run_dir = out.parent / f".{out.name}.run-{os.getpid()}"
    cfg = read_sft_recipe(ws.recipe, [f"output_dir={out}", f"logging.run_dir={run_dir}",
                                      "logging.wandb.mode=disabled"])
    if cfg.model.path != ws.base:
        raise ValueError(f"{ws.recipe}: model.path = {cfg.model.path!r}: expected {ws.base!r} "
                         f"(the warm start's cache key is that model's build)")
    try:
        # our cache, under the lock: a leftover without config.json is replaced (fit_sft writes atomically)
        fit_sft(cfg, str(base_dir))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


# What torchrun / accelerate launch put in a rank's environment. transformers.Trainer reads them (and the
# process group the rank has already joined), so the warm start would train as one of N ranks: its batch
# split over N (refused for sft_tiny.yaml's one micro-batch), while the other ranks wait on the build lock.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_PREFIXES = ("TORCHELASTIC_", "ACCELERATE_")


def launched_rank() -> bool:
    """Whether this process is one of several ranks started by a launcher."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def single_process_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without what a launcher sets for its ranks."""
    return {k: v for k, v in env.items() if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)}


def _build_in_a_child(name: str) -> None:
    """The warm start as one process, whatever launched this one (the caller holds the build lock)."""
    proc = subprocess.run([sys.executable, "-m", "trainer.builtin.warm_start", name], cwd=REPO_ROOT,
                          env=single_process_env(dict(os.environ)))
    if proc.returncode:
        raise RuntimeError(f"building {name}'s warm start ({_warm_start(name).recipe.name}) failed in its own "
                           f"process (exit {proc.returncode}); its output is above")


if __name__ == "__main__":  # the build itself, under the lock its parent holds (see _build_in_a_child)
    _name = sys.argv[1] if len(sys.argv) > 1 else "builtin:tiny"
    _build(_name, warm_start_dir(_name))
