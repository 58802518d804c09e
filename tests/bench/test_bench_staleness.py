"""bench/learning/bench_staleness.py's summary of one run: hand-computed on a metrics.jsonl written here (no run)."""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "learning"))

import bench_staleness  # noqa: E402


def test_worst_window_finds_a_collapse_that_recovers():
    values = [0.6, 0.7, 0.8, 0.9, 0.9, 0.2, 0.1, 0.1, 0.2, 0.3, 0.9, 0.9]
    low, end = bench_staleness.worst_window(values)
    # windows ending at 9 (0.9 0.2 0.1 0.1 0.2 -> 0.30), 10 (0.2 0.1 0.1 0.2 0.3 -> 0.18), 11 (-> 0.32)
    assert low == pytest.approx(0.18) and end == 10


def test_worst_window_refuses_fewer_values_than_its_width():
    with pytest.raises(ValueError, match="fewer than the window's 5"):
        bench_staleness.worst_window([0.1, 0.2])


def test_summary_of_a_run(tmp_path):
    rewards = [0.5, 0.5, 0.5, 0.5, 0.5, 0.9, 0.1, 0.1, 0.1, 0.1, 0.8, 0.8, 0.8, 0.8, 0.8]
    rows = [{"step": 0, "eval/mean@4": 0.40}]
    for step, r in enumerate(rewards, 1):
        rows.append({"step": step, "reward/mean": r, "staleness/kl_k3": 0.01 * step, "staleness/lag": min(step - 1, 4)})
        if step == 8:
            rows.append({"step": 8, "eval/mean@4": 0.10})
    rows.append({"step": 15, "eval/mean@4": 0.55})
    run = tmp_path / "k4_decoupled_s0"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = bench_staleness.summary(tmp_path, "k4_decoupled_s0")
    assert s["reward_gain"] == pytest.approx(0.8 - 0.5)
    assert s["evals"] == [(0, 0.40), (8, 0.10), (15, 0.55)]
    assert s["eval_rise"] == pytest.approx(0.15)
    # steps 6-10: 0.9 0.1 0.1 0.1 0.1 -> 0.26; steps 7-11: 0.1 x4 + 0.8 -> 0.24, the lowest
    assert s["reward_worst5"] == pytest.approx(0.24) and s["reward_worst5_step"] == 11
    assert s["kl_k3_mean"] == pytest.approx(0.08) and s["kl_k3_max"] == pytest.approx(0.15)
    assert s["lag_max"] == 4


def _write_run(folder: Path, name: str, before: float, after: float) -> None:
    rows = [{"step": 0, "eval/mean@4": before}]
    rows += [{"step": s, "reward/mean": 0.5, "staleness/kl_k3": 0.0} for s in range(1, 6)]
    rows.append({"step": 5, "eval/mean@4": after})
    (folder / name).mkdir()
    (folder / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_gives_each_objective_its_share_of_the_on_policy_rise(tmp_path, capsys):
    _write_run(tmp_path, "k0_decoupled_s0", 0.5, 0.7)
    _write_run(tmp_path, "k4_decoupled_s0", 0.5, 0.65)
    bench_staleness.report(tmp_path, [0, 4], ["decoupled"], [0], {})
    lines = capsys.readouterr().out.splitlines()
    assert "| 0 | any (on-policy) | 1 | +0.000 | +0.200 | 100% | 0.500 |" in lines
    assert "| 4 | decoupled | 1 | +0.000 | +0.150 | 75% | 0.500 |" in lines


def test_report_without_the_on_policy_runs_gives_no_share(tmp_path, capsys):
    _write_run(tmp_path, "k4_m2po_s1", 0.5, 0.6)
    bench_staleness.report(tmp_path, [4], ["m2po"], [1], {})
    assert "| 4 | m2po | 1 | +0.000 | +0.100 | – | 0.500 |" in capsys.readouterr().out.splitlines()


def test_report_names_the_runs_a_folder_lacks_and_those_it_holds(tmp_path):
    _write_run(tmp_path, "k4_m2po_s1", 0.5, 0.6)
    with pytest.raises(SystemExit, match="no metrics.jsonl for k4_decoupled_s1 .* holds k4_m2po_s1"):
        bench_staleness.report(tmp_path, [4], ["decoupled"], [1], {})
