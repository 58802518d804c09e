"""trainer/sampling/episodes.py: batched multi-turn episodes on a scripted engine and the built-in tiny tokenizer.

The engine is a stand-in that samples from a script and records every request, so the tests can check what a
real engine would have read at each turn: exactly ``prompt ids + everything before``, one ``generate`` per turn.
"""
from __future__ import annotations

import time

import pytest

from rollout.types import Rollouts, SamplingSpec
from trainer.builtin.tiny import build_tokenizer
from trainer.environments.contract import EnvironmentContractError
from trainer.environments.episode_environment import EpisodeLimits
from trainer.sampling.episodes import EnvironmentTimeout, run_episodes

EOS = 2


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512, 256)


class ScriptedEngine:
    """Turn k of every request samples ``script(k, request)``: (ids, finish reason); log-prob -0.5 per id."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, prompt_ids, spec):
        self.calls.append(([list(p) for p in prompt_ids], spec))
        outs = [self.script(len(self.calls), p) for p in prompt_ids]
        ids = [o[0][:spec.max_new_tokens] for o in outs]
        finish = [o[1] if len(o[0]) <= spec.max_new_tokens else "length" for o in outs]
        return Rollouts(prompt_ids=prompt_ids, completion_ids=ids, rollout_logprobs=[[-0.5] * len(c) for c in ids],
                        finish_reasons=finish, group_size=1)


class Counter:
    """Replies "again" (role user) until ``turns`` assistant turns; reward 1 per step."""

    turns = 2

    def reset(self, row):
        self.seen = 0
        return None

    def step(self, message):
        self.seen += 1
        return [{"role": "user", "content": "again"}], 1.0, self.seen >= self.turns


def words(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_each_turn_is_one_call_reading_exactly_what_came_before(tok):
    answer = words(tok, "7") + [EOS]
    engine = ScriptedEngine(lambda call, prompt: (answer, "stop"))
    prompts = [[{"role": "user", "content": "1+2"}], [{"role": "user", "content": "3+4"}]]
    spec = SamplingSpec(n=2, max_new_tokens=8, seed=3)
    r, eps = run_episodes(engine, tok, prompts, [{}, {}], Counter, spec,
                          EpisodeLimits(max_turns=5, max_tokens=200, max_observation_tokens=20))
    assert len(engine.calls) == 2  # two turns, all four episodes in each call
    assert [len(p) for p, _ in engine.calls] == [4, 4] and all(s.n == 1 for _, s in engine.calls)
    # each episode keeps its index; turn t adds t x 4 episodes: no two turns share a seed
    assert [s.sample_indices for _, s in engine.calls] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    reply = [3] + words(tok, "again") + [EOS, 4]  # <|user|>again<|end|><|assistant|>
    for i, e in enumerate(eps):
        assert e.ids == answer + reply + answer and e.mask == [1] * len(answer) + [0] * len(reply) + [1] * len(answer)
        assert e.turns == 2 and e.reward == 2.0 and e.finish == "stop" and e.assistant_texts == ["7", "7"]
        # Token-exact: turn 2 read the prompt, turn 1's sampled ids and the reply, nothing re-encoded.
        assert engine.calls[1][0][i] == e.prompt_ids + answer + reply
    assert r.completion_mask == [e.mask for e in eps] and r.group_size == 2
    assert r.rollout_logprobs[0] == [-0.5] * len(answer) + [0.0] * len(reply) + [-0.5] * len(answer)
    assert r.prompt_ids[0] == r.prompt_ids[1] != r.prompt_ids[2]  # groups contiguous


def test_max_turns_and_length_end_episodes(tok):
    answer = words(tok, "7") + [EOS]
    engine = ScriptedEngine(lambda call, prompt: (answer, "stop"))
    Never = type("Never", (Counter,), {"turns": 99})
    _, eps = run_episodes(engine, tok, [[{"role": "user", "content": "q"}]], [{}], Never, SamplingSpec(max_new_tokens=8),
                          EpisodeLimits(max_turns=3, max_tokens=200, max_observation_tokens=20))
    assert eps[0].turns == 3 and eps[0].finish == "stop" and len(engine.calls) == 3
    # A turn cut by the engine's cap ends its episode as truncated.
    engine = ScriptedEngine(lambda call, prompt: (words(tok, "1 2 3 4 5 6 7 8 9"), "length"))
    _, eps = run_episodes(engine, tok, [[{"role": "user", "content": "q"}]], [{}], Never, SamplingSpec(max_new_tokens=4),
                          EpisodeLimits(max_turns=3, max_tokens=200, max_observation_tokens=20))
    assert eps[0].finish == "length" and eps[0].turns == 1 and len(eps[0].ids) == 4


def test_budget_caps_the_turn_and_an_oversized_reply_ends_the_episode(tok):
    answer = words(tok, "7") + [EOS]
    engine = ScriptedEngine(lambda call, prompt: (answer, "stop"))
    prompt = [{"role": "user", "content": "q"}]
    n_prompt = len(tok(tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"])
    # Room for the first turn and not for its reply: the episode ends as truncated after one turn.
    _, eps = run_episodes(engine, tok, [prompt], [{}], Counter, SamplingSpec(max_new_tokens=8),
                          EpisodeLimits(max_turns=5, max_tokens=n_prompt + len(answer) + 3, max_observation_tokens=50))
    assert eps[0].finish == "length" and eps[0].turns == 1 and eps[0].ids == answer
    # The turn's cap shrinks to the budget left.
    _, eps = run_episodes(engine, tok, [prompt], [{}], Counter, SamplingSpec(max_new_tokens=8),
                          EpisodeLimits(max_turns=5, max_tokens=n_prompt + 1, max_observation_tokens=50))
    assert engine.calls[-1][1].max_new_tokens == 1
    # A reply over max_observation_tokens ends the episode where the model last wrote.
    _, eps = run_episodes(engine, tok, [prompt], [{}], Counter, SamplingSpec(max_new_tokens=8),
                          EpisodeLimits(max_turns=5, max_tokens=500, max_observation_tokens=2))
    assert eps[0].finish == "length" and eps[0].ids == answer and eps[0].mask == [1] * len(answer)


def test_a_hung_environment_and_a_wrong_step_are_named(tok):
    answer = words(tok, "7") + [EOS]
    engine = ScriptedEngine(lambda call, prompt: (answer, "stop"))

    class Hangs(Counter):
        def step(self, message):
            time.sleep(5)

    class WrongShape(Counter):
        def step(self, message):
            return "done"

    prompt = [[{"role": "user", "content": "q"}]]
    limits = EpisodeLimits(max_turns=3, max_tokens=200, max_observation_tokens=20, step_timeout_s=0.2)
    with pytest.raises(EnvironmentTimeout, match=r"Hangs.*step\(\) did not return within 0.2 s"):
        run_episodes(engine, tok, prompt, [{}], Hangs, SamplingSpec(max_new_tokens=8), limits)
    with pytest.raises(EnvironmentContractError, match="WrongShape"):
        run_episodes(engine, tok, prompt, [{}], WrongShape, SamplingSpec(max_new_tokens=8), limits)


def test_the_batch_builder_trains_only_the_sampled_ids(tok):
    from trainer.models.batch import IGNORE, batch_from_rollouts

    answer = words(tok, "7") + [EOS]
    engine = ScriptedEngine(lambda call, prompt: (answer, "stop"))
    r, eps = run_episodes(engine, tok, [[{"role": "user", "content": "q"}]], [{}], Counter,
                          SamplingSpec(max_new_tokens=8), EpisodeLimits(max_turns=5, max_tokens=200,
                                                                        max_observation_tokens=20))
    b = batch_from_rollouts(r, pad_id=0)
    sampled = [t for t, m in zip(eps[0].ids, eps[0].mask) if m]
    assert [t for t in b.targets[0].tolist() if t != IGNORE] == sampled
    assert b.input_ids[0, b.prompt_len:].tolist() == eps[0].ids


def test_an_environment_that_raises_is_named(tok):
    engine = ScriptedEngine(lambda call, prompt: (words(tok, "7") + [EOS], "stop"))

    class Raises(Counter):
        def step(self, message):
            raise KeyError("no such state")

    with pytest.raises(KeyError) as info:
        run_episodes(engine, tok, [[{"role": "user", "content": "q"}]], [{}], Raises, SamplingSpec(max_new_tokens=8),
                     EpisodeLimits(max_turns=3, max_tokens=200, max_observation_tokens=20))
    assert "raised by environment" in " ".join(info.value.__notes__) and "Raises.step()" in info.value.__notes__[0]


def test_a_shard_samples_with_the_indices_one_process_would_give_it(tok):
    """Data parallel: rank 1 of 2 runs episodes 2, 3 of 4; whoever else is live, each keeps its own sample index
    at every turn (here episode 2 ends after one turn, episode 3 goes on)."""
    answer = words(tok, "7") + [EOS]
    engine = ScriptedEngine(lambda call, prompt: (answer, "stop"))

    class EndsFirst(Counter):
        def reset(self, row):
            self.turns = row["turns"]
            return super().reset(row)

    spec = SamplingSpec(n=1, max_new_tokens=8, seed=3, index_offset=100)
    run_episodes(engine, tok, [[{"role": "user", "content": "1+2"}]] * 2, [{"turns": 1}, {"turns": 3}], EndsFirst,
                 spec, EpisodeLimits(max_turns=3, max_tokens=200, max_observation_tokens=20), first_episode=2,
                 episode_stride=4)
    assert [s.sample_indices for _, s in engine.calls] == [(102, 103), (107,), (111,)]


def test_a_truncated_episode_carries_each_turns_kept_sets_and_empty_sets_on_the_replies(tok):
    from rollout.support import Support

    answer = words(tok, "7") + [EOS]

    class Truncating(ScriptedEngine):
        def generate(self, prompt_ids, spec):
            r = super().generate(prompt_ids, spec)
            r.support = [Support.from_lists([[t, t + 1] for t in c]) for c in r.completion_ids]
            return r

    engine = Truncating(lambda call, prompt: (answer, "stop"))
    spec = SamplingSpec(n=1, max_new_tokens=8, seed=3, top_k=2)
    r, eps = run_episodes(engine, tok, [[{"role": "user", "content": "1+2"}]], [{}], Counter, spec,
                          EpisodeLimits(max_turns=5, max_tokens=200, max_observation_tokens=20))
    sets = r.support[0].to_lists()
    reply = len(eps[0].ids) - 2 * len(answer)
    assert sets == [[t, t + 1] for t in answer] + [[]] * reply + [[t, t + 1] for t in answer]


def test_an_episode_carries_each_turns_top_k_and_zero_rows_on_the_replies(tok):
    answer = words(tok, "7") + [EOS]

    class TopK(ScriptedEngine):
        def generate(self, prompt_ids, spec):
            r = super().generate(prompt_ids, spec)
            r.topk_ids = [[[t, t + 1] for t in c] for c in r.completion_ids]
            r.topk_logprobs = [[[-0.25, -1.5] for _ in c] for c in r.completion_ids]
            return r

    spec = SamplingSpec(n=1, max_new_tokens=8, seed=3, logprobs_topk=2)
    r, eps = run_episodes(TopK(lambda call, prompt: (answer, "stop")), tok, [[{"role": "user", "content": "1+2"}]],
                          [{}], Counter, spec, EpisodeLimits(max_turns=5, max_tokens=200, max_observation_tokens=20))
    reply = len(eps[0].ids) - 2 * len(answer)
    assert reply > 0 and r.topk == 2
    assert r.topk_ids[0] == [[t, t + 1] for t in answer] + [[0, 0]] * reply + [[t, t + 1] for t in answer]
    assert r.topk_logprobs[0] == [[-0.25, -1.5]] * len(answer) + [[0.0, 0.0]] * reply + [[-0.25, -1.5]] * len(answer)
    # without top-k asked for, none is kept (the engine's rows are not read)
    r, _ = run_episodes(TopK(lambda call, prompt: (answer, "stop")), tok, [[{"role": "user", "content": "1+2"}]],
                        [{}], Counter, SamplingSpec(n=1, max_new_tokens=8, seed=3),
                        EpisodeLimits(max_turns=5, max_tokens=200, max_observation_tokens=20))
    assert r.topk_ids == [] and r.topk == 0


def test_an_episode_carries_each_turns_versions_and_its_replies_take_the_turn_befores(tok):
    """In-flight updates (Rollouts.versions / stale_kv): turn 1 sampled by versions 3 then 4 (an update in the middle,
    keep: its tokens after the update read older KV), turn 2 by version 4 alone on a fresh prefill."""
    answer = words(tok, "7") + [EOS]

    class Versioned(ScriptedEngine):
        def generate(self, prompt_ids, spec):
            r = super().generate(prompt_ids, spec)
            turn = len(self.calls)
            r.versions = [[3] + [4] * (len(c) - 1) if turn == 1 else [4] * len(c) for c in r.completion_ids]
            r.stale_kv = [[0] + [1] * (len(c) - 1) if turn == 1 else [0] * len(c) for c in r.completion_ids]
            return r

    r, eps = run_episodes(Versioned(lambda call, prompt: (answer, "stop")), tok, [[{"role": "user", "content": "1+2"}]],
                          [{}], Counter, SamplingSpec(n=1, max_new_tokens=8, seed=3),
                          EpisodeLimits(max_turns=5, max_tokens=200, max_observation_tokens=20))
    reply = len(eps[0].ids) - 2 * len(answer)
    assert reply > 0 and len(answer) == 2
    assert r.versions[0] == [3, 4] + [4] * reply + [4, 4]
    assert r.stale_kv[0] == [0, 1] + [0] * reply + [0, 0]
    # an engine without versions: none kept
    r, _ = run_episodes(ScriptedEngine(lambda call, prompt: (answer, "stop")), tok,
                        [[{"role": "user", "content": "1+2"}]], [{}], Counter, SamplingSpec(n=1, max_new_tokens=8),
                        EpisodeLimits(max_turns=5, max_tokens=200, max_observation_tokens=20))
    assert r.versions == [] and r.stale_kv == []
