"""Every multi-process `accelerate launch` command in README.md and docs/ starts the processes it names.

`accelerate launch --num_processes N` alone runs ONE process on a machine without several GPUs
(trainer/distributed/launch_info.py says why); a config whose distributed_type is multi-process, or
`--multi_gpu`, makes it start N. This reads the commands as written and checks each names one.
"""
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MULTI = {"MULTI_GPU", "DEEPSPEED", "FSDP"}


def launch_commands(text: str) -> list[str]:
    """Each `accelerate launch ...` command: up to the closing backtick, or the end of the line in a code block."""
    return [m.group(0) for m in re.finditer(r"accelerate launch[^`\n]*", text)]


def processes(cmd: str) -> int | None:
    m = re.search(r"--num_processes[ =](\S+)", cmd)
    if not m:
        return None
    return int(m.group(1)) if m.group(1).isdigit() else 2  # <GPUs>, N: several


def config_is_multi_process(cmd: str) -> bool:
    m = re.search(r"--config_file[ =](\S+)", cmd)
    if not m:
        return False
    data = yaml.safe_load((REPO / m.group(1)).read_text())
    return data.get("distributed_type") in MULTI


def test_the_pages_have_launch_commands_to_check():
    found = [c for p in PAGES for c in launch_commands(p.read_text()) if (processes(c) or 0) > 1]
    assert len(found) >= 5, found  # README, scale-out.md's list and table, supervised.md


def test_every_multi_process_launch_names_a_multi_process_config_or_flag():
    bad = []
    for page in PAGES:
        for cmd in launch_commands(page.read_text()):
            n = processes(cmd)
            if n is not None and n > 1 and not ("--multi_gpu" in cmd or config_is_multi_process(cmd)):
                bad.append(f"{page.relative_to(REPO)}: {cmd}")
    assert not bad, "accelerate would start ONE process on CPU for:\n" + "\n".join(bad)


def test_the_check_catches_the_form_that_started_one_process():
    cmd = launch_commands("`accelerate launch --num_processes 2 -m trainer.train recipes/grpo_tiny.yaml`")[0]
    assert processes(cmd) == 2 and not config_is_multi_process(cmd) and "--multi_gpu" not in cmd
    ok = launch_commands("accelerate launch --config_file recipes/accelerate/ddp.yaml --num_processes 2 -m x\n")[0]
    assert config_is_multi_process(ok)
    assert not config_is_multi_process("accelerate launch --config_file recipes/accelerate/single.yaml -m x")
