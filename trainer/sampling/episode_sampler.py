"""The sampling round of a multi-turn step (``env:`` set): episodes instead of single completions.

``EpisodeSampler`` is ``Sampler``'s counterpart (trainer/sampling/sampler.py) and hands the rest of the step the same
``Drawn``: its rollouts are the episodes' token streams with ``completion_mask`` (1 sampled, 0 the environment's
replies), so scoring, advantages, losses and parity see only sampled tokens without knowing about turns
(trainer/sampling/episodes.py runs them, batched one turn per engine call).

Rewards (the issue's contract): the environment's step rewards, summed per episode (``reward/env``, an
``env.class`` only), plus the recipe's reward functions, called as for single-turn completions with
``completions`` = the episode's assistant turns joined by newlines and the conversation as the ``messages``
column (prompt, every assistant turn as sampled text, every reply), weighted as ``reward.weights`` says; the
environment's sum weighs 1.

Per episode it records (``Drawn.episodes``; ``episode_metrics`` pools them over ranks): assistant turns, tool
calls and tool errors (a tool environment's counters; 0 for a class without them), whether it ended over a limit
(finish reason ``length``), and retokenization drift: whether decoding each turn and rendering the conversation
again (what a text pipeline would have trained on, ``trainer.sampling.turn_tokens.retokenize_drift``) gives other ids
than the ones trained on, and at how many sampled positions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from rollout.base import EngineUnavailable
from rollout.types import SamplingSpec
from trainer.config import RunConfig
from trainer.data.datasets import chat_messages
from trainer.environments.contract import EnvironmentContractError
from trainer.environments.episode_environment import EpisodeEnvironment
from trainer.lifecycle.stops import EngineFailed, EnvironmentFailed, stop_together
from trainer.sampling.drawn import Drawn
from trainer.sampling.episodes import EnvironmentTimeout, run_episodes
from trainer.sampling.sampler import Sampler, missing_supports, rewards_of
from trainer.sampling.turn_tokens import TemplateNotAppendOnly, retokenize_drift

# The per-episode records of ``Drawn.episodes`` (each a list with one float per sample).
EPISODE_STATS = ("turns", "tool_calls", "tool_errors", "truncated", "drift", "drift_tokens", "sampled_tokens")


@dataclass
class EpisodeSampler(Sampler):
    """What a multi-turn sampling round needs: ``Sampler``'s fields plus the environment."""

    environment: EpisodeEnvironment = None

    def sample(self, rows: list[dict], spec: SamplingSpec, step: int, *, first: int, total: int) -> Drawn:
        """``rows`` (this rank's) run as episodes, scored and measured (``Sampler.sample``'s contract). Seeds
        (trainer/sampling/episodes.py): episode ``first + i``'s turn t is sample ``spec.index_offset + t * total + first +
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
        error = error or missing_supports(spec, rollouts, self.engine, step)
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


def sampler_for(environment: EpisodeEnvironment | None, **shared) -> Sampler:
    """The sampling round of a run: episodes with an ``env`` (``environment``), completions without; ``shared``:
    ``Sampler``'s fields."""
    return Sampler(**shared) if environment is None else EpisodeSampler(**shared, environment=environment)
