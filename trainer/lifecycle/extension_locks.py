"""A lock left by a killed build of a just-in-time compiled extension, named before a ZeRO launch hangs on it.

DeepSpeed's CPU collectives compile their shared-memory op on first use (``deepspeed/comm/torch.py``
``build_shm_op`` -> ``torch.utils.cpp_extension.load``). torch guards each build directory with a ``lock`` file
(``cpp_extension._jit_compile``: ``FileBaton(os.path.join(build_directory, 'lock'))``): the process that creates it
builds, every other one waits until the file is gone, with no timeout and no record of who made it
(``torch/utils/file_baton.py``). A build killed part way (Ctrl-C, a job's time limit, an OOM kill) leaves the file,
and every later launch then waits on it forever without a word. A build of these ops takes about a minute, so a lock
older than ``STALE_AFTER_S`` is taken for a dead build's, and the run stops with one line naming the file instead
of hanging. Nothing is removed: a lock is the user's to judge (another session could be building in it).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

from torch.utils.cpp_extension import get_default_build_root

from trainer.config import RecipeError
from trainer.distributed.deepspeed import deepspeed_requested

# Ten builds' time: a live build of DeepSpeed's CPU ops takes about a minute on two cores.
STALE_AFTER_S = 600.0


def extension_lock_files() -> list[Path]:
    """Every build directory's ``lock`` under torch's extension roots: ``TORCH_EXTENSIONS_DIR`` when set (torch
    builds in ``$TORCH_EXTENSIONS_DIR/<name>``), else the default root's ``<python>_<accelerator>/<name>``."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    pattern = "*/lock" if root else "*/*/lock"
    base = Path(root) if root else Path(get_default_build_root())
    return sorted(base.glob(pattern)) if base.is_dir() else []


def stale_extension_locks(now: Optional[float] = None, older_than_s: float = STALE_AFTER_S) -> list[tuple[Path, float]]:
    """(lock, age in seconds) for each lock older than ``older_than_s``."""
    now = time.time() if now is None else now
    out = []
    for lock in extension_lock_files():
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:  # the build that held it finished meanwhile
            continue
        if age > older_than_s:
            out.append((lock, age))
    return out


def check_extension_locks(where: str) -> None:
    """Refuse a DeepSpeed launch that would wait forever on a dead build's lock (module docstring)."""
    if not deepspeed_requested():
        return
    stale = stale_extension_locks()
    if stale:
        raise RecipeError.several([RecipeError(
            f"{where}: {lock} is {age / 60:.0f} min old: a killed build of a compiled extension left it, and DeepSpeed "
            f"would wait on it forever before the first step (torch's FileBaton has no timeout). If no other run is "
            f"building it, remove it (rm {lock}) and launch again") for lock, age in stale])
