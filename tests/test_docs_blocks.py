"""The docs' "try it" blocks run as written, from an empty model cache, in a fresh directory: what a new user does
first. Each block is read from its page (never copied here), run by bash with the project's environment on PATH,
and must finish with status 0 and nothing from third-party libraries on its standard output."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Lines parityrl never prints: a library's logging format or warning categories on stdout.
THIRD_PARTY = re.compile(r"\[(WARNING|INFO)\]|Warning:|^(WARNING|INFO) \d\d-\d\d")


def bash_blocks(page: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)


@pytest.mark.slow
def test_the_moe_page_runs_from_an_empty_cache(tmp_path):
    (block,) = [b for b in bash_blocks(REPO / "docs" / "moe.md") if "builtin:zoo-" in b]
    work = tmp_path / "work"
    work.mkdir()
    (work / "recipes").symlink_to(REPO / "recipes")
    env = {**os.environ, "PARITYRL_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "disabled",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=work, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "step    3/3" in proc.stdout and "routing" in proc.stdout, proc.stdout[-2000:]
    noise = [line for line in proc.stdout.splitlines() if THIRD_PARTY.search(line)]
    assert not noise, noise[:5]
    assert (work / "runs" / "moe-qwen3" / "metrics.jsonl").is_file()
