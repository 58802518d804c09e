"""SIGTERM / SIGINT at every moment of `parityrl train`.

From the loop's start (``Preemption``): a request to stop at the next step boundary with a checkpoint
(clusters preempt with SIGTERM; Ctrl-C sends SIGINT). A second signal takes the signal's default action at
once. The handler only records the signal; the loop asks ``requested(dp)`` once per step, after the step's
checkpoint phase, and every rank gets the same answer (a signal seen by any rank stops them all).

Before it (``StartupStop``: preflight, data and model loading, the engine's start): nothing is trained yet,
so there is nothing to keep; the process ends at once with one line and status 128 + N (130, 143).
Not by raising ``KeyboardInterrupt``: the engine's start runs third-party code that loses it (raised inside
a ``__del__`` it is printed as "Exception ignored" and dropped, and the run went on to train every step).
The line is written and the process ended (``os._exit``, after releasing the run lock) by whichever sees
the signal first: the Python handler, or a watcher thread woken through ``signal.set_wakeup_fd``, which
also acts while the main thread sits in a long native call that releases the GIL (a weight load, a
compile), where Python handlers wait for it to return.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, Optional

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    def __init__(self, announce: bool = True) -> None:
        self.announce = announce  # only rank 0 prints
        self.signum: Optional[int] = None
        self._previous: dict[int, object] = {}

    def install(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():  # Python only allows handlers there
            end_startup()  # from here a signal stops after the step: the startup's handlers give way
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        if self.announce:
            print(f"parityrl: {signal.Signals(signum).name} received: stopping after this step with a checkpoint "
                  "(send it again to stop at once, losing the step)", file=sys.stderr, flush=True)

    def requested(self, dp) -> Optional[int]:
        """The signal that asks every rank to stop now (SIGTERM before SIGINT), or None. Collective."""
        seen = dp.sum_metrics({s.name: float(self.signum == s) for s in SIGNALS})
        return next((int(s) for s in SIGNALS if seen[s.name] > 0), None)


class StartupStop:
    """Until ``end()``: the first SIGINT / SIGTERM ends the process at once, with one line (rank 0) and status
    128 + N; ``cleanup()`` runs first (it must be quick and not raise: the run lock's release)."""

    def __init__(self, cleanup: Callable[[], None], announce: bool = True, resume_command: str = "") -> None:
        # resume_command: for a launch that resumes a run, the command that continues it (its checkpoints are
        # untouched by a stop before the first step, so the same command continues it)
        self.cleanup, self.announce, self.resume_command = cleanup, announce, resume_command
        self._once = threading.Lock()
        self._previous: dict[int, object] = {}
        self._wakeup: Optional[tuple[int, int]] = None  # (read end, write end)
        self._old_wakeup_fd = -1

    def install(self) -> "StartupStop":
        global _startup
        if threading.current_thread() is not threading.main_thread():
            return self
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        r, w = os.pipe()
        os.set_blocking(w, False)  # set_wakeup_fd's requirement: the C handler must never block
        self._old_wakeup_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._wakeup = (r, w)
        threading.Thread(target=self._watch, args=(r,), name="parityrl-startup-signals", daemon=True).start()
        _startup = self
        return self

    def end(self) -> None:
        """Signals are someone else's from here (the loop's ``Preemption``, or the defaults). Main thread."""
        global _startup
        if _startup is self:
            _startup = None
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
        if self._wakeup is not None:
            r, w = self._wakeup
            self._wakeup = None
            current = signal.set_wakeup_fd(self._old_wakeup_fd)
            if current != w:  # someone installed their own since: keep theirs
                signal.set_wakeup_fd(current)
            os.close(w)  # the watcher reads end-of-file and closes the read end

    def _watch(self, r: int) -> None:
        try:
            while data := os.read(r, 64):
                for signum in data:
                    if signum in SIGNALS:
                        self._stop(signum)
        finally:
            os.close(r)

    def _handle(self, signum: int, frame) -> None:
        self._stop(signum)

    def _stop(self, signum: int) -> None:
        if not self._once.acquire(blocking=False):  # the other path is already ending the process
            return
        try:
            if self.announce:
                hint = f"; its checkpoints are untouched: continue with `{self.resume_command}`" \
                    if self.resume_command else ""
                print(f"parityrl: {signal.Signals(signum).name} received before the first step: stopped at once "
                      f"(nothing was trained in this launch, so there is nothing to checkpoint){hint}",
                      file=sys.stderr, flush=True)
            self.cleanup()
            sys.stdout.flush()
        finally:
            os._exit(128 + signum)


_startup: Optional[StartupStop] = None


def end_startup() -> None:
    """End the startup's signal handling, if any (``Preemption.install`` and the command's end call it)."""
    if _startup is not None:
        _startup.end()
