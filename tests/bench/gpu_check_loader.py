"""bench/gpu/gpu_check.py loaded in the test's process (it puts bench/gpu/ on sys.path, so its row modules import
after it), and its ``--list`` read as rows: what the tests of each GPU row module share. Loading and listing build
and start nothing."""
import importlib.util
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu" / "gpu_check.py")
    gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(gpu_check)
    return gpu_check


def listed(capsys, *args: str) -> list[tuple[str, ...]]:
    """``gpu_check.py --list ARGS``'s rows: (item or "-", name) each; anything an import prints is not one."""
    gpu_check = load_gpu_check()
    capsys.readouterr()
    assert gpu_check.main(["--list", *args]) == 0
    return [tuple(line.split(None, 1)) for line in capsys.readouterr().out.splitlines()
            if re.match(r"^(\d+\.\d+|-) +\S", line)]
