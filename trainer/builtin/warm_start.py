"""``builtin:tiny``: the tiny base after the supervised warm start ``parityrl sft recipes/sft_tiny.yaml``, built
once into the cache under a hash of the recipe's text and the base's build parameters."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from trainer.builtin.tiny import default_cache_dir, ensure_tiny_base, file_lock, tiny_base_dir
from trainer.config.supervised import read_sft_recipe
from trainer.supervised.sft import fit_sft

REPO_ROOT = Path(__file__).resolve().parents[2]
# Part of the cache key: a change to how the warm start trains (not only to its recipe) must rebuild it.
# 2: transformers.Trainer's loop and schedule (trainer.supervised.hf_trainer).
WARM_START_CODE_VERSION = b"2"
WARM_START_RECIPE = REPO_ROOT / "recipes" / "sft_tiny.yaml"
# The base the cache key hashes (tiny_base_dir), so the one the recipe must start from.
WARM_START_BASE = "builtin:tiny-base"


def warm_start_dir() -> Path:
    if not WARM_START_RECIPE.is_file():
        raise FileNotFoundError(f"{WARM_START_RECIPE}: the warm-start recipe of builtin:tiny is missing "
                                "(parityrl must be run from its source checkout / an editable install)")
    key = hashlib.sha256(WARM_START_RECIPE.read_bytes() + str(tiny_base_dir()).encode()
                         + WARM_START_CODE_VERSION).hexdigest()[:12]
    return default_cache_dir() / f"tiny-sft-{key}"


def ensure_warm_started_tiny() -> Path:
    out = warm_start_dir()
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Serialise builds between processes (two ranks, or a test session and a demo).
    with file_lock(out.parent / f".{out.name}.lock"):
        if (out / "config.json").is_file():  # another process finished it while we waited
            return out
        if launched_rank():
            _build_in_a_child()
        else:
            _build(out)
    return out


def _build(out: Path) -> None:
    """Train the warm start into ``out`` (the caller holds the build lock)."""
    print(f"building the default model (once): warm start {WARM_START_RECIPE.name} -> {out}", flush=True)
    # the stage's run directory (metrics.jsonl) is a scratch folder of the cache, no wandb run
    run_dir = out.parent / f".{out.name}.run-{os.getpid()}"
    cfg = read_sft_recipe(WARM_START_RECIPE, [f"output_dir={out}", f"logging.run_dir={run_dir}",
                                              "logging.wandb.mode=disabled"])
    if cfg.model.path != WARM_START_BASE:
        raise ValueError(f"{WARM_START_RECIPE}: model.path = {cfg.model.path!r}: expected {WARM_START_BASE!r} "
                         "(the warm start's cache key is that base's build)")
    try:
        # our cache, under the lock: a leftover without config.json is replaced (fit_sft writes atomically)
        fit_sft(cfg, str(ensure_tiny_base()))
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


def _build_in_a_child() -> None:
    """The warm start as one process, whatever launched this one (the caller holds the build lock)."""
    proc = subprocess.run([sys.executable, "-m", "trainer.builtin.warm_start"], cwd=REPO_ROOT,
                          env=single_process_env(dict(os.environ)))
    if proc.returncode:
        raise RuntimeError(f"building builtin:tiny's warm start ({WARM_START_RECIPE.name}) failed in its own process "
                           f"(exit {proc.returncode}); its output is above")


if __name__ == "__main__":  # the build itself, under the lock its parent holds (see _build_in_a_child)
    _build(warm_start_dir())
