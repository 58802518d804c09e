"""The sampling round of a multi-turn step (``env:`` set): episodes instead of single completions.

``EpisodeSampler`` is ``Sampler``'s counterpart (trainer/rl/sampling.py) and hands the rest of the step the same
``Drawn``: its rollouts are the episodes' token streams with ``completion_mask`` (1 sampled, 0 the environment's
replies), so scoring, advantages, losses and parity see only sampled tokens without knowing about turns
(trainer/rl/episodes.py runs them, batched one turn per engine call).

Rewards (the issue's contract): the environment's step rewards, summed per episode (``reward/env``, an
``env.class`` only), plus the recipe's reward functions, called as for single-turn completions with
``completions`` = the episode's assistant turns joined by newlines and the conversation as the ``messages``
column (prompt, every assistant turn as sampled text, every reply), weighted as ``reward.weights`` says; the
environment's sum weighs 1.

Per episode it records (``Drawn.episodes``; ``episode_metrics`` pools them over ranks): assistant turns, tool
calls and tool errors (a tool environment's counters; 0 for a class without them), whether it ended over a limit
(finish reason ``length``), and retokenization drift: whether decoding each turn and rendering the conversation
again (what a text pipeline would have trained on, ``trainer.rl.turn_tokens.retokenize_drift``) gives other ids
than the ones trained on, and at how many sampled positions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from rollout.base import EngineUnavailable
from rollout.types import SamplingSpec
from trainer.config import RecipeError, RunConfig
from trainer.config.validate import episode_max_tokens
from trainer.data.datasets import chat_messages
from trainer.environments.contract import EnvironmentContractError
from trainer.environments.loading import resolve_environment_class, resolve_tools
from trainer.environments.tools import ToolEnvironment
from trainer.rl.dynamic_sampling import Drawn
from trainer.rl.episodes import EnvironmentTimeout, EpisodeLimits, run_episodes
from trainer.rl.sampling import Sampler, rewards_of
from trainer.rl.stops import EngineFailed, EnvironmentFailed, stop_together
from trainer.rl.turn_tokens import TemplateNotAppendOnly, retokenize_drift

# The per-episode records of ``Drawn.episodes`` (each a list with one float per sample).
EPISODE_STATS = ("turns", "tool_calls", "tool_errors", "truncated", "drift", "drift_tokens", "sampled_tokens")


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


@dataclass
class EpisodeSampler(Sampler):
    """What a multi-turn sampling round needs: ``Sampler``'s fields plus the environment."""

    environment: EpisodeEnvironment = None

    def sample(self, rows: list[dict], spec: SamplingSpec, step: int, *, first: int, total: int) -> Drawn:
        """``rows`` (this rank's) run as episodes, scored and measured (``Sampler.sample``'s contract). Seeds
        (trainer/rl/episodes.py): episode ``first + i``'s turn t is sample ``spec.index_offset + t * total + first +
        i``; a round's turns all come after the earlier rounds' (``Sampler.draw``'s offset, times max_turns)."""
        cfg, dp, tokenizer, env = self.cfg, self.dp, self.tokenizer, self.environment
        t = time.perf_counter()
        prompts = [chat_messages(tokenizer, r["prompt"], cfg.data.system_prompt) for r in rows]
        rollouts, episodes, error = None, None, None
        try:
            rollouts, episodes = run_episodes(
                self.engine, tokenizer, prompts, rows, env.make,
                replace(spec, index_offset=spec.index_offset * env.limits.max_turns), env.limits, tools=env.tools,
                template_kwargs=env.template_kwargs, first_episode=first, episode_stride=total)
        except EngineUnavailable as e:
            error = e
        except (EnvironmentTimeout, EnvironmentContractError, TemplateNotAppendOnly) as e:
            error = EnvironmentFailed(f"step {step}: {' '.join(str(e).split())}")
            error.__cause__ = e
        except Exception as e:  # noqa: BLE001 - every rank stops with it (stop_together)
            error = _classify(step, e)
        stop_together(dp, error)
        generate_s = time.perf_counter() - t
        t = time.perf_counter()
        stats = episode_stats(episodes, rollouts, tokenizer, env)
        total, per_fn, error = _rewards(self.reward_fns, cfg, rows, episodes, spec.n, step)
        stop_together(dp, error)
        return Drawn(rows=rows, rollouts=rollouts, rewards=total, per_fn=per_fn, generate_s=generate_s,
                     reward_s=time.perf_counter() - t, episodes=stats)


def _classify(step: int, e: Exception) -> Exception:
    """An error out of ``run_episodes`` that is not the engine's own class: the environment's when a note names it."""
    notes = " ".join(getattr(e, "__notes__", []))
    if "raised by environment" in notes:
        error = EnvironmentFailed(f"step {step}: {notes}: {type(e).__name__}: {' '.join(str(e).split())}")
    else:
        error = EngineFailed(f"step {step}: the rollout engine failed to generate: {type(e).__name__}: "
                             f"{' '.join(str(e).split())}")
    error.__cause__ = e
    return error


def _rewards(reward_fns: dict, cfg: RunConfig, rows: list[dict], episodes, g: int, step: int):
    """(total, per source, error): the environment's summed step rewards plus the recipe's functions on episodes."""
    env_rewards = [float(e.reward) for e in episodes]
    per_fn = {"env": env_rewards} if cfg.env.class_ is not None else {}
    if not reward_fns:
        return env_rewards, per_fn, None
    columns = {k: [r[k] for r in rows for _ in range(g)] for k in rows[0] if k != "prompt"}
    columns["messages"] = [e.messages for e in episodes]
    fn_total, fn_values, error = rewards_of(reward_fns, cfg.reward.weights, [r["prompt"] for r in rows for _ in range(g)],
                                            ["\n".join(e.assistant_texts) for e in episodes], columns, step)
    if error is not None:
        return None, None, error
    return [a + b for a, b in zip(env_rewards, fn_total)], {**per_fn, **fn_values}, None


def episode_stats(episodes, rollouts, tokenizer, env: EpisodeEnvironment) -> dict[str, list[float]]:
    """``EPISODE_STATS`` of every episode, one float each (see the module docstring)."""
    out: dict[str, list[float]] = {k: [] for k in EPISODE_STATS}
    for i, e in enumerate(episodes):
        mask = rollouts.sampled_mask(i)
        differs, n = retokenize_drift(tokenizer, e.messages, e.prompt_ids + e.ids, [0] * len(e.prompt_ids) + mask,
                                      env.tools, template_kwargs=env.template_kwargs)
        for key, value in (("turns", e.turns), ("tool_calls", getattr(e.env, "tool_calls", 0)),
                           ("tool_errors", getattr(e.env, "tool_errors", 0)), ("truncated", e.finish == "length"),
                           ("drift", differs), ("drift_tokens", n), ("sampled_tokens", sum(mask))):
            out[key].append(float(value))
    return out
