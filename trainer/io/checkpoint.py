"""Checkpoints that survive a crash or a kill.

Layout: ``<run_dir>/checkpoints/step_000010/`` holding the trainable weights
(``adapter/`` for LoRA, via PEFT's ``save_pretrained``), ``optimizer.pt``,
``scheduler.pt``, ``rng.pt`` and ``state.json`` (step, data position, ...). Under
DeepSpeed ZeRO ``optimizer.pt`` is replaced by ``deepspeed/`` (every rank's shard,
written by ``engine.save_checkpoint``); ``adapter/`` is the same, gathered whole.

A checkpoint is written into a temporary sibling directory and renamed into
place only when complete, so a kill mid-write leaves the previous checkpoints
untouched and never a half-written "latest". Old ones are pruned only after the
new one is in place.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_COMPLETE = "state.json"  # written last: its presence marks a complete checkpoint


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    d = checkpoints_dir(run_dir)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / _COMPLETE).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    cks = list_checkpoints(run_dir)
    return cks[-1][1] if cks else None


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


DEEPSPEED_DIR, DEEPSPEED_TAG = "deepspeed", "state"  # engine.save_checkpoint(<ckpt>/deepspeed, tag="state")


def _staging_dirs(run_dir: Path, step: int, suffix: str) -> tuple[Path, Path]:
    root = checkpoints_dir(run_dir)
    return root / f"step_{step:06d}", root / f".tmp_step_{step:06d}{suffix}"


def _fresh_dir(tmp: Path) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():  # left by a killed save of the same step
        shutil.rmtree(tmp)
    tmp.mkdir()


def _finish(tmp: Path, final: Path, run_dir: Path, step: int, *, scheduler, state: dict, keep_last: int,
            modules: Optional[dict]) -> Path:
    """Write the process-wide files, mark ``tmp`` complete, move it into place, prune old checkpoints."""
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    for name, module in (modules or {}).items():
        torch.save(module.state_dict(), tmp / f"{name}.pt")
    with open(tmp / _COMPLETE, "w") as f:
        json.dump({"step": step, **state}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # re-saving the same step (e.g. the final step after a periodic one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_checkpoint(run_dir: Path, step: int, *, model, optimizer, scheduler, state: dict, keep_last: int,
                    modules: Optional[dict] = None) -> Path:
    """Write checkpoint ``step`` atomically and prune all but the newest ``keep_last``.

    ``modules``: extra trainable modules outside the adapter (e.g. PPO's value head), saved
    as ``<name>.pt`` state dicts.
    """
    final, tmp = _staging_dirs(run_dir, step, f"_{os.getpid()}")
    _fresh_dir(tmp)
    model.save_pretrained(tmp / "adapter")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    return _finish(tmp, final, run_dir, step, scheduler=scheduler, state=state, keep_last=keep_last, modules=modules)


def save_deepspeed_checkpoint(run_dir: Path, step: int, *, engine, policy, scheduler, state: dict, keep_last: int,
                              is_main: bool, barrier) -> Path:
    """The DeepSpeed form of ``save_checkpoint``; COLLECTIVE: every rank calls it.

    Every rank writes its ZeRO shard of the optimizer state (and, ZeRO-3, of the
    adapters) with ``engine.save_checkpoint(<tmp>/deepspeed, tag="state",
    exclude_frozen_parameters=True)`` -- the frozen base is never written; the adapter is
    gathered whole (``trainer.distributed.deepspeed.gathered_trainable``) and saved by the main
    process as ``adapter/``, the same PEFT files as without DeepSpeed, so ``parityrl
    merge`` and the evaluation tools read either kind. The staging directory's name is
    the same on every rank (not pid-based), the main process alone creates, completes and
    renames it, with barriers between, so the rename happens after every shard is on disk.
    Several machines need a shared filesystem under ``logging.run_dir``.
    """
    from trainer.distributed.deepspeed import gathered_trainable

    final, tmp = _staging_dirs(run_dir, step, "_deepspeed")
    if is_main:
        _fresh_dir(tmp)
    barrier()
    engine.save_checkpoint(str(tmp / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, exclude_frozen_parameters=True)
    with gathered_trainable(policy):  # a collective gather under ZeRO-3
        if is_main:
            policy.save_pretrained(tmp / "adapter")
    barrier()
    if is_main:
        _finish(tmp, final, run_dir, step, scheduler=scheduler, state=state, keep_last=keep_last, modules=None)
    barrier()
    return final


def _read_state(path: Path) -> dict:
    if not (path / _COMPLETE).is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {_COMPLETE})")
    return json.loads((path / _COMPLETE).read_text())


def load_checkpoint(path: Path, *, model, optimizer, scheduler, modules: Optional[dict] = None) -> dict:
    """Restore weights, optimizer, scheduler, RNG (and ``modules``, see ``save_checkpoint``) from ``path``;
    return its state.json."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    path = Path(path)
    state = _read_state(path)
    if (path / DEEPSPEED_DIR).is_dir():
        raise ValueError(f"{path} was written under DeepSpeed ZeRO (its optimizer state is sharded in "
                         f"{DEEPSPEED_DIR}/): resume it with the same DeepSpeed launch config and number of processes")
    weights = load_peft_weights(str(path / "adapter"), device="cpu")
    result = set_peft_model_state_dict(model, weights)
    missing = [k for k in getattr(result, "unexpected_keys", [])]
    if missing:
        raise RuntimeError(f"{path}/adapter: weights not found in the model: {missing[:5]}")
    for name, module in (modules or {}).items():
        if not (path / f"{name}.pt").is_file():
            raise FileNotFoundError(f"{path}: no {name}.pt; this checkpoint was written by a run without a {name} "
                                    "(another algorithm?)")
        module.load_state_dict(torch.load(path / f"{name}.pt", weights_only=True))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return state


def load_deepspeed_checkpoint(path: Path, *, engine, scheduler, world_size: int) -> dict:
    """Restore a ``save_deepspeed_checkpoint`` into a prepared DeepSpeed ``engine``; return its state.json.

    ``engine.load_checkpoint`` restores the adapters (``load_module_strict=False``: the
    frozen base was not saved and stays as loaded) and every rank's optimizer shard; the
    LR scheduler is the loop's own (not DeepSpeed's) and comes from ``scheduler.pt``.
    ZeRO shards are per rank: a different number of processes is refused here, naming
    both counts, rather than by DeepSpeed's own assertion.
    """
    path = Path(path)
    state = _read_state(path)
    tag_dir = path / DEEPSPEED_DIR / DEEPSPEED_TAG
    if not tag_dir.is_dir():
        raise ValueError(f"{path}: no {DEEPSPEED_DIR}/{DEEPSPEED_TAG}/; this checkpoint was written without "
                         "DeepSpeed: resume it without DeepSpeed (or start a new run under DeepSpeed)")
    shards = sorted(tag_dir.glob("*optim_states.pt"))
    if len(shards) != world_size:
        raise ValueError(f"{tag_dir}: {len(shards)} ZeRO optimizer shards, but {world_size} processes resume it; "
                         f"launch with --num_processes {len(shards)}")
    load_path, _ = engine.load_checkpoint(str(path / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, load_module_strict=False,
                                          load_optimizer_states=True, load_lr_scheduler_states=False)
    if load_path is None:
        raise RuntimeError(f"{tag_dir}: DeepSpeed could not load this checkpoint (see its log above)")
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return state
