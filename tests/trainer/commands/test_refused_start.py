"""A refused start reads and creates nothing (issue 29): the run directory's checks come before its lock, the lock
before any load. The model loader and the accelerator fail the test if reached."""
from pathlib import Path

import pytest

import trainer.rl.loop
from trainer.cli import main

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def nothing_loads(monkeypatch):
    def reached(*a, **k):
        raise AssertionError("a refused start must not get this far")

    for name in ("Accelerator", "load_policy", "load_tokenizer", "setup"):
        monkeypatch.setattr(trainer.rl.loop, name, reached)


def start(tmp_path: Path, *extra: str) -> int:
    return main(["train", str(REPO / "recipes/grpo_tiny.yaml"), "--set", "name=nonexist", "--set",
                 f"logging.run_dir={tmp_path / 'nonexist'}", "--set", "logging.wandb.mode=disabled", *extra])


def test_resume_without_a_checkpoint_is_refused_leaving_no_directory(tmp_path, nothing_loads, capsys):
    assert start(tmp_path, "--resume") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"parityrl: --resume: no usable checkpoint under {tmp_path / 'nonexist' / 'checkpoints'}")
    assert len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # no run directory, no .lock


def test_a_fresh_run_over_checkpoints_is_refused_without_taking_the_lock(tmp_path, nothing_loads, capsys):
    (tmp_path / "nonexist" / "checkpoints" / "step_000002").mkdir(parents=True)
    assert start(tmp_path) == 2
    err = capsys.readouterr().err
    assert "already holds checkpoints: continue it with `parityrl train " in err and " --resume`" in err, err
    assert not (tmp_path / "nonexist" / ".lock").exists()


def test_a_new_model_over_another_runs_checkpoints_is_told_to_take_a_name_not_to_resume(tmp_path, nothing_loads,
                                                                                        capsys):
    """A resume cannot change model.path, so suggesting --resume for a run on another model leads nowhere."""
    run = tmp_path / "nonexist"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "recipe.yaml").write_text("model:\n  path: builtin:tiny-base\n")
    assert start(tmp_path) == 2
    err = capsys.readouterr().err
    assert "already holds the checkpoints of another run: this one changes model.path 'builtin:tiny' (it ran " \
           "'builtin:tiny-base'), which a resume cannot; give it a name of its own (--set name=<new name>)" in err, err
    assert "--resume" not in err
