"""The environment contract (issue 34) and the checks of what an environment returns.

One instance per episode::

    class MyEnv:
        def reset(self, row: dict) -> list[dict] | None: ...
        def step(self, message: dict) -> tuple[list[dict], float | None, bool]: ...

``reset`` gets the dataset row (every column, e.g. ``prompt``, ``answer``) and returns messages appended after
the dataset's prompt (None: none). ``step`` gets the assistant's turn, parsed
(``{"role": "assistant", "content": str, "tool_calls": [...], "tool_call_errors": [...]}``, see
``trainer.environments.tool_calls``), and returns the messages to append (e.g. role "user" or "tool"), this
step's reward or None, and whether the episode is over.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Protocol, runtime_checkable

__all__ = ["Environment", "EnvironmentContractError", "check_messages", "check_reset_result", "check_step_result"]


@runtime_checkable
class Environment(Protocol):
    """What the loop calls on an environment; any class with these two methods is one (no base class)."""

    def reset(self, row: dict) -> list[dict] | None: ...

    def step(self, message: dict) -> tuple[list[dict], float | None, bool]: ...


class EnvironmentContractError(ValueError):
    """An environment returned something outside the contract; the message names the environment.

    (Not ``EnvironmentError``: that name is a builtin alias of ``OSError``.)"""


def check_step_result(result: Any, env_name: str) -> tuple[list[dict], float | None, bool]:
    """``result`` of ``env_name``'s ``step``, checked: ``(messages, reward, done)`` with reward a float or None.

    Raises ``EnvironmentContractError`` naming ``env_name`` when ``result`` is not a 3-tuple (a list of 3 is taken),
    a message is not a dict with a str ``role`` (not "assistant") and a str ``content``, ``reward`` is not a
    finite real number (numpy/torch scalars and bools taken, as reward functions' are) or None, or ``done`` is
    not a bool (numpy's bool taken).
    """
    where = f"environment {env_name!r}: step()"
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        shape = f"a {type(result).__name__}" + (f" of length {len(result)}" if isinstance(result, (tuple, list))
                                                  else "")
        raise EnvironmentContractError(f"{where} returned {shape}; expected a tuple (messages, reward, done)")
    messages, reward, done = result
    checked = check_messages(messages, f"{where} messages")
    if reward is not None:
        if hasattr(reward, "item") and getattr(reward, "ndim", 0) == 0:
            reward = reward.item()
        if not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
            raise EnvironmentContractError(f"{where} returned reward {reward!r} ({type(reward).__name__}); expected a "
                                    "finite number or None")
        reward = float(reward)
    if hasattr(done, "item") and getattr(done, "ndim", 0) == 0 and not isinstance(done, bool):
        done = done.item()
    if not isinstance(done, bool):
        raise EnvironmentContractError(f"{where} returned done={done!r} ({type(done).__name__}); expected True or False")
    return checked, reward, done


def check_reset_result(result: Any, env_name: str) -> list[dict]:
    """``result`` of ``env_name``'s ``reset``, checked: a list of messages (None: an empty list)."""
    if result is None:
        return []
    return check_messages(result, f"environment {env_name!r}: reset() messages")


def check_messages(messages: Any, where: str) -> list[dict]:
    """``messages`` checked as a list of chat messages; ``where`` starts every error.

    Role "assistant" is refused: assistant turns are what the engine samples, the only tokens trained, and
    ``trainer.sampling.turn_tokens.retokenize_drift`` pairs each assistant message with a run of sampled ids.
    """
    if not isinstance(messages, (list, tuple)):
        raise EnvironmentContractError(f"{where}: got a {type(messages).__name__}; expected a list of message dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise EnvironmentContractError(f"{where}[{i}] is a {type(m).__name__}; expected a dict with 'role' and "
                                    "'content'")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise EnvironmentContractError(f"{where}[{i}] has role {role!r}; expected a non-empty str such as 'user' or "
                                    "'tool'")
        if role == "assistant":
            raise EnvironmentContractError(f"{where}[{i}] has role 'assistant'; an environment replies as 'user' or "
                                    "'tool' (assistant turns are what the model samples)")
        if not isinstance(content, str):
            raise EnvironmentContractError(f"{where}[{i}] (role {role!r}) has content {content!r} "
                                    f"({type(content).__name__}); expected a str")
    return list(messages)
