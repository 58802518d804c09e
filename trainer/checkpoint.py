"""Checkpoints that survive a crash or a kill.

Layout: ``<run_dir>/checkpoints/step_000010/`` holding the trainable weights
(``adapter/`` for LoRA, via PEFT's ``save_pretrained``), ``optimizer.pt``,
``scheduler.pt``, ``rng.pt`` and ``state.json`` (step, data position, ...).

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


def save_checkpoint(run_dir: Path, step: int, *, model, optimizer, scheduler, state: dict, keep_last: int,
                    modules: Optional[dict] = None) -> Path:
    """Write checkpoint ``step`` atomically and prune all but the newest ``keep_last``.

    ``modules``: extra trainable modules outside the adapter (e.g. PPO's value head), saved
    as ``<name>.pt`` state dicts.
    """
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp / "adapter")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
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


def load_checkpoint(path: Path, *, model, optimizer, scheduler, modules: Optional[dict] = None) -> dict:
    """Restore weights, optimizer, scheduler, RNG (and ``modules``, see ``save_checkpoint``) from ``path``;
    return its state.json."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    path = Path(path)
    if not (path / _COMPLETE).is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {_COMPLETE})")
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
    return json.loads((path / _COMPLETE).read_text())
