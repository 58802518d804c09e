"""A resume through the real loop (slow tier): a new learning rate reaches the optimizer (the restored state used to
win silently) and is recorded; no API key reaches any file of the run directory."""
import json
from pathlib import Path

import pytest

from trainer.lifecycle.preflight import load_recipe
from trainer.lifecycle.run_state import CHANGES_FILE, RECIPE_FILE
from trainer.rl.loop import train

pytestmark = pytest.mark.slow
SECRET = "sk-parityrl-test-0123456789abcdef0123456789abcdef"
RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "grpo_tiny.yaml"
SMALL = ["rollout.prompts_per_step=4", "algorithm.group_size=2", "rollout.max_new_tokens=8", "parity.probe_prompts=0",
         "checkpoint.every=0", "logging.wandb.mode=offline"]


def cfg_for(tmp_path, name, *sets):
    return load_recipe(RECIPE, [f"name={name}", f"logging.run_dir={tmp_path / name}", *SMALL, *sets])


def test_resume_applies_a_new_learning_rate_and_no_key_is_written(tmp_path, tiny_model_dir, vllm_engine, monkeypatch,
                                                                   capsys):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("WANDB_MODE", "offline")
    first = train(cfg_for(tmp_path, "lr", "train.steps=1", "train.learning_rate=2e-3"),
                  engine=vllm_engine)
    assert first.history[-1]["train/lr"] == pytest.approx(2e-3)
    more = train(cfg_for(tmp_path, "lr", "train.steps=2", "train.learning_rate=0.05"),
                 resume=True, engine=vllm_engine)
    assert [h["step"] for h in more.history] == [2]
    assert more.history[-1]["train/lr"] == pytest.approx(0.05)
    assert "resuming with train.learning_rate 0.05 (was 0.002)" in capsys.readouterr().out
    change = json.loads((more.run_dir / CHANGES_FILE).read_text())
    assert change["resumed_at_step"] == 1 and change["changes"]["train.learning_rate"]["now"] == 0.05
    assert (more.run_dir / RECIPE_FILE).is_file()
    leaked = [p for p in more.run_dir.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == []
