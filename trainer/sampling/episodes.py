"""Multi-turn episodes, batched: every live episode advances one assistant turn per engine call.

An episode starts from a dataset row's prompt messages (plus what its environment's ``reset`` adds), rendered
once by the chat template with the tools offered. Each turn the engine samples for every live episode in one
``generate`` (one request each, n = 1); each sampled turn is parsed into an assistant message
(``trainer.environments.tool_calls.parse_assistant``) and handed to its environment's ``step``, all episodes'
steps at once in threads under one time limit. The environment's reply becomes ids by
``trainer.sampling.turn_tokens.observation_ids`` (the chat template's delta after the sampled turn) and the next turn
reads ``prompt + everything so far``: the ids the engine sampled are never decoded and encoded again.

The result is ordinary ``Rollouts`` (``rollout.types``): per episode, the prompt ids and one completion stream
``turn 1 | reply 1 | turn 2 | ...`` whose ``completion_mask`` is 1 on sampled ids and 0 on replies, so the
trainer scores exactly the ids the engine read and sampled (DESIGN.md, "Episodes").

An episode ends: when its environment says done (a tool environment: the model answered without a tool call),
at ``max_turns`` assistant turns ("stop"), or over a limit ("length", counted as truncated): a turn cut by the
engine's token cap, a reply longer than ``max_observation_tokens``, or a stream that would pass ``max_tokens``
(prompt and every turn and reply). A turn's cap is ``min(spec.max_new_tokens, max_tokens - tokens so far)``;
episodes with the same cap share a call, so a turn is one call until some episode nears its budget.

Seeds: episode i's turn t (from 0) is sample ``index_offset + t * episode_stride + first_episode + i``
(``SamplingSpec.sample_indices``): its own index whatever else is live, so no two turns of a step share a seed,
the same step, weights and environments give the same episodes, and a data-parallel rank running its shard
(``first_episode`` = its first episode's global index, ``episode_stride`` = the episodes of every rank) samples
exactly what one process running them all would.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import torch

from rollout.routes import NO_ROUTE, extend_routes
from rollout.support import Support
from rollout.types import Rollouts, SamplingSpec
from trainer.environments.contract import check_reset_result, check_step_result
from trainer.environments.episode_environment import EpisodeLimits
from trainer.environments.tool_calls import parse_assistant
from trainer.sampling.turn_tokens import observation_ids

__all__ = ["Episode", "EnvironmentTimeout", "run_episodes"]


class EnvironmentTimeout(RuntimeError):
    """An environment's ``reset`` or ``step`` did not return within the step time limit."""


@dataclass
class Episode:
    """One episode's record. ``ids`` / ``mask`` / ``logprobs``: the completion stream after ``prompt_ids``, 1 / the
    engine's log-prob on sampled ids, 0 / 0.0 on replies. ``reward``: the sum of the environment's step rewards."""

    env: Any
    messages: list[dict]
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    assistant_texts: list[str] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    finish: str = "stop"
    live: bool = True
    index: int = 0  # global index: turn t's sample index is index_offset + t * episode_stride + index
    routes: Optional[torch.Tensor] = None  # an MoE engine's routes of the positions its turns computed
    # a truncated sampler's kept sets: each turn's from the engine, an empty set at every reply position
    support: list[Support] = field(default_factory=list)
    # with SamplingSpec.logprobs_topk = k > 0: the engine's k most likely ids and their log-probs at each sampled
    # position, k zeros at each reply position (masked out, as a batch's padding is: trainer.models.batch)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    # in-flight weight updates (Rollouts.versions / stale_kv): each sampled token's engine weight version and whether
    # it read older weights' KV; a reply carries the version of the turn before it, never stale
    versions: list[int] = field(default_factory=list)
    stale_kv: list[int] = field(default_factory=list)

    def full_routes(self, like: torch.Tensor) -> torch.Tensor:
        """``routes`` over every position of the episode (the replies after its last turn have none; an episode
        whose prompt left no room for a turn has none at all), laid out as ``like``."""
        known = self.routes if self.routes is not None else like[:0]
        pad = torch.full((self.length - known.shape[0], *like.shape[1:]), NO_ROUTE, dtype=like.dtype)
        return torch.cat([known, pad])

    def append(self, ids: Sequence[int], sampled: bool, logprobs: Sequence[float] | None = None,
               support: Optional[Support] = None, topk: Optional[tuple[list, list]] = None,
               versions: Optional[tuple[list, list]] = None) -> None:
        """A sampled turn (with its log-probs, its kept sets when the sampling was truncated, and its top-k ids and
        log-probs when asked for) or a reply."""
        if support is not None or (self.support and not sampled):
            self.support.append(support if sampled else Support.empty(len(ids)))
        if sampled and topk is not None:
            self.topk_ids.extend(list(r) for r in topk[0])
            self.topk_logprobs.extend(list(r) for r in topk[1])
        elif not sampled and self.topk_ids:
            k = len(self.topk_ids[0])
            self.topk_ids.extend([0] * k for _ in ids)
            self.topk_logprobs.extend([0.0] * k for _ in ids)
        if sampled and versions is not None:
            self.versions.extend(int(v) for v in versions[0])
            self.stale_kv.extend(int(v) for v in versions[1])
        elif not sampled and self.versions:
            self.versions.extend([self.versions[-1]] * len(ids))
            self.stale_kv.extend([0] * len(ids))
        self.ids.extend(int(i) for i in ids)
        self.mask.extend([1 if sampled else 0] * len(ids))
        if sampled:
            self.logprobs.extend(float(x) for x in logprobs)
        else:
            self.logprobs.extend([0.0] * len(ids))

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)


def run_episodes(engine, tokenizer, prompts: Sequence[list[dict]], rows: Sequence[dict], make_env: Callable[[], Any],
                 spec: SamplingSpec, limits: EpisodeLimits, *, tools: list[dict] | None = None,
                 template_kwargs: dict | None = None, first_episode: int = 0,
                 episode_stride: int | None = None) -> tuple[Rollouts, list[Episode]]:
    """``spec.n`` episodes per prompt (groups contiguous, as ``Rollouts`` lays out samples), run to their ends.

    Args:
        engine: a rollout engine (``rollout.base.RolloutEngine``); only ``generate`` is used.
        prompts: each row's prompt as chat messages; rows: the dataset rows (given to ``reset``).
        make_env: a new environment per episode (``trainer.environments.contract.Environment``).
        tools: JSON schemas offered through the chat template at every turn (a tool environment's).
        first_episode, episode_stride: the seeds' numbering (module docstring); default: these episodes alone.
    Returns:
        (rollouts with ``completion_mask``, the episodes in the same order).
    """
    episodes = [_start(make_env(), list(prompts[i // spec.n]), rows[i // spec.n], tokenizer, tools, template_kwargs,
                       limits) for i in range(len(prompts) * spec.n)]
    stride = len(episodes) if episode_stride is None else episode_stride
    for i, e in enumerate(episodes):
        e.index = first_episode + i
    for turn in range(limits.max_turns):
        live = [e for e in episodes if e.live]
        if not live:
            break
        _sample_turn(engine, live, spec, limits, spec.index_offset + turn * stride)
        for e in live:
            if not e.live:  # cut by its token cap: the conversation still holds the turn as written, not stepped
                e.messages.append({"role": "assistant", "content": _turn_text(e, tokenizer)})
        stepping = [e for e in live if e.live]
        results = _bounded_calls([(e.env.step, _assistant_message(e, tokenizer, tools)) for e in stepping],
                                 limits.step_timeout_s, "step")
        for e, result in zip(stepping, results):
            _take_step(e, result, tokenizer, tools, template_kwargs, limits)
    routed = [e.routes for e in episodes if e.routes is not None]
    rollouts = Rollouts(prompt_ids=[e.prompt_ids for e in episodes], completion_ids=[e.ids for e in episodes],
                        rollout_logprobs=[e.logprobs for e in episodes], finish_reasons=[e.finish for e in episodes],
                        group_size=spec.n, completion_mask=[e.mask for e in episodes],
                        routes=[e.full_routes(routed[0]) for e in episodes] if routed else [],
                        support=[_full_support(e) for e in episodes] if any(e.support for e in episodes) else [],
                        topk_ids=[e.topk_ids for e in episodes] if spec.logprobs_topk else [],
                        topk_logprobs=[e.topk_logprobs for e in episodes] if spec.logprobs_topk else [],
                        versions=[e.versions for e in episodes] if any(e.versions for e in episodes) else [],
                        stale_kv=[e.stale_kv for e in episodes] if any(e.versions for e in episodes) else [])
    return rollouts, episodes


def _full_support(e: Episode) -> Support:
    """The episode's kept sets over its whole completion stream (an episode that sampled nothing: empty sets)."""
    got = Support.concat(e.support)
    return Support.concat([got, Support.empty(len(e.ids) - len(got))])


def _start(env, prompt: list[dict], row: dict, tokenizer, tools, template_kwargs, limits: EpisodeLimits) -> Episode:
    extra = check_reset_result(_bounded_calls([(env.reset, row)], limits.step_timeout_s, "reset")[0], _name(env))
    messages = prompt + extra
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                         **(template_kwargs or {}))
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    episode = Episode(env=env, messages=messages, prompt_ids=ids)
    if len(ids) >= limits.max_tokens:
        episode.live, episode.finish = False, "length"
    return episode


def _sample_turn(engine, live: list[Episode], spec: SamplingSpec, limits: EpisodeLimits, turn_offset: int) -> None:
    """One assistant turn for every live episode: one ``generate`` per distinct token cap; episode e's request is
    sample ``turn_offset + e.index``."""
    by_cap: dict[int, list[Episode]] = {}
    for e in live:
        by_cap.setdefault(min(spec.max_new_tokens, limits.max_tokens - e.length), []).append(e)
    for cap, group in sorted(by_cap.items(), reverse=True):
        out = engine.generate([e.prompt_ids + e.ids for e in group],
                              replace(spec, n=1, max_new_tokens=cap,
                                      sample_indices=tuple(turn_offset + e.index for e in group)))
        for k, (e, ids, lps, finish) in enumerate(zip(group, out.completion_ids, out.rollout_logprobs,
                                                      out.finish_reasons)):
            if out.routes:  # each position keeps the route of the turn that computed it first (rollout.routes)
                e.routes = extend_routes(e.routes, out.routes[k])
            e.append(ids, True, lps, out.support[k] if out.support else None,
                     (out.topk_ids[k], out.topk_logprobs[k]) if out.topk_ids else None,
                     (out.versions[k], out.stale_kv[k]) if out.versions else None)
            e.turns += 1
            if finish == "length":  # cut by the cap: the turn never ended, so neither does a reply follow it
                e.live, e.finish = False, "length"


def _turn_text(e: Episode, tokenizer) -> str:
    """The text of the turn just sampled (its ids decoded), recorded in ``assistant_texts``."""
    text = tokenizer.decode(e.ids[len(e.ids) - _last_run(e.mask):], skip_special_tokens=True)
    e.assistant_texts.append(text)
    return text


def _assistant_message(e: Episode, tokenizer, tools) -> dict:
    text = _turn_text(e, tokenizer)
    message = parse_assistant(text, tokenizer, tools=tools)
    return {"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"],
            "tool_call_errors": message.get("tool_call_errors", [])}


def _take_step(e: Episode, result, tokenizer, tools, template_kwargs, limits: EpisodeLimits) -> None:
    replies, reward, done = check_step_result(result, _name(e.env))
    e.reward += float(reward or 0.0)
    turn_msg = {"role": "assistant", "content": e.assistant_texts[-1]}
    if done or e.turns >= limits.max_turns:
        e.live = False
        e.messages.append(turn_msg)
        return
    obs = observation_ids(tokenizer, e.messages, replies, tools, stop_id=e.ids[-1], template_kwargs=template_kwargs)
    e.messages.extend([turn_msg, *replies])
    if len(obs) > limits.max_observation_tokens or e.length + len(obs) >= limits.max_tokens:
        e.live, e.finish = False, "length"  # the reply does not fit: the episode ends where the model last wrote
        return
    e.append(obs, False)


def _bounded_calls(calls: list[tuple[Callable, Any]], timeout_s: float | None, what: str) -> list:
    """``fn(arg)`` for every pair at once, each in a daemon thread (a hung environment must not keep the process
    from exiting, as a pool's worker would at interpreter exit); raises ``EnvironmentTimeout`` naming the
    environment whose call is still running after ``timeout_s``, or re-raises the first error with a note naming it."""
    results: list = [None] * len(calls)
    errors: list = [None] * len(calls)

    def run(k: int, fn: Callable, arg: Any) -> None:
        try:
            results[k] = fn(arg)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
            errors[k] = e

    threads = [threading.Thread(target=run, args=(k, fn, arg), name=f"parityrl-env-{what}-{k}", daemon=True)
               for k, (fn, arg) in enumerate(calls)]
    for t in threads:
        t.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    hung = [k for k, t in enumerate(threads) if t.is_alive()]
    if hung:
        raise EnvironmentTimeout(f"environment {_name(calls[hung[0]][0].__self__)}: {what}() did not return within "
                                 f"{timeout_s} s ({len(hung)} of {len(calls)} calls still running)")
    for (fn, _), e in zip(calls, errors):
        if e is not None:
            e.add_note(f"raised by environment {_name(fn.__self__)}.{what}()")
            raise e
    return results


def _last_run(mask: list[int]) -> int:
    """Length of the trailing run of sampled ids (the turn just sampled)."""
    n = 0
    for m in reversed(mask):
        if not m:
            break
        n += 1
    return n


def _name(env) -> str:
    return type(env).__qualname__
