"""bench/gpu/gpu_check.py names the colocated teacher's rows (issue 57 items 4, 5: bench/gpu/gpu_rows_teacher.py)
in ``--list`` (run in this process: listing builds and starts nothing)."""
from gpu_check_loader import listed

TEACHER_ROWS = [("57.4", "MoE teacher scores beside a sleeping MoE student"),
                ("57.5", "teacher engine: eager, own KV and share, counted")]


def test_list_names_each_teacher_row_with_its_item(capsys):
    every = listed(capsys)
    assert all(row in every for row in TEACHER_ROWS), every
    assert listed(capsys, "--only", "57.4", "--only", "57.5") == TEACHER_ROWS
