"""reward.timeout_s and reward functions that exit: each is a failure of that reward, named, never a clean exit."""
import signal
import threading
import time
from pathlib import Path

import pytest

from trainer.config import RewardConfig
from trainer.rewards.functions import compute_rewards
from trainer.rewards.sources import build_reward_sources
from trainer.rewards.time_limit import RewardError, bounded

REPO = Path(__file__).resolve().parents[3]
P, C = ["1+1=", "2+2="], ["2", "5"]


def ok(prompts, completions, **kw):
    return [float(len(c)) for c in completions]


def hangs(prompts, completions, **kw):
    time.sleep(60)


def exits(prompts, completions, **kw):
    raise SystemExit(0)


def interrupts(prompts, completions, **kw):
    raise KeyboardInterrupt


def wants_main_thread(prompts, completions, **kw):
    signal.signal(signal.SIGALRM, signal.SIG_IGN)  # what signal-based timeout decorators do
    return [0.0] * len(prompts)


def test_a_call_within_the_limit_returns_its_rewards():
    assert compute_rewards({"ok": bounded(ok, "ok", 5.0)}, {}, P, C, {}) == ([1.0, 1.0], {"ok": [1.0, 1.0]})


def test_a_call_past_the_limit_is_a_failure_naming_the_function_and_the_limit():
    t = time.monotonic()
    with pytest.raises(RewardError, match=r"reward function 'slow' did not return within reward.timeout_s = 0.2 s"):
        compute_rewards({"slow": bounded(hangs, "slow", 0.2)}, {}, P, C, {})
    assert time.monotonic() - t < 30  # returned long before the function would have (60 s)


@pytest.mark.parametrize("timeout_s", [5.0, None], ids=["bounded", "unbounded"])
@pytest.mark.parametrize("fn, raised", [(exits, r"SystemExit\(0\)"), (interrupts, r"KeyboardInterrupt\(\)")],
                         ids=["SystemExit", "KeyboardInterrupt"])
def test_exiting_from_a_reward_function_is_a_failure_of_that_function(fn, raised, timeout_s):
    with pytest.raises(RewardError, match=rf"reward function 'bad' raised {raised}: a reward function must return"):
        compute_rewards({"bad": bounded(fn, "bad", timeout_s)}, {}, P, C, {})


def test_an_exception_keeps_its_type_and_names_the_function():
    def broken(prompts, completions, **kw):
        raise ZeroDivisionError("x")

    with pytest.raises(ZeroDivisionError) as info:
        compute_rewards({"broken": bounded(broken, "broken", 5.0)}, {}, P, C, {})
    assert info.value.__notes__ == ["raised by reward function 'broken'"]


def test_code_that_needs_the_main_thread_is_told_how_to_get_it():
    with pytest.raises(RewardError, match=r"'needy' raised ValueError: .*main thread.*reward.timeout_s: null"):
        compute_rewards({"needy": bounded(wants_main_thread, "needy", 5.0)}, {}, P, C, {})
    previous = signal.getsignal(signal.SIGALRM)
    try:  # unbounded: called in this (the main) thread, where it works
        assert compute_rewards({"needy": bounded(wants_main_thread, "needy", None)}, {}, P, C, {})[0] == [0.0, 0.0]
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_a_signal_handler_runs_while_a_reward_call_is_waited_for():
    # The loop's SIGTERM handler ("stopping after this step") must run during the wait, and the wait still ends.
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        threading.Timer(0.1, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)).start()
        with pytest.raises(RewardError, match="did not return within"):
            bounded(hangs, "slow", 1.0)(P, C)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert seen == [signal.SIGUSR1]


def test_the_recipe_limit_applies_to_functions_not_to_reward_models():
    fns, _ = build_reward_sources(RewardConfig(functions={"slow": f"{__name__}:hangs"}, timeout_s=0.2), "cpu")
    with pytest.raises(RewardError, match="reward.timeout_s = 0.2 s"):
        fns["slow"](P, C)
    fns, _ = build_reward_sources(RewardConfig(functions={"ok": f"{__name__}:ok"}, timeout_s=None), "cpu")
    assert fns["ok"] is ok


@pytest.mark.parametrize("value", ["0", "-1", ".nan", "true"])
def test_the_recipe_refuses_a_limit_that_is_not_a_positive_number_of_seconds(value):
    from trainer.config import RecipeError
    from trainer.lifecycle.preflight import load_recipe

    with pytest.raises(RecipeError, match=r"reward.timeout_s"):
        load_recipe(str(REPO / "recipes/grpo_tiny.yaml"), [f"reward.timeout_s={value}"])


@pytest.mark.parametrize("value, expected", [("null", None), ("5", 5.0), ("0.5", 0.5)])
def test_the_recipe_takes_null_or_seconds(value, expected):
    from trainer.lifecycle.preflight import load_recipe

    assert load_recipe(str(REPO / "recipes/grpo_tiny.yaml"), [f"reward.timeout_s={value}"]).reward.timeout_s == expected
