"""precision.recipe exact end to end on the tiny model (slow tier): the engine's and the trainer's
log-probs equal bit for bit at step 0 (the probe) and after every synced update.

Each run starts its own exact-mode engine (rollout.exact_quant), as a user's run does.
"""
import json
from pathlib import Path

import pytest

from trainer.config import load_recipe
from trainer.rl.loop import train

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow
ZERO_KEYS = ("parity/mae", "parity/max_abs", "parity/kl_k3", "parity/rmse")


def _run(tmp_path, name, *sets):
    cfg = load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [
        f"name={name}", f"logging.run_dir={tmp_path / name}", "logging.wandb.mode=disabled", "checkpoint.every=0",
        "precision.recipe=exact", *sets])
    train(cfg)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("dtype, sets", [
    # float32, top-k on: the engine's top-k log-probs too; prompt batches of 6 x 4
    ("float32", ("train.steps=3", "rollout.prompts_per_step=6", "algorithm.group_size=4", "parity.topk=4",
                 "train.micro_batch_size=10")),
    # bfloat16, several updates per batch (pi_old scored before them, ratios after each step), a KL penalty
    # to the reference policy (the base model, also in the engine's numerics: trainer.models.exact.reference)
    ("bfloat16", ("train.steps=2", "rollout.prompts_per_step=3", "algorithm.group_size=8", "algorithm.epochs=2",
                  "train.micro_batch_size=8", "algorithm.kl_coef=0.05")),
])
def test_engine_and_trainer_logprobs_are_identical_at_every_step(tmp_path, dtype, sets):
    rows = _run(tmp_path, f"exact-{dtype}", f"model.dtype={dtype}", *sets)
    steps = [r for r in rows if "parity/mae" in r]
    assert len(steps) == int(sets[0].split("=")[1])
    for r in steps:
        for key in ZERO_KEYS:
            assert r[key] == 0.0, (r["step"], key, r[key])
        assert r["parity/num_tokens"] > 0
        if "parity/topk_kl" in r or dtype == "float32":
            assert r["parity/topk_kl"] == 0.0
    probes = [r for r in rows if "probe/mae" in r]
    assert probes and all(r["probe/mae"] == 0.0 and r["probe/max_abs"] == 0.0 for r in probes)
    # the policy did move between the steps (the zeros are not those of an unchanged model)
    assert any(abs(r["train/grad_norm"]) > 0 for r in steps)
    if dtype == "bfloat16":  # the penalty ran (means over the two epochs: the second one has moved)
        assert all(0.0 < r["train/kl_ref"] < 1.0 for r in steps)
