"""One writer per run directory: ``<run_dir>/.lock``, held with ``flock`` for the process's lifetime.

The kernel releases a ``flock`` when its holder dies (however it dies), so a lock left by
a killed process is free: the next run takes it over and says whose it was (the file
keeps the last holder's pid, host and start time). A live holder makes the next run
stop before it loads anything, naming the directory and the holder. Under data parallel
only the main process (``RANK`` 0) holds it: the ranks of one launch are one writer.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

LOCK_FILE = ".lock"


class RunStateError(FileExistsError):
    """The run directory's state forbids what was asked (a user decision: exit status 2, one line)."""


class RunDirInUse(RunStateError):
    pass


def _describe(holder: dict) -> str:
    if not holder:
        return "another process (it has not written its pid yet)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} (since {since})"


def _read_holder(f) -> dict:
    f.seek(0)
    try:
        data = json.loads(f.read() or "{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _in_use(path: Path, holder: dict) -> RunDirInUse:
    return RunDirInUse(f"{path.parent} is in use by {_describe(holder)}: one writer per run; wait for it to end or "
                       f"stop it (lock file {path})")


def check_free(run_dir: Path) -> None:
    """``RunDirInUse`` if a live process holds ``run_dir``'s lock. Reads only: a start refused for another
    reason found later (no checkpoint to resume) creates nothing, yet a busy directory is named as such first."""
    path = Path(run_dir) / LOCK_FILE
    try:
        f = open(path)
    except OSError:  # no lock file (or none readable): the claim itself decides
        return
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(path, _read_holder(f)) from None
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class RunLock:
    """The held lock of one run directory; ``release()`` frees it (idempotent)."""

    def __init__(self, run_dir: Path, *, enabled: bool = True) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.note: Optional[str] = None  # set when a dead holder's lock was taken over
        self._f = None
        if enabled:
            self._acquire()

    def _acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(f)
            f.close()
            raise _in_use(self.path, holder) from None
        previous = _read_holder(f)
        if previous:  # released by its holder's death: a clean exit empties the file
            self.note = (f"note: took over the lock of {self.path.parent} left by {_describe(previous)}, "
                         "which is no longer running")
        try:
            f.seek(0)
            f.truncate()
            f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}))
            f.flush()
            os.fsync(f.fileno())
        except BaseException:  # a full disk: the caller reports it; the lock is not left held by a lost handle
            try:
                f.close()
            except OSError:  # its buffered bytes fail the same way
                pass
            raise
        self._f = f
        _HELD.add(self)

    @property
    def held(self) -> bool:
        return self._f is not None

    def release(self) -> None:
        if self._f is None:
            return
        f, self._f = self._f, None
        _HELD.discard(self)
        f.seek(0)
        f.truncate()
        f.flush()
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        f.close()


_HELD: set[RunLock] = set()  # the locks this process holds, for release_all


def release_all() -> None:
    """Release every lock this process holds: a process about to end at once (``os._exit``) leaves no holder
    behind in the lock file, so the next run starts without a takeover note."""
    for lock in list(_HELD):
        lock.release()


def claim(run_dir: Path) -> RunLock:
    """Lock ``run_dir`` for this launch (the main process only); raises ``RunDirInUse`` if another holds it."""
    return RunLock(run_dir, enabled=int(os.environ.get("RANK", "0")) == 0)
