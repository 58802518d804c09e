"""`parityrl train` (and `accelerate launch -m trainer.train`): load the recipe, check it against its files, run
the RL loop, and map how it ended to the documented exit statuses (docs/runs-and-checkpoints.md "Errors and exit statuses"):

0 done; 1 an unexpected error (a bug: one line, the traceback with --debug or PARITYRL_DEBUG=1);
2 the input was refused before anything started (recipe, --set, dataset, reward module, paths, run directory);
3 a parity limit with ``parity.on_violation: stop``; 4 the rollout engine failed or its server is unavailable;
5 a reward function failed mid-run; 128 + N stopped by signal N (SIGTERM 143, SIGINT 130) at a step boundary.
Statuses 3-5 and 128 + N leave a checkpoint of the last completed step, named in the message.
"""
from __future__ import annotations

import os
import sys

from trainer.config import RecipeError
from trainer.rl.preflight import load_recipe, preflight


def debug_requested(flag: bool = False) -> bool:
    return flag or os.environ.get("PARITYRL_DEBUG", "") not in ("", "0")


def _say(message: str) -> None:
    # One line, once: with several ranks every rank stops with the same error, rank 0 reports it.
    if os.environ.get("RANK", "0") == "0":
        print(f"parityrl: {' '.join(message.split())}", file=sys.stderr, flush=True)


def run_train_command(recipe: str, overrides: list[str], *, resume: bool, debug: bool = False) -> int:
    try:
        cfg = load_recipe(recipe, overrides)
        preflight(cfg, str(recipe))
    except RecipeError as e:
        if os.environ.get("RANK", "0") == "0":  # one line per problem, from rank 0 only
            print(e.lines("parityrl: invalid recipe: "), file=sys.stderr, flush=True)
        return 2
    # late: the loop imports vLLM (seconds); a refused recipe has answered before that
    from rollout.base import EngineUnavailable
    from trainer.rl.loop import train
    from trainer.rl.stops import RunStopped

    try:
        train(cfg, resume=resume)
    except RecipeError as e:  # found once data or model is loaded: over-long prompts, an architecture the recipe cannot run on
        print(e.lines("parityrl: invalid recipe: "), file=sys.stderr)
        return 2
    except (FileExistsError, FileNotFoundError) as e:  # run-directory state: a user decision, not a crash
        _say(str(e))
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the loop's own handler is installed (loading, engine start)
        _say("interrupted while starting up, before this process trained a step; nothing to checkpoint")
        return 130
    except (RunStopped, EngineUnavailable) as e:  # the message names the cause; the note, the checkpoint
        _say(f"stopped: {e}; {getattr(e, 'checkpoint_note', '')}")
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
