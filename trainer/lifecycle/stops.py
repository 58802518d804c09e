"""How a run stops early for a reason the user can act on: one class per reason, each with its exit status
(docs/runs-and-checkpoints.md "Errors and exit statuses"), raised on every rank together, and a checkpoint of the last completed step.

A step is abandoned when it fails before its update is applied (a reward function, the engine's generate,
a parity limit): the checkpoint is then the previous step's state, kept at the step's start
(``StepBoundary``), so ``--resume`` repeats the abandoned step exactly. A failure after the update (the weight
sync, the probe after it, a preemption at the step boundary) checkpoints the step itself.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional, TypeVar

from trainer.io import checkpoint as ckpt, write_failure

T = TypeVar("T")


class RunStopped(RuntimeError):
    """A run ended early for a documented reason; ``exit_status`` is what `parityrl train` returns."""

    exit_status = 1


class RewardFailed(RunStopped):
    """A reward function raised or returned something other than one finite number per sample."""

    exit_status = 5


class EngineFailed(RunStopped):
    """The rollout engine failed to generate (it died, ran out of memory, ...)."""

    exit_status = 4


class EnvironmentFailed(RunStopped):
    """An episode's environment raised, broke its contract (``reset`` / ``step`` returned another shape) or
    overstayed ``env.timeout_s``; the message names the environment class and the call. (A tool that raises or
    hangs is not one: its error goes back to the model as the tool message.)"""

    exit_status = 7


class ParityLimitExceeded(RunStopped):
    """The rollout/trainer mismatch broke a recipe limit with ``parity.on_violation: stop``."""

    exit_status = 3


class CheckpointFailed(RunStopped):
    """A checkpoint could not be written (a full disk, no permission, something in the way it cannot move);
    the message names the step, the path and why; the older checkpoints are intact."""

    exit_status = 6

    def __init__(self, message: str) -> None:
        super().__init__(message)
        # its own note: writing the checkpoint again on the way out would only fail the same way
        self.checkpoint_note = "fix that and continue with --resume from the newest checkpoint"


class RecordsNotWritten(RunStopped):
    """A step's record (metrics.jsonl, samples.jsonl, parity_breakdown.jsonl) could not be written: a full disk,
    no permission. The step itself completed; the run stops at its end with a checkpoint, if one can be written."""

    exit_status = 6


class RecordWrites:
    """The first failed write of a step's records, kept until the step's end and then raised on every rank
    together (only rank 0 writes records: raised there alone, it would leave the other ranks waiting)."""

    def __init__(self) -> None:
        self.error: Optional[RecordsNotWritten] = None

    @contextmanager
    def writing(self, path: Path, step: int) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            if self.error is None:
                why = write_failure.describe(e, Path(path).parent, free=write_failure.free_bytes(Path(path)))
                self.error = RecordsNotWritten(f"step {step}'s record could not be written to {path}: {why}")
                self.error.__cause__ = e

    def raise_together(self, dp) -> None:
        """Collective: every rank raises the first failure any rank kept."""
        stop_together(dp, self.error)


class Preempted(RunStopped):
    """SIGTERM / SIGINT: the run stopped at a step boundary with a checkpoint; exit 128 + the signal's number."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_status = 128 + signum

    def __reduce__(self):
        return type(self), (str(self), self.exit_status - 128)


def stop_together(dp, error: Optional[BaseException]) -> None:
    """Collective: if any rank holds ``error``, every rank raises -- the failing rank its own error, the
    others the first failing rank's class and message (so every rank exits with the same status and rank 0
    can print the message once)."""
    if not dp.active:
        if error is not None:
            raise error
        return
    flags = dp.sum_metrics({f"rank{r}": float(error is not None and r == dp.rank) for r in range(dp.world)})
    failed = [r for r in range(dp.world) if flags[f"rank{r}"]]
    if not failed:
        return
    first = dp.broadcast_object(error if dp.rank == failed[0] else None, src=failed[0])
    raise error if error is not None else first


def claim_together(dp, claim: Callable[[], T]) -> T:
    """Collective: ``claim()`` on every rank (the run lock: rank 0 takes it, the others only check), and a
    refusal on any rank raised on every rank. Without it, the other ranks of a launch whose rank 0 was refused
    go on to their first collective and wait there for a rank that has left."""
    held, error = None, None
    try:
        held = claim()
    except Exception as e:  # noqa: BLE001 - raised on every rank by stop_together
        error = e
    try:
        stop_together(dp, error)
    except BaseException:
        if held is not None and hasattr(held, "release"):
            held.release()
        raise
    return held


class StepBoundary:
    """The resumable state (the checkpoint's ``state`` dict and the RNG) of the last completed step."""

    def __init__(self) -> None:
        self.step, self.state, self.rng, self.applied = 0, None, None, False

    def begin(self, step: int, state: dict) -> None:
        """Called before ``step`` draws anything: ``state`` is the run's state after step - 1."""
        self.step, self.state, self.rng, self.applied = step, state, ckpt.rng_state(), False

    def update_applied(self) -> None:
        """From here on the step's update is in the weights: a stop checkpoints this step."""
        self.applied = True

    def completed(self) -> tuple[int, Optional[dict]]:
        """(the last completed step, its state or None = the run's current state)."""
        if self.applied:
            return self.step, None
        if self.rng is not None:
            ckpt.set_rng_state(self.rng)  # the checkpoint records the RNG as it was after that step
        return self.step - 1, self.state


def checkpoint_on_stop(run_dir: Path, boundary: StepBoundary, save) -> str:
    """Write the last completed step's checkpoint unless it exists; ``save(step, state)`` writes one.

    Returns the sentence the stop message ends with. Never raises: the stop's own error matters more.
    """
    step, state = boundary.completed()
    done = dict(ckpt.list_checkpoints(run_dir))
    if step in done and ckpt.verify_checkpoint(done[step]) is None:  # not a damaged one resume skipped
        return f"the last completed step {step} is checkpointed at {done[step]}; continue with --resume"
    if step <= 0:
        return "no step was completed, so there is nothing to checkpoint"
    try:
        path = save(step, state)
    except Exception as e:  # noqa: BLE001 - reported in the message instead
        return f"writing the checkpoint of step {step} failed too ({type(e).__name__}: {e})"
    return f"checkpoint of the last completed step {step} written to {path}; continue with --resume"
