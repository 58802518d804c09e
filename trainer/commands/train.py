"""`parityrl train` (and `accelerate launch -m trainer.train`): load the recipe, check it against its files, run
the RL loop, and map how it ended to the documented exit statuses (docs/runs-and-checkpoints.md "Errors and exit statuses"):

0 done; 1 an unexpected error (a bug: one line, the traceback with --debug or PARITYRL_DEBUG=1);
2 the input was refused before anything started (recipe, --set, dataset, reward module, paths, run directory);
3 a parity limit with ``parity.on_violation: stop``; 4 the rollout engine failed or its server is unavailable;
5 a reward function failed mid-run; 6 a checkpoint, a step's record, or (at the start) the run directory or
one of its first files could not be written (a full disk, no permission); 7 an episode's environment failed;
128 + N stopped by signal N (SIGTERM 143, SIGINT 130) at a step boundary.
Statuses 3-7 and 128 + N leave a checkpoint of the last completed step, named in the message (a start that
could not write its run directory trained nothing).
"""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Optional

from trainer.config import RecipeError, RunConfig
from trainer.lifecycle.preflight import inspect_recipe, named_key


def debug_requested(flag: bool = False) -> bool:
    return flag or os.environ.get("PARITYRL_DEBUG", "") not in ("", "0")


def _say(message: str) -> None:
    # One line, once: with several ranks every rank stops with the same error, rank 0 reports it.
    if os.environ.get("RANK", "0") == "0":
        print(f"parityrl: {' '.join(message.split())}", file=sys.stderr, flush=True)


def resume_command(recipe: str, overrides: list[str], prog: str = "parityrl train") -> str:
    """The command line that continues this run: ``prog`` (as it is, a shell command's start), the recipe and
    every ``--set`` as given (the run's name and directory among them), then ``--resume``; quoted for a POSIX
    shell."""
    return f"{prog} " + shlex.join([str(recipe), *(a for o in overrides for a in ("--set", o)), "--resume"])


def with_resume_command(message: str, command: str) -> str:
    """``message`` with its "continue with --resume" hint naming the whole command that does it."""
    return (message.replace("continue with --resume", f"continue with `{command}`")
            .replace("pass --resume to continue it", f"continue it with `{command}`"))


def run_dir_problem(cfg: RunConfig, *, resume: bool, command: str) -> Optional[str]:
    """Why the run directory's state refuses this start (another process holds it, --resume without a usable
    checkpoint, a new run over an old one's checkpoints), or None. Reads only; the loop checks again when it
    claims the directory."""
    from trainer.io import checkpoint as ckpt  # late: as the loop below (torch)
    from trainer.io.run_lock import check_free
    from trainer.lifecycle.run_state import choose_checkpoint, existing_run_message

    try:
        check_free(Path(cfg.run_dir))
        if resume:
            choose_checkpoint(Path(cfg.run_dir), verbose=False)
        elif ckpt.step_dirs(Path(cfg.run_dir)):
            return existing_run_message(cfg, f"continue it with `{command}`")
    except (FileExistsError, FileNotFoundError) as e:
        return str(e)
    return None


def run_train_command(recipe: str, overrides: list[str], *, resume: bool, debug: bool = False,
                      prog: str = "parityrl train") -> int:
    command = resume_command(recipe, overrides, prog)
    # every problem found before a model loads, in one report: the recipe's, then the run directory's
    try:
        cfg, problems = inspect_recipe(recipe, overrides)
    except RecipeError as e:  # the recipe file itself cannot be read: nothing else to check
        cfg, problems = None, e.problems
    lines = [f"parityrl: invalid recipe: {' '.join(p.split())}" for p in problems]
    unknown_dir = cfg is None or any(named_key(p) in ("name", "logging.run_dir") for p in problems)
    state = None if unknown_dir else run_dir_problem(cfg, resume=resume, command=command)
    if state:
        lines.append(f"parityrl: {' '.join(state.split())}")
    if lines:
        if os.environ.get("RANK", "0") == "0":  # one line per problem, from rank 0 only
            print("\n".join(lines), file=sys.stderr, flush=True)
        return 2
    # late: the loop imports vLLM (seconds); a refused recipe has answered before that
    from rollout.base import EngineCannotLoad, EngineUnavailable
    from trainer.builtin.warm_start import BelowFloor
    from trainer.io.write_failure import StartNotWritten
    from trainer.lifecycle.stops import RunStopped
    from trainer.rl.loop import train

    try:
        train(cfg, resume=resume)
    except RecipeError as e:  # found once data or model is loaded: over-long prompts, an architecture the recipe cannot run on
        print(e.lines("parityrl: invalid recipe: "), file=sys.stderr)
        return 2
    except (FileExistsError, FileNotFoundError) as e:  # run-directory state: a user decision, not a crash
        _say(with_resume_command(str(e), command))
        return 2
    except StartNotWritten as e:  # as a full disk mid-run (status 6), not as a bug
        _say(f"stopped: {e}; nothing was trained"
             + (f", its checkpoints are untouched: fix that and continue with `{command}`" if resume
                else ": fix that and start it again"))
        return e.exit_status
    except KeyboardInterrupt:  # Ctrl-C before the loop's own handler is installed (loading, engine start)
        _say("interrupted while starting up, before this process trained a step; nothing to checkpoint"
             + (f"; its checkpoints are untouched: continue with `{command}`" if resume else ""))
        return 130
    except BelowFloor as e:  # a built-in model's build came out weaker than its floor: nothing cached, nothing run
        _say(f"stopped: {e}; nothing was trained")
        return e.exit_status
    except EngineCannotLoad as e:  # at start, before any step: nothing to resume
        _say(f"stopped: {e}; nothing was trained (the engine cannot run this model: docs/doctor.md)")
        return e.exit_status
    except (RunStopped, EngineUnavailable) as e:  # the message names the cause; the note, the checkpoint
        _say(with_resume_command(f"stopped: {e}; {getattr(e, 'checkpoint_note', '')}", command))
        return getattr(e, "exit_status", 4)  # EngineUnavailable: a dead rollout server
    except Exception as e:
        if debug_requested(debug):
            raise
        _say(f"error: {type(e).__name__}: {e} (an unexpected failure: run with --debug or PARITYRL_DEBUG=1 for "
             "the traceback)")
        return 1
    from trainer.distributed.teardown import leave_process_group  # late: as the loop above

    leave_process_group()
    return 0
