"""Adding an algorithm is one record: a toy algorithm defined in this file alone trains a step.

Nothing outside this file names it: the recipe loader parses its options, the validator asks
its record, the loop calls its functions.
"""
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from trainer.algorithms import ALGORITHMS, AdvantageInputs, Algorithm, LossInputs, LossOutput, register_algorithm
from trainer.algorithms.record import check_options

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]
CALLS = {"advantage": 0, "loss": 0}


@dataclass
class ToyOptions:
    scale: float = 2.0

    def __post_init__(self) -> None:
        check_options(self, [(self.scale > 0, "scale", "> 0")])


def toy_advantage(batch: AdvantageInputs, cfg: ToyOptions) -> torch.Tensor:
    """Reward minus the batch mean, times ``scale``, on every valid token."""
    CALLS["advantage"] += 1
    centred = (batch.rewards - batch.rewards.mean()) * cfg.scale
    return centred[:, None] * (batch.mask != 0)


def toy_loss(batch: LossInputs, cfg: ToyOptions) -> LossOutput:
    """Plain REINFORCE: -A * log pi over the valid tokens, normalised by the batch's token count."""
    CALLS["loss"] += 1
    valid = batch.mask != 0
    per_token = torch.where(valid, -batch.advantages.detach() * batch.logprobs, torch.zeros_like(batch.logprobs))
    return LossOutput(loss=per_token.sum() / batch.normalizer.num_tokens, metrics={"train/toy": 1.0})


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(ALGORITHMS, "_fns", dict(ALGORITHMS._fns))  # the registry as it was, once the test ends
    record = register_algorithm(Algorithm(name="toy_reinforce", options=ToyOptions, advantage=toy_advantage,
                                          loss=toy_loss, paper="this test", min_group_size=1))
    yield record


def test_a_toy_algorithm_trains_one_step(tmp_path, toy, tiny_model_dir, vllm_engine):
    from trainer.config import RecipeError
    from trainer.lifecycle.preflight import load_recipe
    from trainer.rl.loop import train

    def cfg_for(tmp_path, name, *overrides):
        return load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [
            f"name={name}", f"logging.run_dir={tmp_path / name}", "logging.wandb.mode=disabled",
            "rollout.prompts_per_step=8", "algorithm.group_size=4", "train.micro_batch_size=16",
            "checkpoint.every=0", *overrides])

    with pytest.raises(RecipeError, match="algorithm.scale = -1.0: expected > 0 \\(toy_reinforce\\)"):
        cfg_for(tmp_path, "bad", "algorithm.name=toy_reinforce", "algorithm.scale=-1.0")
    cfg = cfg_for(tmp_path, "toy", "algorithm.name=toy_reinforce", "algorithm.scale=3.0", "train.steps=1")
    assert cfg.algorithm.options == ToyOptions(scale=3.0)
    res = train(cfg, engine=vllm_engine)
    (h,) = res.history
    assert CALLS == {"advantage": 1, "loss": 2}  # 8 x 4 samples in micro-batches of 16
    assert h["train/toy"] == 2.0 and h["train/grad_norm"] > 0 and h["parity/mae"] < 1e-2
