"""Training with top-k and top-p (slow: the session's vLLM engine, tests/conftest.py): the trainer normalises its
log-probs over the sets the engine kept, so parity stays at the untruncated BF16 level; scored over the whole
vocabulary instead, every ratio carries log(kept mass)."""
from pathlib import Path

import pytest

from trainer.lifecycle.preflight import load_recipe
from trainer.models.batch import TokenBatch
from trainer.rl.loop import train

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow

PARITY_MAE_BOUND = 1e-2  # BF16 both sides, as tests/trainer/rl/test_train_integration.py


def cfg_for(tmp_path, name, *overrides):
    return load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [
        f"name={name}", f"logging.run_dir={tmp_path / name}", "logging.wandb.mode=disabled", "eval.every=0",
        "rollout.prompts_per_step=8", "algorithm.group_size=4", "train.micro_batch_size=16", "checkpoint.every=0",
        "rollout.top_p=0.8", "rollout.top_k=4", "rollout.temperature=1.5", "train.steps=2", *overrides])


def test_truncated_rollouts_are_scored_over_the_engines_kept_sets(tmp_path, vllm_engine, monkeypatch):
    h = train(cfg_for(tmp_path, "kept"), engine=vllm_engine).history
    assert all(s["parity/mae"] < PARITY_MAE_BOUND for s in h), [s["parity/mae"] for s in h]
    assert all(0 < s["sampling/kept_mass"] <= 1 and s["sampling/kept_mass_p1"] <= s["sampling/kept_mass"] for s in h)
    assert all(1 <= s["sampling/kept_tokens"] <= 4.5 for s in h)  # top-k 4 (vLLM keeps ties with the 4th: a little over)
    # the same run scored over the whole vocabulary: the bias the kept sets remove
    monkeypatch.setattr(TokenBatch, "kernel_support", lambda self: None)
    biased = train(cfg_for(tmp_path, "full"), engine=vllm_engine).history
    assert biased[0]["parity/mae"] > 3 * h[0]["parity/mae"], (biased[0]["parity/mae"], h[0]["parity/mae"])
