"""The run's recorded recipe and what a resume may change (trainer/lifecycle/run_state.py): each change applied and said,
or refused with the reason; optimizer keys written over the restored optimizer/schedule state."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from trainer.io.run_lock import RunStateError
from trainer.lifecycle.preflight import load_recipe
from trainer.lifecycle.run_state import CHANGES_FILE, RECIPE_FILE, claim_run_dir, record_recipe, recorded_recipe
from trainer.models.optim import make_scheduler

REPO = Path(__file__).resolve().parents[3]


def cfg(tmp_path, *sets):
    return load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [f"logging.run_dir={tmp_path}", *sets], check_paths=False)


def run_of(c, lr, step=0):
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p], lr=lr)
    sched = make_scheduler(opt, c.train.lr_schedule, c.train.warmup_steps, c.train.steps)
    for _ in range(step):
        opt.step()
        sched.step()
    return SimpleNamespace(cfg=c, optimizer=opt, scheduler=sched, is_main=True, start_step=step)


def resumed(c, was_lr, step):
    """A run as _restore leaves it: the optimizer and schedule state of the recorded run."""
    run = run_of(c, was_lr, step)
    saved_opt, saved_sched = run.optimizer.state_dict(), run.scheduler.state_dict()
    fresh = run_of(c, c.train.learning_rate)
    fresh.optimizer.load_state_dict(saved_opt)
    fresh.scheduler.load_state_dict(saved_sched)
    fresh.start_step = step
    return fresh


def test_a_fresh_run_records_its_resolved_recipe(tmp_path):
    c = cfg(tmp_path, "train.learning_rate=3e-4")
    record_recipe(run_of(c, 3e-4), resumed=False)
    saved = yaml.safe_load((tmp_path / RECIPE_FILE).read_text())
    assert saved["train"]["learning_rate"] == 3e-4 and saved["algorithm"]["name"] == "grpo"


def test_a_resume_applies_a_new_learning_rate_says_so_and_records_it(tmp_path, capsys):
    start = cfg(tmp_path, "train.learning_rate=3e-4", "train.lr_schedule=linear", "train.steps=10")
    record_recipe(run_of(start, 3e-4), resumed=False)
    later = cfg(tmp_path, "train.learning_rate=1e-4", "train.lr_schedule=linear", "train.steps=10",
                "rollout.temperature=0.7")
    run = resumed(later, 3e-4, step=4)
    assert run.scheduler.get_last_lr()[0] == pytest.approx(3e-4 * 0.6)  # the restored state would win
    claim_run_dir(later, resume=True).release()  # allowed
    record_recipe(run, resumed=True)
    assert run.scheduler.get_last_lr()[0] == pytest.approx(1e-4 * 0.6)
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4 * 0.6)
    run.scheduler.step()
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4 * 0.5)  # the schedule goes on from the new base
    out = capsys.readouterr().out
    assert "resuming with train.learning_rate 0.0001 (was 0.0003)" in out and "rollout.temperature 0.7 (was 1.0)" in out
    line = json.loads((tmp_path / CHANGES_FILE).read_text())
    assert line["resumed_at_step"] == 4 and line["changes"]["train.learning_rate"] == {"was": 3e-4, "now": 1e-4}
    # the recipe the run uses now = recipe.yaml + its changes; a second identical resume changes nothing
    assert recorded_recipe(tmp_path)["train.learning_rate"] == 1e-4
    record_recipe(resumed(later, 1e-4, step=6), resumed=True)
    assert json.loads((tmp_path / CHANGES_FILE).read_text().splitlines()[1])["changes"] == {}


@pytest.mark.parametrize("override, reason", [
    ("model.lora.r=4", "LoRA shape"), ("algorithm.name=rloo", "algorithm"), ("algorithm.group_size=4", "groups"),
    ("model.path=builtin:tiny-base", "model"), ("data.num_examples=32", "data position"), ("train.seed=1", "data order"),
])
def test_a_resume_refuses_what_would_make_the_checkpoint_meaningless(tmp_path, override, reason):
    c = cfg(tmp_path)
    record_recipe(run_of(c, c.train.learning_rate), resumed=False)
    key = override.split("=")[0]
    with pytest.raises(RunStateError) as e:
        claim_run_dir(cfg(tmp_path, override), resume=True)
    msg = str(e.value)
    assert key in msg and reason in msg and "\n" not in msg, msg
    claim_run_dir(c, resume=True).release()  # the refusal released the lock


def test_weight_decay_and_betas_reach_the_restored_optimizer(tmp_path):
    c = cfg(tmp_path)
    record_recipe(run_of(c, c.train.learning_rate), resumed=False)
    later = cfg(tmp_path, "train.weight_decay=0.1", "train.adam_betas=[0.8, 0.99]")
    run = resumed(later, c.train.learning_rate, step=2)
    record_recipe(run, resumed=True)
    g = run.optimizer.param_groups[0]
    assert g["weight_decay"] == 0.1 and tuple(g["betas"]) == (0.8, 0.99)
