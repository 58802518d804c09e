"""Checkpoints that survive a crash or a kill.

Layout: ``<run_dir>/checkpoints/step_000010/`` holding the trainable weights
(``adapter/`` for LoRA, via PEFT's ``save_pretrained``), ``optimizer.pt``,
``scheduler.pt``, ``rng.pt`` and ``state.json`` (step, data position, ...). Under
DeepSpeed ZeRO ``optimizer.pt`` is replaced by ``deepspeed/`` (every rank's shard,
written by ``engine.save_checkpoint``); ``adapter/`` is the same, gathered whole.

A checkpoint is written into a temporary sibling directory and renamed into
place only when complete, so a kill mid-write leaves the previous checkpoints
untouched and never a half-written "latest". Old ones are pruned only after the
new one is in place. Its last file is ``manifest.json``: the size and SHA-256 of
every other file. Only a checkpoint whose manifest is there and whose files match it
is complete (``verify_checkpoint``); resume takes the newest such one
(``usable_checkpoint``) and names the newer ones it skipped, with the reason.
A failed write removes its temporary directory; so does the next start (the lock of
trainer/io/run_lock.py guarantees no other writer is using it).

Anything at a step's path that is not a readable folder holding a verified checkpoint of
that step (a file, a symlink that loops or dangles, a folder that cannot be read, a
``state.json`` that names another step) is skipped by resume and named with the reason.
When that step is written again, the thing at its path is renamed aside to
``step_NNNNNN.damaged-<time>`` rather than deleted: it may be the only copy of something the
user wants to inspect, and a run must not fail on it either (the retrained step goes in its
place). A write that fails -- a full disk, no permission, the damaged thing cannot be moved --
raises ``CheckpointNotWritten``: one line naming the step, the path and why (free and needed
bytes for a full disk, trainer/io/write_failure.py); the older checkpoints are untouched.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import stat
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from trainer.distributed.deepspeed import gathered_trainable
from trainer.io import write_failure

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_STATE = "state.json"
_COMPLETE = MANIFEST = "manifest.json"  # written last: its presence marks a complete checkpoint
ASIDE = ".damaged-"  # step_NNNNNN.damaged-<time>: a damaged entry moved out of a step's way (not a step name)


class CheckpointNotWritten(RuntimeError):
    """A checkpoint could not be written: the message names the step, the path and why (one line)."""


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    d = checkpoints_dir(run_dir)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and _has_manifest(p):
            out.append((int(m.group(1)), p))
    return sorted(out)


def _has_manifest(p: Path) -> bool:
    # cheap (no checksums): pruning and the stop's "already checkpointed?" call it on every save
    try:
        return stat.S_ISDIR(os.stat(p).st_mode) and os.path.isfile(p / _COMPLETE)
    except OSError:  # a loop, a folder that cannot be searched
        return False


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    cks = list_checkpoints(run_dir)
    return cks[-1][1] if cks else None


def rng_state() -> dict[str, Any]:
    """This process's generators: Python, NumPy, torch CPU and, with CUDA, every device's
    (``torch.cuda.get_rng_state_all``; written for GPU runs, not run here: no GPU)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(saved: dict[str, Any], rank: int = 0) -> None:
    """Restore this rank's generators from ``rng.pt``: ``{"ranks": [one state per rank]}`` (older checkpoints: one
    state, rank 0's, which every rank then takes as before)."""
    ranks = saved.get("ranks", [saved])
    state = ranks[rank] if rank < len(ranks) else ranks[0]
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
            modules: Optional[dict], rng_states: Optional[list] = None) -> Path:
    """Write the process-wide files, mark ``tmp`` complete, move it into place, prune old checkpoints."""
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    # every rank's generators (gathered by the caller), so each rank resumes its own streams
    torch.save({"ranks": rng_states or [rng_state()]}, tmp / "rng.pt")
    for name, module in (modules or {}).items():
        torch.save(module.state_dict(), tmp / f"{name}.pt")
    _write_synced(tmp / _STATE, json.dumps({"step": step, **state}, indent=2))
    _write_synced(tmp / MANIFEST, json.dumps(_manifest(tmp), indent=1))
    _make_room(final, step)
    os.replace(tmp, final)
    # Only older ones: a newer step_* still there is one resume skipped as damaged; it must not push this one out.
    # The best step by checkpoint.best_metric (recorded in the state) is kept besides keep_last.
    best = (state.get("best") or {}).get("step")
    older = [p for s, p in list_checkpoints(run_dir) if s < step and s != best]
    for old in older[:max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _make_room(final: Path, step: int) -> None:
    """Clear ``final`` for the new checkpoint of ``step``: a complete checkpoint of the same step is replaced;
    anything else is renamed aside (nothing the user had is deleted), with a note."""
    if not os.path.lexists(final):
        return
    why = verify_checkpoint(final)
    if why is None and not final.is_symlink():  # the same step saved again: the new one holds the same state
        shutil.rmtree(final)
        return
    why = why or f"a symlink to {os.readlink(final)!r}"
    aside = final.with_name(f"{final.name}{ASIDE}{time.strftime('%Y%m%dT%H%M%S')}")
    n = 1
    while os.path.lexists(aside):
        aside, n = aside.with_name(f"{final.name}{ASIDE}{time.strftime('%Y%m%dT%H%M%S')}-{n}"), n + 1
    try:
        os.rename(final, aside)
    except OSError as e:
        raise CheckpointNotWritten(f"checkpoint {step} cannot be written: {final} is in the way ({why}) and could not "
                                   f"be moved aside ({type(e).__name__}: {e.strerror}); move or delete it, then "
                                   "continue with --resume") from e
    print(f"note: {final} is not a usable checkpoint ({why}); moved it aside to {aside} (delete it once "
          f"inspected) and wrote step {step} in its place", flush=True)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(ckpt_dir: Path) -> dict:
    files = sorted(p for p in ckpt_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
    return {"files": {p.relative_to(ckpt_dir).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                      for p in files}}


def _entry_problem(path: Path) -> Optional[str]:
    """Why ``path`` is not a readable folder (a file, a symlink that loops or dangles, no permission), or None."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "gone"
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        try:
            st = os.stat(path)
        except OSError as e:
            return (f"a symlink that loops (to {target!r})" if e.errno == errno.ELOOP
                    else f"a symlink to {target!r}, which cannot be followed ({e.strerror})")
    if not stat.S_ISDIR(st.st_mode):
        return f"a {'file' if stat.S_ISREG(st.st_mode) else 'special file'} ({st.st_size} bytes), not a checkpoint folder"
    try:
        os.listdir(path)
    except OSError as e:
        return f"a folder that cannot be read ({type(e).__name__}: {e.strerror})"
    return None


def _folder_step(path: Path) -> Optional[int]:
    m = _STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


def verify_checkpoint(path: Path) -> Optional[str]:
    """None if ``path`` is complete (a readable folder, its manifest is there, every file matches it, and its
    ``state.json`` is of the step its folder names), else why not."""
    path = Path(path)
    problem = _entry_problem(path)
    if problem:
        return problem
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        entries = [(str(name), int(e["bytes"]), str(e["sha256"])) for name, e in files.items()]
    except FileNotFoundError:
        return f"no {MANIFEST} (the write did not finish, or an older parityrl wrote it)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} unreadable ({type(e).__name__})"
    if _STATE not in files:
        return f"{MANIFEST} does not list {_STATE}"
    for name, size, digest in entries:
        f = path / name
        if not f.is_file():
            return f"{name} missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {size}"
        if _sha256(f) != digest:
            return f"{name} does not match its checksum"
    return _step_mismatch(path)


def _step_mismatch(path: Path) -> Optional[str]:
    # A state.json of another step (copied, or its manifest recomputed) would resume that step's position on top
    # of this folder's weights, or the other way round: neither is a state the run was ever in.
    folder = _folder_step(path)
    try:
        step = json.loads((path / _STATE).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{_STATE} unreadable ({type(e).__name__})"
    if folder is not None and step != folder:
        return f"its {_STATE} says step {step!r}, its folder step {folder}"
    return None


def step_dirs(run_dir: Path) -> list[Path]:
    """Everything at a ``step_NNNNNN`` path -- folders complete or not, and whatever else sits there (a file, a
    symlink): resume names each one it skips -- oldest first."""
    d = checkpoints_dir(run_dir)
    found = [(_STEP_DIR.match(p.name), p) for p in (d.iterdir() if d.is_dir() else ())]
    return [p for _, p in sorted((int(m.group(1)), p) for m, p in found if m)]


def usable_checkpoint(run_dir: Path) -> tuple[Optional[Path], list[tuple[Path, str]]]:
    """(the newest verified checkpoint or None, [(newer checkpoint skipped, why)])."""
    skipped = []
    for p in reversed(step_dirs(run_dir)):
        why = verify_checkpoint(p)
        if why is None:
            return p, skipped
        skipped.append((p, why))
    return None, skipped


def remove_partial_checkpoints(run_dir: Path) -> list[Path]:
    """Delete the ``.tmp_step_*`` folders of writes that never finished (a kill, a full disk); the removed ones."""
    d = checkpoints_dir(run_dir)
    partial = sorted(d.glob(".tmp_step_*")) if d.is_dir() else []
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
    return partial


def save_checkpoint(run_dir: Path, step: int, *, model, optimizer, scheduler, state: dict, keep_last: int,
                    modules: Optional[dict] = None, rng_states: Optional[list] = None) -> Path:
    """Write checkpoint ``step`` atomically and prune all but the newest ``keep_last``.

    ``modules``: extra trainable modules outside the adapter (e.g. PPO's value head), saved
    as ``<name>.pt`` state dicts. A write that fails (a full disk) removes its partial folder.
    """
    final, tmp = _staging_dirs(run_dir, step, f"_{os.getpid()}")
    try:
        _fresh_dir(tmp)
        model.save_pretrained(tmp / "adapter")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        return _finish(tmp, final, run_dir, step, scheduler=scheduler, state=state, keep_last=keep_last,
                       modules=modules, rng_states=rng_states)
    except BaseException as e:
        failure = _not_written(e, run_dir, step, tmp)  # measured before the partial folder is removed
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"note: checkpoint {step} was not written; removed its partial folder {tmp}", flush=True)
        if failure is not None:
            raise failure from e
        raise


def _bytes_under(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _not_written(e: BaseException, run_dir: Path, step: int, tmp: Path) -> Optional[CheckpointNotWritten]:
    """The one-line error for a write that failed on the filesystem (None: not a filesystem failure, e.g. a bug)."""
    if isinstance(e, CheckpointNotWritten) or not isinstance(e, Exception) or not write_failure.is_write_failure(e):
        return None
    free = write_failure.free_bytes(tmp)
    older = latest_checkpoint(run_dir)
    why = write_failure.describe(e, checkpoints_dir(run_dir), free=free, needed=_checkpoint_bytes(older),
                                 written=_bytes_under(tmp))
    return CheckpointNotWritten(f"checkpoint {step} was not written: {why}; {_kept(older)}")


def _checkpoint_bytes(path: Optional[Path]) -> Optional[int]:
    """A checkpoint's size from its manifest (None if unknown): the next one holds the same tensors."""
    if path is None:
        return None
    try:
        return sum(int(f["bytes"]) for f in json.loads((path / MANIFEST).read_text())["files"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _kept(older: Optional[Path]) -> str:
    return f"the newest checkpoint, {older}, is intact" if older else "there is no older checkpoint"


def no_room(run_dir: Path, step: int) -> Optional[CheckpointNotWritten]:
    """Before writing checkpoint ``step``: the error if the disk has less room than the newest checkpoint took (the
    new one holds the same tensors, and the old is pruned only after it), else None. Under DeepSpeed every rank
    writes a shard between the engine's own barriers, so a rank that fails mid-write leaves the others waiting:
    a full disk is found here, before any rank writes."""
    older = latest_checkpoint(run_dir)
    needed, free = _checkpoint_bytes(older), write_failure.free_bytes(checkpoints_dir(run_dir))
    if needed is None or free is None or free >= needed:
        return None
    why = write_failure.disk_full(checkpoints_dir(run_dir), free=free, needed=needed)
    return CheckpointNotWritten(f"checkpoint {step} was not written: {why}; {_kept(older)}")


def save_deepspeed_checkpoint(run_dir: Path, step: int, *, engine, policy, scheduler, state: dict, keep_last: int,
                              is_main: bool, barrier, rng_states: Optional[list] = None) -> Path:
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
        _finish(tmp, final, run_dir, step, scheduler=scheduler, state=state, keep_last=keep_last, modules=None,
                rng_states=rng_states)
    barrier()
    return final


def _read_state(path: Path) -> dict:
    # (verified against its manifest before, by usable_checkpoint: the loaders only read)
    if not (path / _STATE).is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {_STATE})")
    return json.loads((path / _STATE).read_text())


def load_checkpoint(path: Path, *, model, optimizer, scheduler, modules: Optional[dict] = None, rank: int = 0) -> dict:
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
    set_rng_state(torch.load(path / "rng.pt", weights_only=False), rank)
    return state


def load_deepspeed_checkpoint(path: Path, *, engine, scheduler, world_size: int, rank: int = 0) -> dict:
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
    set_rng_state(torch.load(path / "rng.pt", weights_only=False), rank)
    return state
