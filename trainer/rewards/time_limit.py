"""A time limit per reward-function call (``reward.timeout_s``), and user code that ends a call by exiting.

How a call is bounded: the function runs in a worker thread and the caller waits for it with a timeout.
The alternatives, and why not them:

* ``signal.alarm`` / ``setitimer`` interrupts only the main thread, and user code that times itself out the
  same way (a timeout decorator: ``signal.alarm(n)`` ... ``signal.alarm(0)``) cancels our timer for good;
* a subprocess or fork per call costs a fork of a process holding torch and the engine (page tables of
  gigabytes, threads whose locks the child inherits held), and loses the function's own state (caches,
  counters) between calls.

A thread cannot be killed: a call that overstays is abandoned (a daemon thread) and the run stops with
``RewardError`` -- exit status 5 and a checkpoint of the last completed step -- so the thread ends with the
process. Waiting with a timeout stays interruptible: SIGTERM / SIGINT reach the main thread's handlers during
the wait, and the first one's "stopping after this step" waits at most ``timeout_s`` for the reward.
The price: code that must run in the main thread (``signal.signal``, e.g. math_verify's default
signal-based timeout) fails there; ``reward.timeout_s: null`` calls the functions in the caller's thread,
unbounded, and the error says so.

Whatever a function raises -- ``SystemExit`` and ``KeyboardInterrupt`` included -- is a failure of that reward:
a real Ctrl-C never raises inside it (the worker thread receives no signals, and during a run the loop's
handler records SIGINT instead of raising), so a ``BaseException`` from the call is the function's own doing.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Optional


class RewardError(Exception):
    """A reward function overstayed its time limit or ended its call by exiting; the message names it."""


def exit_error(name: str, e: BaseException) -> RewardError:
    """The failure of reward ``name`` that raised ``e``, a ``BaseException`` that is not an ``Exception``."""
    return RewardError(f"reward function {name!r} raised {type(e).__name__}({_args(e)}): a reward function must "
                       "return one number per sample, not exit or interrupt the run")


def _args(e: BaseException) -> str:
    return ", ".join(repr(a) for a in e.args)


_MAIN_THREAD_HINT = ("; reward functions run in a worker thread so that reward.timeout_s can bound them: set "
                     "reward.timeout_s: null to call them in the main thread, without a time limit")


def bounded(fn: Callable[..., Any], name: str, timeout_s: Optional[float]) -> Callable[..., Any]:
    """``fn`` with at most ``timeout_s`` seconds per call (None: ``fn`` itself, called in the caller's thread)."""
    if timeout_s is None:
        return fn

    def call(*args, **kwargs):
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["out"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller, which names the function
                box["error"] = e

        worker = threading.Thread(target=target, name=f"reward:{name}", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            raise RewardError(f"reward function {name!r} did not return within reward.timeout_s = {timeout_s:g} s "
                              "(the call is abandoned; raise reward.timeout_s if it needs longer, or null for no "
                              "limit)")
        if "error" not in box:
            return box["out"]
        e = box["error"]
        if not isinstance(e, Exception):
            raise exit_error(name, e) from e
        if isinstance(e, ValueError) and "main thread" in str(e):  # signal.signal outside the main thread
            raise RewardError(f"reward function {name!r} raised ValueError: {e}{_MAIN_THREAD_HINT}") from e
        raise e

    call.__wrapped__ = fn
    return call
