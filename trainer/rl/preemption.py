"""SIGTERM / SIGINT as a request to stop at the next step boundary with a checkpoint (clusters preempt with
SIGTERM; Ctrl-C sends SIGINT). A second signal takes the signal's default action at once.

The handler only records the signal; the loop asks ``requested(dp)`` once per step, after the step's
checkpoint phase, and every rank gets the same answer (a signal seen by any rank stops them all).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    def __init__(self, announce: bool = True) -> None:
        self.announce = announce  # only rank 0 prints
        self.signum: Optional[int] = None
        self._previous: dict[int, object] = {}

    def install(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():  # Python only allows handlers there
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
