"""Multi-turn episodes with the real vLLM engine on the tiny model (slow tier, the session's shared engine).

The environments are a user's file loaded by path (tests/trainer/rl/episode_envs.py). The engine's context is the
shared engine's 128 tokens, so the episodes' budget is 128.
"""
import json
from pathlib import Path

import pytest

from rollout.types import SamplingSpec
from trainer.data.tasks.arithmetic import arithmetic_dataset
from trainer.environments.episode_environment import EpisodeLimits
from trainer.lifecycle.preflight import load_recipe
from trainer.lifecycle.stops import EnvironmentFailed
from trainer.models.batch import batch_from_rollouts
from trainer.models.policy import load_tokenizer
from trainer.rl.loop import train
from trainer.sampling.episodes import run_episodes

REPO = Path(__file__).resolve().parents[3]
ENVS = Path(__file__).resolve().parent / "episode_envs.py"
pytestmark = pytest.mark.slow
PARITY_MAE_BOUND = 1e-2  # bf16 both sides, as tests/trainer/rl/test_train_integration.py


class Recording:
    """The engine, with every generate call's requests and answers kept."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompt_ids, spec):
        out = self.engine.generate(prompt_ids, spec)
        self.calls.append(([list(p) for p in prompt_ids], [list(c) for c in out.completion_ids]))
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def recipe(tmp_path, name, *sets):
    return load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [
        f"name={name}", f"logging.run_dir={tmp_path / name}", "logging.wandb.mode=disabled", "checkpoint.every=0",
        "rollout.prompts_per_step=4", "algorithm.group_size=4", "train.micro_batch_size=16",
        f"env.class={ENVS}:FollowUp", "env.max_turns=2", "env.max_tokens=128", "eval.every=0", *sets])


def test_the_trainer_scores_exactly_the_ids_the_engine_read_and_sampled(tiny_model_dir, vllm_engine):
    import importlib.util

    spec_ = importlib.util.spec_from_file_location("episode_envs", ENVS)
    envs = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(envs)
    tok = load_tokenizer(tiny_model_dir)
    rows = list(arithmetic_dataset(3, seed=1))
    engine = Recording(vllm_engine)
    rollouts, episodes = run_episodes(engine, tok, [[{"role": "user", "content": r["prompt"]}] for r in rows], rows,
                                      envs.FollowUp, SamplingSpec(n=2, temperature=1.0, max_new_tokens=24, seed=3),
                                      EpisodeLimits(max_turns=2, max_tokens=128, max_observation_tokens=16))
    assert len(engine.calls) <= 2  # one call per turn for every live episode (same token cap)
    batch = batch_from_rollouts(rollouts, tok.pad_token_id)
    for i, e in enumerate(episodes):
        starts = set()
        real = batch.input_ids[i][batch.attention_mask[i].bool()].tolist()  # what the trainer reads
        assert real == e.prompt_ids + e.ids
        # every request for this episode is a prefix of the row, and its answer sits at the row's sampled positions
        for prompts, answers in engine.calls:
            for req, ans in zip(prompts, answers):
                if req == real[:len(req)] and len(req) >= len(e.prompt_ids) and real[len(req):len(req) + len(ans)] == ans:
                    start = len(req) - len(e.prompt_ids)  # the answer's first column in the completion
                    assert batch.mask[i, start:start + len(ans)].tolist() == [1] * len(ans)
                    assert batch.targets[i, start:start + len(ans)].tolist() == ans
                    starts.add(start)
        assert len(starts) == e.turns  # every turn's request and answer found in its row (samples may coincide)
        assert batch.targets[i][batch.mask[i].bool()].tolist() == [x for x, m in zip(e.ids, e.mask) if m]


def test_a_grpo_run_on_episodes_logs_parity_per_turn_and_drift(tmp_path, vllm_engine):
    res = train(recipe(tmp_path, "episodes", "train.steps=2", "logging.samples_every=1", "parity.topk=2"),
                engine=vllm_engine)
    for h in res.history:
        assert h["parity/mae"] < PARITY_MAE_BOUND, h["parity/mae"]
        # each turn's top-k from the engine, the replies' rows masked: as small as on single-turn completions
        # (tests/trainer/rl/test_train_integration.py: 1e-5 to 1e-4 nats in sync)
        assert 0 <= h["parity/topk_kl"] < 1e-3, h["parity/topk_kl"]
        assert h["parity/turn_1/mae"] < PARITY_MAE_BOUND
        assert 1.0 <= h["episode/turns"] <= 2.0
        assert 0.0 <= h["parity/retokenize_drift_episodes"] <= 1.0
        assert 0.0 <= h["parity/retokenize_drift_tokens"] <= 1.0
        assert "reward/env" in h and "reward/exact_answer" in h
    assert any(h["episode/turns"] > 1 for h in res.history) and "parity/turn_2/mae" in res.history[0]
    rows = [json.loads(line) for line in (tmp_path / "episodes" / "samples.jsonl").read_text().splitlines()]
    assert any("[turn 2]" in r["completion"] and "[context]" in r["completion"] for r in rows)
    breakdown = [json.loads(line) for line in (tmp_path / "episodes" / "parity_breakdown.jsonl").read_text()
                 .splitlines()]
    assert all(b["by_turn"][0]["turn"] == 1 and b["by_turn"][0]["num_tokens"] > 0 for b in breakdown)
    metrics = [json.loads(line) for line in (tmp_path / "episodes" / "metrics.jsonl").read_text().splitlines()]
    assert all("parity/retokenize_drift_episodes" in m for m in metrics if m.get("step", 0) > 0)


@pytest.mark.parametrize("env, says", [("Raises", "raised by environment Raises.step()"),
                                       ("WrongShape", "WrongShape")])
def test_an_environment_that_fails_stops_the_run_with_its_name(tmp_path, vllm_engine, env, says):
    with pytest.raises(EnvironmentFailed, match=r"step 1: .*" + says.replace("(", r"\(").replace(")", r"\)")) as e:
        train(recipe(tmp_path, env, "train.steps=2", f"env.class={ENVS}:{env}"), engine=vllm_engine)
    assert e.value.exit_status == 7


def test_episodes_one_step_off_policy(tmp_path, vllm_engine):
    """rollout.max_staleness 1: the next step's episodes are drawn with the weights before this step's update."""
    res = train(recipe(tmp_path, "episodes_async", "train.steps=2", "rollout.max_staleness=1"), engine=vllm_engine)
    assert [h["step"] for h in res.history] == [1, 2]
    for h in res.history:
        assert h["parity/turn_1/mae"] < PARITY_MAE_BOUND and 1.0 <= h["episode/turns"] <= 2.0


def test_held_out_evaluation_runs_episodes(tmp_path, vllm_engine):
    """With env: the evaluation's completions are episodes too, scored by the same rewards."""
    res = train(recipe(tmp_path, "episodes_eval", "train.steps=1", "eval.every=1", "eval.num_prompts=4",
                       "eval.samples=2"), engine=vllm_engine)
    h = res.history[0]
    assert 0.0 <= h["eval/mean@2"] <= h["eval/pass@2"] <= 1.0 and "eval/reward/env" in h
    assert h["eval/parity/mae"] < PARITY_MAE_BOUND and h["eval/parity/num_tokens"] > 0
