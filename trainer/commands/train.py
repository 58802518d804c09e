"""`parityrl train` (and `accelerate launch -m trainer.train`): load the recipe, run the RL loop, map how it ended
to the documented exit statuses (README "Errors and exit statuses")."""
from __future__ import annotations

import sys

from trainer.config import RecipeError, load_recipe


def run_train_command(recipe: str, overrides: list[str], *, resume: bool) -> int:
    try:
        cfg = load_recipe(recipe, overrides)
    except RecipeError as e:
        print(f"parityrl: invalid recipe: {e}", file=sys.stderr)
        return 2
    from rollout.server_engine import EngineUnavailable
    from trainer.rl.loop import ParityLimitExceeded, train

    try:
        train(cfg, resume=resume)
    except RecipeError as e:  # found once data or model is loaded: over-long prompts, an architecture the recipe cannot run on
        print(f"parityrl: invalid recipe: {e}", file=sys.stderr)
        return 2
    except (FileExistsError, FileNotFoundError) as e:  # run-directory state: a user decision, not a crash
        print(f"parityrl: {e}", file=sys.stderr)
        return 2
    except ParityLimitExceeded as e:
        print(f"parityrl: stopped: {e}", file=sys.stderr)
        return 3
    except EngineUnavailable as e:  # a dead rollout server: the message names the URL and how to resume
        print(f"parityrl: stopped: {e}", file=sys.stderr)
        return 4
    return 0
