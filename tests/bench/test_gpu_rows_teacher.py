"""bench/gpu/gpu_check.py names the colocated teacher's rows (issue 57 items 4, 5: bench/gpu/gpu_rows_teacher.py)
in ``--list`` (run in this process: listing builds and starts nothing)."""
import importlib.util
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEACHER_ROWS = [("57.4", "MoE teacher scores beside a sleeping MoE student"),
                ("57.5", "teacher engine: eager, own KV and share, counted")]


def _listed(capsys, *args) -> list[tuple[str, str]]:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu" / "gpu_check.py")
    gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(gpu_check)
    capsys.readouterr()
    assert gpu_check.main(["--list", *args]) == 0
    # a row's line: its item (or "-") and its name; anything an import prints is not one
    return [tuple(line.split(None, 1)) for line in capsys.readouterr().out.splitlines()
            if re.match(r"^(\d+\.\d+|-) +\S", line)]


def test_list_names_each_teacher_row_with_its_item(capsys):
    listed = _listed(capsys)
    assert all(row in listed for row in TEACHER_ROWS), listed
    assert _listed(capsys, "--only", "57.4", "--only", "57.5") == TEACHER_ROWS
