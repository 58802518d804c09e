"""README.md's "A first real run", copied as a new user copies it: its files written from its code blocks into an
empty directory, its commands run as written with the installed `parityrl`, its example refusal reproduced."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# the console script `make setup` installs next to this interpreter; else the module, as it runs the same main()
PARITYRL = [str(Path(sys.executable).parent / "parityrl")] if (Path(sys.executable).parent / "parityrl").is_file() \
    else [sys.executable, "-m", "trainer"]


def section() -> str:
    text = README.read_text()
    return text[text.index("## A first real run"):text.index("### What a run leaves")]


def blocks() -> list[tuple[str, str]]:
    """(language, body) of each fenced code block of the section."""
    return re.findall(r"^```(\w*)\n(.*?)^```", section(), re.S | re.M)


def write_files(where: Path) -> list[str]:
    """The section's files: a block whose first line is `# <file name>` is that file; a `cat > file <<'EOF'` block
    runs in bash. Returns the commands of the block of `parityrl` lines, comments cut."""
    commands = []
    for lang, body in blocks():
        first = body.splitlines()[0]
        if lang in ("yaml", "python") and re.fullmatch(r"# [\w.]+", first):
            (where / first[2:]).write_text(body)
        elif lang == "bash" and body.startswith("cat > "):
            subprocess.run(["bash", "-c", body], cwd=where, check=True)
        elif lang == "bash" and body.startswith("parityrl "):
            commands = [line.split("  #")[0].strip() for line in body.splitlines() if line.strip()]
    return commands


def run(where: Path, command: str, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    assert argv[0] == "parityrl", command
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # as a user's shell: only what is installed, and the current directory
    return subprocess.run([*PARITYRL, *argv[1:], *extra], cwd=where, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_section_has_the_files_and_commands_a_user_copies(tmp_path):
    commands = write_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_rewards.py", "my_run.yaml", "train.jsonl"]
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 10
    assert commands[0] == "parityrl train my_run.yaml --print-config" and commands[-1].endswith("--resume")
    assert "source .venv/bin/activate" in section() and ".venv/bin/parityrl" in section()


def test_print_config_runs_as_written_and_checks_the_reward_functions(tmp_path):
    commands = write_files(tmp_path)
    proc = run(tmp_path, commands[0])
    assert proc.returncode == 0, proc.stderr
    assert "correct: my_rewards:is_correct" in proc.stdout and "short: my_rewards:brevity" in proc.stdout
    # the mistake the issue found: a function the module lacks is refused by --print-config too
    (tmp_path / "my_rewards.py").write_text((tmp_path / "my_rewards.py").read_text().replace("def brevity", "def brief"))
    proc = run(tmp_path, commands[0])
    assert proc.returncode == 2 and "reward.functions.short = 'my_rewards:brevity'" in proc.stderr, proc.stderr


def test_the_example_refusal_is_what_the_command_prints(tmp_path):
    write_files(tmp_path)
    (example,) = [body for lang, body in blocks() if body.startswith("$ parityrl ")]
    command, *shown = example.splitlines()
    proc = run(tmp_path, command[2:], timeout=120)
    said = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(said) == len(shown), proc.stderr
    for want, got in zip(shown, said):
        assert got.startswith(want[:-3]) if want.endswith("...") else got == want, (want, got)


@pytest.mark.slow
def test_the_first_run_trains_a_step_and_resumes_on_the_built_in_pieces(tmp_path, tiny_model_dir):
    """The README's train and resume lines, on the tiny built-in model and the HF engine at one step each (the
    README's own model, SmolLM2, takes minutes a step on CPU; its recipe is checked by --print-config above)."""
    commands = write_files(tmp_path)
    train, resume = commands[1], commands[-1]
    small = ["--set", "model.path=builtin:tiny", "--set", "rollout.engine=hf", "--set", "parity.probe_prompts=1"]
    env_cache = os.environ.get("PARITYRL_CACHE")
    assert env_cache, "tests/conftest.py sets the cache the built-in models are in"
    first = run(tmp_path, train, *small, "--set", "train.steps=1", timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "=== parityrl run summary ===" in first.stdout
    again = run(tmp_path, resume, *small, "--set", "train.steps=2", timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and (tmp_path / "runs" / "my_run" / "metrics.jsonl").is_file()
