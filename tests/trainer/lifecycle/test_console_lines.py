"""Console lines of a run: the ETA after warm-up, distinct samples, the summary over the whole run."""
import json
from types import SimpleNamespace

from trainer.io.run_logger import RunLogger, eta_text
from trainer.lifecycle.samples_table import console_rows
from trainer.lifecycle.summary import distill_line, episodes_line, print_summary, routing_line, whole_run


def test_eta_counts_only_the_steps_after_the_first_logged_one():
    # first step 1 (warm-up included) gives no estimate; after step 3, 2 steps took 20 s -> 10 s/step x 7 left
    assert eta_text(1, 1, 0.0, 10) == "-"
    assert eta_text(3, 1, 20.0, 10) == "70s"
    assert eta_text(10, 1, 90.0, 10) == "0s"
    # a resumed process: its first logged step is 6
    assert eta_text(6, 6, 0.0, 10) == "-" and eta_text(8, 6, 8.0, 10) == "8s"


def _row(prompt, completion):
    return {"prompt": prompt, "completion": completion}


def test_console_rows_are_distinct_and_prefer_other_prompts():
    rows = [_row("p0", "4"), _row("p0", "4"), _row("p1", "7"), _row("p1", "8")]
    assert console_rows(rows) == [_row("p0", "4"), _row("p1", "7")]
    # one prompt only: its two different completions, never the same one twice
    assert console_rows([_row("p0", "4"), _row("p0", "4"), _row("p0", "5")]) == [_row("p0", "4"), _row("p0", "5")]
    assert console_rows([_row("p0", "4"), _row("p0", "4")]) == [_row("p0", "4")]


def _rec(step, reward, mae=1e-3):
    return {"step": step, "reward/mean": reward, "parity/mae": mae, "parity/kl_k3": 1e-6, "parity/max_abs": 0.1}


def test_summary_after_a_resume_covers_the_whole_run(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    # steps 1-4 before the stop (step 4 after the checkpoint at 3), then the resume repeats 4 and runs to 8
    rows = [{"step": 0, "probe/mae": 1e-3}] + [_rec(s, 0.1 * s) for s in range(1, 5)]
    rows += [{"step": 0, "probe/mae": 2e-3}] + [_rec(s, 0.1 * s + 0.01) for s in range(4, 9)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "rew')  # a torn last line
    resumed = [_rec(s, 0.1 * s + 0.01) for s in range(4, 9)]
    whole = whole_run(path, resumed)
    assert [r["step"] for r in whole] == list(range(1, 9))
    assert whole[3]["reward/mean"] == 0.1 * 4 + 0.01  # the resumed record of step 4
    logger = SimpleNamespace(enabled=True, metrics_path=path, wandb_location="disabled", summary=lambda v: None)
    print_summary(resumed, tmp_path / "step_8", logger)
    out = capsys.readouterr().out
    # k = min(5, 8 // 4) = 2: first (0.1 + 0.2) / 2, last (0.71 + 0.81) / 2
    assert "first 2 step(s): 0.150   last 2 step(s): 0.760   change +0.610" in out


def test_summary_without_a_metrics_file_uses_the_process_records(tmp_path):
    assert whole_run(tmp_path / "missing.jsonl", [_rec(1, 0.5)]) == [_rec(1, 0.5)]


def test_the_routing_line_averages_the_steps_and_compares_only_those_scored_both_ways():
    h = [{"parity/routing_agree": 0.99, "parity/routing_tokens_any_diff": 0.02, "parity/kl_k3": 3e-4,
          "parity/unreplayed/kl_k3": 6e-3},
         {"parity/routing_agree": 0.97, "parity/routing_tokens_any_diff": 0.04, "parity/kl_k3": 5e-4}]
    assert routing_line(h) == ("routing  routers agree on 98.00% of (token, layer) choices, 3.0% of tokens differ "
                               "somewhere; replay: kl_k3 3.00e-04 vs 6.00e-03 without (1 step(s) scored both ways)")
    assert routing_line([{"parity/kl_k3": 1e-3}]) == ""  # a dense model's run


def test_the_episodes_line_compares_tool_use_over_the_first_and_last_steps():
    h = [{"episode/tool_calls": c, "episode/tool_errors": e} for c, e in
         [(0.5, 0.25), (0.75, 0.0), (0.25, 0.5), (1.0, 0.0), (1.0, 0.125), (0.875, 0.0)]]
    # k = 2: calls (0.5 + 0.75) / 2 -> (1.0 + 0.875) / 2, errors (0.25 + 0) / 2 -> (0.125 + 0) / 2
    assert episodes_line(h, 2) == ("episodes tool calls per episode 0.62 -> 0.94, tool errors 0.12 -> 0.06 "
                                   "(first 2 / last 2 step(s))")
    assert episodes_line(h[:1], 5) == ("episodes tool calls per episode 0.50 -> 0.50, tool errors 0.25 -> 0.25 "
                                       "(first 1 / last 1 step(s))")
    assert episodes_line([{"reward/mean": 0.5}], 5) == ""  # completions, no episodes


def _step_line(capsys, m) -> str:
    logger = RunLogger.__new__(RunLogger)  # the console line alone: no run directory, no wandb
    logger._first_step, logger._t_first, logger.total_steps = 1, 0.0, 10
    logger._print(2, {"reward/mean": 0.5, "parity/mae": 1e-3, "parity/kl_k3": 1e-6, **m})
    return capsys.readouterr().out


def test_the_step_line_shows_the_distillation_figures_with_a_teacher(capsys):
    assert "distill" not in _step_line(capsys, {})  # no teacher
    assert "kl_k3 1.0e-06  distill rkl +0.123  loss" in _step_line(capsys, {"distill/reverse_kl": 0.1234})
    # a teacher-parity step: the share of the signal the teacher's numerics could account for
    assert "distill rkl -0.020 noise 0.01  loss" in _step_line(capsys, {"distill/reverse_kl": -0.02,
                                                                        "distill/teacher_noise_frac": 0.0112})


def test_the_distill_line_compares_the_first_and_last_steps_and_averages_the_measured_noise(tmp_path, capsys):
    h = [{**_rec(s, 0.1), "distill/reverse_kl": 0.1 * (21 - s)} for s in range(1, 21)]
    for r in h[::5]:  # steps 1, 6, 11, 16 measured teacher parity
        r["distill/teacher_noise_frac"] = 0.01 * r["step"]
    # k = 5 (the reward line's): first (2.0 + 1.9 + 1.8 + 1.7 + 1.6) / 5, last (0.5 + ... + 0.1) / 5
    line = distill_line(h, 5)
    assert line == ("distill  reverse KL per token, first 5 step(s): +1.8000   last 5 step(s): +0.3000   change "
                    "-1.5000; teacher noise frac 0.085 (4 step(s) measured)")
    assert distill_line([_rec(1, 0.1)], 5) == ""  # no teacher
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in h))
    print_summary(h, tmp_path / "step_20", SimpleNamespace(enabled=True, metrics_path=path,
                                                            wandb_location="disabled", summary=lambda v: None))
    assert line in capsys.readouterr().out
