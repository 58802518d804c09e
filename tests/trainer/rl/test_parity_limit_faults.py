"""The default parity limit with the HF engine: quiet on a healthy run, tripped by a real fault at the first probe
after it (slow: trains the tiny model; the vLLM engine's cases are in test_train_integration.py).

The HF engine is the one the issue met on CUDA: its probe before step 1 compares identical weights and kernels
(3.7e-7 here on CPU), then the engine's merged BF16 weights against the trainer's LoRA branch (~2e-3), which the
old rule, with the first probe as its baseline, took for a 5000x jump.
"""
from pathlib import Path

import pytest

from trainer.lifecycle.preflight import load_recipe
from trainer.lifecycle.stops import ParityLimitExceeded
from trainer.rl.loop import train

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def hf_cfg(tmp_path, name, *overrides):
    # parity.on_violation stop: any violation of the default limits raises
    return load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [
        f"name={name}", f"logging.run_dir={tmp_path / name}", "logging.wandb.mode=disabled", "rollout.engine=hf",
        "rollout.prompts_per_step=4", "algorithm.group_size=4", "rollout.max_new_tokens=8",
        "train.micro_batch_size=16", "checkpoint.every=0", "parity.probe_first=3", "parity.on_violation=stop",
        *overrides])


def test_hf_engine_quiet_when_healthy_and_stopped_by_a_skipped_sync_or_a_dropped_softcap(
        tmp_path, tiny_model_dir, monkeypatch):
    # Healthy, the demo's learning rate: probes before step 1 and after each of 3 syncs, none a violation.
    res = train(hf_cfg(tmp_path, "healthy", "train.steps=3"))
    probe = [h["probe/mae"] for h in res.history]
    assert len(probe) == 3 and max(probe) < 1e-2, probe  # within 5 x the BF16 floor 4e-3, with room

    # A skipped sync: the probe right after step 1's (skipped) sync trips (measured 0.165 against 3.7e-7
    # before step 1, at lr 2e-2); the run stops there, before any rollout with those weights.
    stale = hf_cfg(tmp_path, "stale", "train.steps=3", "train.learning_rate=2e-2", "rollout.sync_weights=false")
    with pytest.raises(ParityLimitExceeded, match=r"^step 1 \(probe after the weight sync\): probe/mae = .* is more "
                                                  r"than parity.max_mae_ratio = 5 times the bf16 recipe's bfloat16 "
                                                  r"floor 0.004 \(limit 0.02\)"):
        train(stale)

    # A trainer forward that drops Gemma2's final logit softcap (the engine's HF forward keeps it), in float32:
    # a fault from the start, tripped by the probe before step 1 (measured 0.069 against the limit 5e-4).
    import trainer.models.policy as policy
    from trainer.builtin.zoo import ensure_arch_model

    known = policy.logit_transform  # the load-time check (trainer.models.architecture) still sees the softcap
    monkeypatch.setattr(policy, "logit_transform", lambda config: {**known(config), "logit_softcap": None})
    softcap = hf_cfg(tmp_path, "softcap", "train.steps=1", "model.dtype=float32",
                     f"model.path={ensure_arch_model('gemma2', dtype='float32')}")
    with pytest.raises(ParityLimitExceeded, match=r"^step 0 \(probe before training\): probe/mae = .* is more than "
                                                  r"parity.max_mae_ratio = 5 times the bf16 recipe's float32 floor "
                                                  r"0.0001 \(limit 0.0005\)"):
        train(softcap)
