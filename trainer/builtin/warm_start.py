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
- ``builtin:tiny-vl``: ``builtin:zoo-idefics3`` after ``parityrl sft recipes/sft_vl_tiny.yaml`` (counting shapes in
  images, labels half drawn at random): the vision-language model of ``recipes/grpo_vl_tiny.yaml``.

``builtin:tiny`` and ``builtin:tiny-teacher`` are short on purpose: RL starts from a poor but non-zero reward.
``builtin:tiny-tools`` is trained until its tool-using episodes converge (a shorter build came out a different model
per build seed and per host; ``recipes/sft_tools_tiny.yaml`` says what was measured): what RL has left to learn
there is to call the tool on the quarter of problems the warm start answers by guessing.

Cached under a key of everything that decides the model (``build_key``): the recipe's text (its dtype and
schedule included), the cache name of the model it starts from (itself such a key, not a path: a checkout moved
elsewhere reuses its builds), the source of the data functions and the dataset it trains on, and the supervised
trainer's code. A build is judged before it is cached (``trainer.builtin.warm_start_floor``): one whose held-out
greedy accuracy on its task is under its documented floor fails with one line.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trainer.builtin.tiny import default_cache_dir, ensure_tiny_base, file_lock, tiny_base_dir
from trainer.builtin.zoo_vl import TINY_VL_NAME, VL_MODEL_NAME, ensure_vl_model, vl_model_dir
from trainer.config.supervised import read_sft_recipe
from trainer.data.tasks import BUILTIN_DATASETS
from trainer.supervised.sft import fit_sft

REPO_ROOT = Path(__file__).resolve().parents[2]
# Part of the cache key: a change to how the warm start trains that its code does not show must rebuild it.
# 2: transformers.Trainer's loop and schedule (trainer.supervised.hf_trainer).
WARM_START_CODE_VERSION = b"2"
# The build code in the key: the supervised trainer (its loop, schedule, loss and data rendering).
BUILD_CODE = tuple(sorted((REPO_ROOT / "trainer" / "supervised").glob("*.py")))


@dataclass(frozen=True)
class WarmStart:
    name: str  # the model.path that resolves to it
    recipe: Path
    base: str  # the model.path the recipe must start from: part of the cache key, so checked
    prefix: str  # of its cache directory's name
    what: str  # in the line printed while it builds
    # wall time per step on 2 idle CPU cores, said when the build starts (measured from an empty cache: builtin:tiny's
    # 300 steps 18 s (2026-11-27), builtin:tiny-tools' 200 steps 69 s (2026-11-29)); None: only its progress lines
    seconds_per_step: Optional[float] = None
    # the RL recipe whose held-out rows judge the build, and the greedy accuracy on them the build must reach
    # before it is cached (trainer.builtin.warm_start_floor; docs/models.md says how each floor was set)
    floor_recipe: Optional[Path] = None
    floor_greedy: float = 0.0


# The floors (held-out greedy accuracy, Hugging Face engine in float32, on the named RL recipe's eval rows) catch a
# broken build -- a data function or trainer edit that teaches nothing -- and pass every build seen working. Measured
# on a 2-core AVX2-only x86 CPU (2026-11-29): builtin:tiny 0.375 (32 rows), builtin:tiny-teacher 0.500; builtin:tiny-tools
# 0.953 / 0.938 / 0.953 for build seeds 0 / 1 / 2 (64 rows), builtin:tiny-tools-teacher 0.969 (bench/RESULTS.md "The
# tools warm start"). builtin:tiny-tools' floor refuses what a 200-step build of it gave on some seeds and hosts
# (0.20-0.67), which RL could not lift or unlearnt the tool from: such a build is a host or seed on which the warm
# start did not converge, and says so in one line instead of handing the demo a model it cannot learn from.
_GRPO_TINY = REPO_ROOT / "recipes" / "grpo_tiny.yaml"
_GRPO_TOOLS_TINY = REPO_ROOT / "recipes" / "grpo_tools_tiny.yaml"
WARM_STARTS = {w.name: w for w in (
    WarmStart("builtin:tiny", REPO_ROOT / "recipes" / "sft_tiny.yaml", "builtin:tiny-base", "tiny-sft",
              "the default model", seconds_per_step=18 / 300, floor_recipe=_GRPO_TINY, floor_greedy=0.10),
    WarmStart("builtin:tiny-tools", REPO_ROOT / "recipes" / "sft_tools_tiny.yaml", "builtin:tiny", "tiny-tools-sft",
              "builtin:tiny-tools", seconds_per_step=69 / 200, floor_recipe=_GRPO_TOOLS_TINY, floor_greedy=0.75),
    # the distillation teacher of recipes/opd_tiny.yaml (docs/distillation.md): builtin:tiny's tokenizer, trained longer
    WarmStart("builtin:tiny-teacher", REPO_ROOT / "recipes" / "sft_teacher_tiny.yaml", "builtin:tiny",
              "tiny-teacher-sft", "builtin:tiny-teacher", floor_recipe=_GRPO_TINY, floor_greedy=0.20),
    # the teacher of recipes/opd_tiny.yaml's tool-using episodes: builtin:tiny-tools trained further
    WarmStart("builtin:tiny-tools-teacher", REPO_ROOT / "recipes" / "sft_tools_teacher_tiny.yaml",
              "builtin:tiny-tools", "tiny-tools-teacher-sft", "builtin:tiny-tools-teacher", floor_recipe=_GRPO_TOOLS_TINY,
              floor_greedy=0.75),
    # the vision-language model of recipes/grpo_vl_tiny.yaml: builtin:zoo-idefics3 taught to count shapes on labels
    # half of which are drawn at random, so that it answers right about 5 times in 8 when it samples; judged on vLLM
    # in float32 (images): the build read 0.922 greedy, the untrained model 0.016 (64 rows, 2026-11-30)
    WarmStart(TINY_VL_NAME, REPO_ROOT / "recipes" / "sft_vl_tiny.yaml", VL_MODEL_NAME, "tiny-vl-sft",
              "builtin:tiny-vl", floor_recipe=REPO_ROOT / "recipes" / "grpo_vl_tiny.yaml", floor_greedy=0.75),
)}
WARM_START_RECIPE = WARM_STARTS["builtin:tiny"].recipe
WARM_START_BASE = WARM_STARTS["builtin:tiny"].base


def _warm_start(name: str) -> WarmStart:
    if name not in WARM_STARTS:
        raise ValueError(f"{name!r} is not a warm-started built-in model; expected one of {', '.join(WARM_STARTS)}")
    return WARM_STARTS[name]


def _base_key(base: str) -> bytes:
    """What identifies the model a warm start starts from: its cache directory's name (itself a hash of what
    decides it), not its path."""
    if base == "builtin:tiny-base":
        return tiny_base_dir().name.encode()
    if base == VL_MODEL_NAME:
        return vl_model_dir().name.encode()
    return warm_start_dir(base).name.encode()


def data_code(recipe: Path) -> list[Path]:
    """The source files of what the recipe's data is made by: its ``data.completion_fn`` / ``data.messages_fn``
    modules and its built-in dataset's."""
    d = read_sft_recipe(recipe, []).data
    modules = {fn.partition(":")[0] for fn in (d.completion_fn, d.messages_fn) if fn}
    if d.source.startswith("builtin:") and d.source.removeprefix("builtin:") in BUILTIN_DATASETS:
        modules.add(BUILTIN_DATASETS[d.source.removeprefix("builtin:")].__module__)
    return sorted(Path(inspect.getsourcefile(importlib.import_module(m))) for m in modules)


def build_key(name: str) -> str:
    """The cache key of the warm start ``name`` (module docstring): 12 hex digits of SHA-256."""
    ws = _warm_start(name)
    h = hashlib.sha256()
    for part in (ws.recipe.read_bytes(), _base_key(ws.base), WARM_START_CODE_VERSION,
                 *(f.read_bytes() for f in data_code(ws.recipe) + list(BUILD_CODE))):
        h.update(hashlib.sha256(part).digest())  # each part hashed alone: no two splits of the bytes collide
    return h.hexdigest()[:12]


def warm_start_dir(name: str = "builtin:tiny") -> Path:
    ws = _warm_start(name)
    if not ws.recipe.is_file():
        raise FileNotFoundError(f"{ws.recipe}: the warm-start recipe of {ws.name} is missing "
                                "(parityrl must be run from its source checkout / an editable install)")
    return default_cache_dir() / f"{ws.prefix}-{build_key(name)}"


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
    if base == "builtin:tiny-base":
        return ensure_tiny_base()
    if base == VL_MODEL_NAME:
        return ensure_vl_model()
    return ensure_warm_started(base)


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
    # the stage's run directory (metrics.jsonl) and the model before its floor is checked: scratch folders of the
    # cache, no wandb run
    run_dir = out.parent / f".{out.name}.run-{os.getpid()}"
    built = out.parent / f".{out.name}.unchecked-{os.getpid()}"
    cfg = read_sft_recipe(ws.recipe, [f"output_dir={built}", f"logging.run_dir={run_dir}",
                                      "logging.wandb.mode=disabled"])
    if cfg.model.path != ws.base:
        raise ValueError(f"{ws.recipe}: model.path = {cfg.model.path!r}: expected {ws.base!r} "
                         f"(the warm start's cache key is that model's build)")
    try:
        fit_sft(cfg, str(base_dir))
        if ws.floor_recipe is not None:
            got = _judge_in_a_child(ws, built)
            print(f"built {ws.what}: held-out greedy accuracy {got:.3f} on {ws.floor_recipe.name}'s eval rows "
                  f"(floor {ws.floor_greedy:.2f})", flush=True)
        # our cache, under the lock: a leftover without config.json is replaced
        shutil.rmtree(out, ignore_errors=True)
        built.rename(out)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(built, ignore_errors=True)


class BelowFloor(RuntimeError):
    """A warm start that came out weaker than its documented floor (exit status 10, docs/runs-and-checkpoints.md)."""

    exit_status = 10


def _judge_in_a_child(ws: WarmStart, built: Path) -> float:
    """The build's held-out greedy accuracy (``trainer.measurement.warm_start_floor``, run as its own process: the
    RL evaluation sits above the model builds in the package order); ``BelowFloor`` with its one line."""
    proc = subprocess.run([sys.executable, "-m", "trainer.measurement.warm_start_floor", ws.name, str(built),
                           str(ws.floor_recipe), repr(ws.floor_greedy)], cwd=REPO_ROOT, capture_output=True,
                          text=True, env=single_process_env(dict(os.environ)))
    if proc.returncode == BelowFloor.exit_status:
        raise BelowFloor(proc.stderr.strip().splitlines()[-1])
    if proc.returncode:
        raise RuntimeError(f"judging {ws.name}'s build against its floor failed (exit {proc.returncode}): "
                           f"{proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


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
