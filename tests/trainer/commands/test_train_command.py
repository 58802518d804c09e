"""`parityrl train` before any model loads (trainer/commands/train.py): every problem of a recipe in one report,
and a stop's hint that names the whole command which resumes the run."""
import re
import shlex
from pathlib import Path

import pytest

import trainer.rl.loop
from trainer.cli import build_parser, invoked_as, main
from trainer.commands.train import resume_command, with_resume_command
from trainer.lifecycle.preflight import load_recipe
from trainer.lifecycle.stops import Preempted

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "recipes" / "grpo_tiny.yaml"


@pytest.fixture
def nothing_trains(monkeypatch):
    def reached(*a, **k):
        raise AssertionError("a refused start must not reach train()")

    monkeypatch.setattr(trainer.rl.loop, "train", reached)


def run_dir_of(command: str) -> Path:
    """The run directory the command line resolves to, parsed as the shell and `parityrl` parse it."""
    argv = shlex.split(command)
    assert argv[:2] == ["parityrl", "train"] and argv[-1] == "--resume", argv
    args = build_parser().parse_args(argv[1:])
    assert args.resume
    return load_recipe(args.recipe, args.overrides, check_paths=False).run_dir


def test_the_resume_command_resolves_to_the_same_run_directory(tmp_path):
    sets = ["name=intr", f"logging.run_dir={tmp_path}/my runs/{{name}}", "train.steps=3",
            "reward.functions={r: 'builtin:arithmetic.exact_answer'}"]
    command = resume_command(str(TINY), sets)
    assert command.startswith(f"parityrl train {TINY} --set name=intr ")
    assert run_dir_of(command) == load_recipe(TINY, sets, check_paths=False).run_dir == tmp_path / "my runs" / "intr"
    # a launch: the launcher's own arguments are not known to the process, so the hint says to keep them
    assert resume_command("r.yaml", ["name=a b"], "<your launch command> -m trainer.train") == \
        "<your launch command> -m trainer.train r.yaml --set 'name=a b' --resume"


def test_the_command_names_the_program_as_it_can_be_called_again(monkeypatch, tmp_path):
    bin_dir = tmp_path / "venv dir" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "parityrl").write_text("#!/bin/sh\n")
    (bin_dir / "parityrl").chmod(0o755)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert invoked_as(str(bin_dir / "parityrl")) == shlex.quote(str(bin_dir / "parityrl"))  # not on the PATH
    monkeypatch.setenv("PATH", str(bin_dir))
    assert invoked_as(str(bin_dir / "parityrl")) == "parityrl"  # the venv activated
    assert invoked_as("/x/trainer/__main__.py").endswith(" -m trainer")


def test_every_resume_hint_names_the_command():
    cmd = "parityrl train r.yaml --set name=intr --resume"
    assert with_resume_command("checkpoint of step 4 written to X; continue with --resume", cmd) == \
        f"checkpoint of step 4 written to X; continue with `{cmd}`"
    assert with_resume_command("fix that and continue with --resume from the newest checkpoint", cmd) == \
        f"fix that and continue with `{cmd}` from the newest checkpoint"
    assert with_resume_command("--resume: no usable checkpoint under X", cmd) == "--resume: no usable checkpoint under X"


def test_a_stop_prints_the_command_that_resumes_this_run(tmp_path, monkeypatch, capsys):
    def preempted(*a, **k):
        e = Preempted("SIGINT received", 2)
        e.checkpoint_note = f"checkpoint of the last completed step 2 written to {tmp_path}/x; continue with --resume"
        raise e

    monkeypatch.setattr(trainer.rl.loop, "train", preempted)
    monkeypatch.chdir(tmp_path)
    sets = ["--set", "name=intr", "--set", "logging.wandb.mode=disabled", "--set", "train.steps=3"]
    assert main(["train", str(TINY), *sets]) == 130
    err = capsys.readouterr().err
    (printed,) = re.findall(r"continue with `([^`]+)`", err)
    assert run_dir_of(printed) == Path("runs/intr")
    assert printed == f"parityrl train {TINY} --set name=intr --set logging.wandb.mode=disabled --set train.steps=3 --resume"


def test_four_unrelated_problems_are_said_at_once(tmp_path, monkeypatch, capsys, nothing_trains):
    (tmp_path / "rewards.py").write_text("def good(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"""\
name: four
model: {{path: builtin:tiny}}
data: {{source: {tmp_path}/missing.jsonl}}
reward: {{functions: {{r: '{tmp_path}/rewards.py:goood'}}}}
train: {{steps: 3, learning_rat: 1.0e-3}}
rollout: {{temperature: -1}}
logging: {{run_dir: '{tmp_path}/run', wandb: {{mode: disabled}}}}
""")
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(recipe)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4 and all(ln.startswith(f"parityrl: invalid recipe: {recipe}: ") for ln in lines), lines
    said = "\n".join(lines)
    for words in ("unknown key 'train.learning_rat' (did you mean 'train.learning_rate'?)",
                  "rollout.temperature = -1.0: expected a number > 0",
                  f"data.source = '{tmp_path}/missing.jsonl': no such file or directory",
                  "reward.functions.r = ", "no attribute 'goood'"):
        assert words in said, (words, said)
    assert not (tmp_path / "run").exists()  # nothing created


def test_print_config_checks_the_reward_functions_too(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_rewards.py").write_text("def is_correct(prompts, completions, **kw):\n    return [0.0]\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("reward: {functions: {correct: my_rewards:is_correct, short: my_rewards:brevity}}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(recipe), "--print-config"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "reward.functions.short = 'my_rewards:brevity'" in line and "no attribute 'brevity'" in line, line
    recipe.write_text("reward: {functions: {correct: my_rewards:is_correct}}\n")
    assert main(["train", str(recipe), "--print-config"]) == 0
    out = capsys.readouterr()
    assert "correct: my_rewards:is_correct" in out.out and "checks passed" not in out.out  # stdout: the YAML alone
    assert out.err.startswith("parityrl: the recipe's checks passed (those that need no model")
