"""Why a write failed, in one line: a full disk told apart from every other failure.

The writers below a checkpoint do not all say "no space left": Python's own files raise
``OSError`` ENOSPC (or EDQUOT, a quota), safetensors (PEFT's adapter) wraps the same errno in
its own error ("os error 28"), and ``torch.save``'s zip writer only reports that the position it
reached is not the one it expected (``[enforce fail at inline_container.cc:672] . unexpected pos``)
or that "file write failed" -- it never sees the errno. For those, the free space on the
filesystem is read right after the failure (before the partial folder is removed): less than
``FULL_BELOW`` bytes free means the disk filled.
"""
from __future__ import annotations

import errno
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

# Below this much free space, a failed write of several MB was stopped by the disk (a filesystem
# reserves blocks, so "full" is rarely 0 bytes free).
FULL_BELOW = 16 << 20
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "StorageFull", "os error 28")
# torch.save's zip writer (caffe2/serialize/inline_container.cc): a short write, errno not kept
_TORCH_WRITER_TEXT = ("unexpected pos", "file write failed", "PytorchStreamWriter failed")


def free_bytes(path: Path) -> Optional[int]:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent); None if unknown."""
    path = Path(path)
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return None


def is_write_failure(e: BaseException) -> bool:
    """An error of the filesystem (full, read-only, no permission, a file where a folder should be), not a bug."""
    return isinstance(e, OSError) or any(t in str(e) for t in _TORCH_WRITER_TEXT + _FULL_TEXT)


def is_disk_full(e: BaseException, free: Optional[int]) -> bool:
    """``e`` (a failed write) was caused by a full disk; ``free``: bytes free right after it."""
    if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
        return True
    text = str(e)
    if any(t in text for t in _FULL_TEXT):
        return True
    return any(t in text for t in _TORCH_WRITER_TEXT) and free is not None and free < FULL_BELOW


def size(n: Optional[int]) -> str:
    if n is None:
        return "unknown"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def describe(e: BaseException, where: Path, *, free: Optional[int], needed: Optional[int] = None,
             written: Optional[int] = None) -> str:
    """One line: why writing under ``where`` failed. ``needed``: bytes the write takes, if known; ``written``:
    bytes it had written when it failed."""
    if is_disk_full(e, free):
        return disk_full(where, free=free, needed=needed, written=written)
    if isinstance(e, OSError) and e.strerror:
        return f"{type(e).__name__} at {e.filename or where}: {e.strerror} ({size(free)} free)"
    return f"{type(e).__name__} at {where}: {' '.join(str(e).split())[:300]} ({size(free)} free)"


def disk_full(where: Path, *, free: Optional[int], needed: Optional[int] = None, written: Optional[int] = None) -> str:
    """One line: the disk at ``where`` is full, with what is known of free, needed and written bytes."""
    known = [f"{size(free)} free"]
    if needed:
        known.append(f"about {size(needed)} needed")
    if written:
        known.append(f"{size(written)} written before it failed")
    return f"the disk is full at {where} ({', '.join(known)})"


class StartNotWritten(RuntimeError):
    """The run directory or one of its first files (the lock, ``engine.log``, ``recipe.yaml``, ``metrics.jsonl``,
    the wandb id) could not be written when the run started: a full disk, no permission. Nothing was trained;
    `parityrl train` exits with status 6, as for a checkpoint or a step's record that cannot be written."""

    exit_status = 6


@contextmanager
def writing_at_start(run_dir: Path, path: Optional[Path] = None) -> Iterator[None]:
    """An ``OSError`` of the writes inside (``path``, or the run directory itself) raised as ``StartNotWritten``
    with ``describe``'s sentence, so that a full disk at the start reads as it does mid-run instead of as a bug.
    ``FileExistsError`` and ``FileNotFoundError`` pass unchanged: the run directory's state (another writer,
    a file where the directory should be), which `parityrl train` refuses with status 2."""
    try:
        yield
    except (FileExistsError, FileNotFoundError):
        raise
    except OSError as e:
        target = Path(path) if path is not None else Path(run_dir)
        why = describe(e, Path(run_dir), free=free_bytes(target))
        raise StartNotWritten(f"{target} could not be written at the run's start: {why}") from e
