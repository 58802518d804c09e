"""Output directories that appear whole or not at all.

A run that dies half way (kill, out of memory, an exception) must not leave a
directory that looks like a model: the next stage would load it. Everything is
written into a temporary sibling (same filesystem, so the final ``os.replace`` is an
atomic rename) and renamed onto the target at the end.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def is_nonempty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def refuse_existing_output(out: Path, key: str) -> None:
    """FileExistsError if ``out`` is a file or a non-empty directory (``key`` names the option that chose it)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{key} = {str(out)!r}: exists and is not a directory")
    if is_nonempty_dir(out):
        raise FileExistsError(f"{key} = {str(out)!r}: the directory exists and is not empty; choose a new one or "
                              "delete it (nothing was overwritten)")


@contextlib.contextmanager
def atomic_output_dir(out: Path, key: str = "output") -> Iterator[Path]:
    """Yield a temporary directory next to ``out``; on success rename it to ``out``.

    ``out`` must be new or empty (checked before and, since ``os.replace`` onto a
    non-empty directory fails, again at the rename). On an exception the temporary
    directory is removed and ``out`` is untouched.
    """
    out = Path(out).expanduser().absolute()
    refuse_existing_output(out, key)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.is_dir():
            out.rmdir()  # empty (checked above); rmdir fails loudly if something appeared meanwhile
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
