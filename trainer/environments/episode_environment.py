"""What a recipe's ``env:`` section names, resolved once before anything heavy starts: a factory of one environment
per episode, the tools it offers, and the limits every episode runs under (``EpisodeLimits``).

The preflight resolves it to check the recipe (``trainer.lifecycle.preflight``); the run resolves it again and
hands it to the episode sampler (``trainer.sampling.episode_sampler``), which runs the episodes
(``trainer.sampling.episodes``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from trainer.config import RecipeError, RunConfig
from trainer.config.validate import episode_max_tokens
from trainer.environments.loading import resolve_environment_class, resolve_tools
from trainer.environments.tools import ToolEnvironment

__all__ = ["EpisodeEnvironment", "EpisodeLimits"]


@dataclass(frozen=True)
class EpisodeLimits:
    """max_turns: assistant turns; max_tokens: prompt + every turn and reply; max_observation_tokens: one reply's ids;
    step_timeout_s: one ``reset`` / ``step`` call (None: no limit)."""

    max_turns: int
    max_tokens: int
    max_observation_tokens: int
    step_timeout_s: float | None = 60.0


@dataclass
class EpisodeEnvironment:
    """What ``env:`` names, resolved once: a factory of one environment per episode and the tools it offers."""

    make: Callable[[], Any]
    tools: list[dict] | None
    limits: EpisodeLimits
    template_kwargs: dict

    @classmethod
    def from_config(cls, cfg: RunConfig, where: str) -> "EpisodeEnvironment":
        """Resolved and checked (contract, tool schemas) before anything heavy starts: ``RecipeError`` naming
        ``where`` (the recipe file) and the key."""
        e = cfg.env
        key, spec = ("env.class", e.class_) if e.class_ is not None else ("env.tools", e.tools)
        try:
            if e.class_ is not None:
                make, tools = resolve_environment_class(e.class_), None
                if issubclass(make, ToolEnvironment):  # a class built on the tool environment offers its tools
                    tools = make().schemas
            else:
                toolbox = resolve_tools(e.tools)
                tools = toolbox.schemas

                def make() -> ToolEnvironment:
                    return ToolEnvironment(toolbox, max_turns=e.max_turns, timeout_s=e.timeout_s)
        except (ImportError, FileNotFoundError, AttributeError, TypeError, ValueError) as err:
            raise RecipeError(f"{where}: {key} = {spec!r}: {' '.join(str(err).split())}") from err
        # A tool environment bounds each tool call itself (ToolEnvironment.timeout_s), so a step with several calls
        # may take several limits; a class's step is one call of the user's code.
        step_limit = None if e.class_ is None else e.timeout_s
        limits = EpisodeLimits(max_turns=e.max_turns, max_tokens=episode_max_tokens(cfg),
                               max_observation_tokens=e.max_observation_tokens, step_timeout_s=step_limit)
        return cls(make=make, tools=tools, limits=limits, template_kwargs=dict(e.template_kwargs))

    def check_template(self, tokenizer, cfg: RunConfig, where: str) -> None:
        """A recipe asking for tools on a chat template that does not render them: ``RecipeError`` before the engine
        starts (the model would never see the tools, and every episode would end at its first answer)."""
        if not self.tools:
            return
        messages = [{"role": "user", "content": "?"}]
        try:
            text = tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False, add_generation_prompt=True,
                                                 **self.template_kwargs)
        except Exception as err:  # noqa: BLE001 - a template's own raise_exception, any type
            raise RecipeError(f"{where}: env.tools: the chat template of {cfg.model.path!r} cannot render "
                              f"a conversation with tools: {type(err).__name__}: {err}") from err
        missing = [t["function"]["name"] for t in self.tools if t["function"]["name"] not in text]
        if missing:
            raise RecipeError(f"{where}: env.tools: the chat template of {cfg.model.path!r} does not offer "
                              f"tools (its rendering names none of {missing}); expected a template with tool support "
                              "(a 'tools' variable), e.g. Qwen2.5's, or an env.class that states its tools in reset()")


def reward_sources(cfg: RunConfig) -> Optional[str]:
    """One line saying what an episode's reward is made of when an environment class brings its own and the recipe
    also names reward functions (both are summed: docs/episodes.md "Rewards"); None otherwise."""
    names = list(cfg.reward.functions)
    if cfg.env.class_ is None or not names:
        return None
    return (f"episode reward = the environment's ({cfg.env.class_}: reward/env) + reward.functions {names}, summed; "
            "set reward.functions: {} for the environment's alone")
