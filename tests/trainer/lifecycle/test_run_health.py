"""The summary's warnings for a run that went wrong (trainer/lifecycle/run_health.py), on records shaped as the
demo's: a collapse as one host's 50-step run recorded it (issue 56's table) warns on every sign, with the probe's
growth said to have come with the entropy; the healthy run of another host warns on nothing; each rule's edge is
hand-checked."""
from trainer.lifecycle.run_health import health_warnings


def _steps(n: int, **ends: tuple[float, float]) -> list[dict]:
    """``n`` step records, each key moving linearly from its first to its last value."""
    return [{"step": s + 1, **{k.replace("__", "/"): a + (b - a) * s / (n - 1) for k, (a, b) in ends.items()}}
            for s in range(n)]


def test_the_collapse_warns_on_every_sign_and_ties_the_mismatch_to_the_entropy():
    h = _steps(50, episode__tool_calls=(0.76, 0.0), train__entropy=(0.08, 1.0))
    for r in h:  # the first and last 5 steps' means as that run's summary printed them
        r["reward/mean"] = 0.066 if r["step"] <= 5 else (0.016 if r["step"] > 45 else 0.04)
    evals = {0: {"eval/mean@4": 0.051, "eval/greedy": 0.203}, 50: {"eval/mean@4": 0.0, "eval/greedy": 0.016}}
    lines = health_warnings(h, 5, evals, {0: 2.0e-3, 1: 2.0e-3, 25: 9e-3, 50: 3.2e-2})
    assert [line.split(",")[0] for line in lines] == [
        "warning: held-out mean@4 fell over the run", "warning: training reward fell", "warning: tool use collapsed",
        "warning: entropy ran away", "warning: the probe's mismatch grew 16x"]
    assert "0.051 (step 0) -> 0.000 (step 50)" in lines[0]
    assert "it grew with the entropy" in lines[-1] and "parityrl doctor" in lines[-1]


def test_the_healthy_run_warns_on_nothing():
    h = _steps(50, reward__mean=(0.216, 0.294), episode__tool_calls=(0.78, 0.93), train__entropy=(0.30, 0.25))
    evals = {0: {"eval/mean@4": 0.199}, 25: {"eval/mean@4": 0.30}, 50: {"eval/mean@4": 0.402}}
    assert health_warnings(h, 5, evals, {0: 4e-4, 50: 9e-4}) == []


def test_a_fall_needs_both_the_absolute_and_the_relative_margin():
    h = _steps(10, reward__mean=(0.90, 0.84))  # -0.06 but 7% of where it started: evaluation noise
    assert health_warnings(h, 1, {}, {}) == []
    h = _steps(10, reward__mean=(0.10, 0.07))  # 30% but only -0.03
    assert health_warnings(h, 1, {}, {}) == []
    h = _steps(10, reward__mean=(0.20, 0.14))  # -0.06 and 30%
    assert health_warnings(h, 1, {}, {}) == ["warning: training reward fell, 0.200 -> 0.140 (first 1 / last 1 step(s))"]


def test_a_grown_mismatch_without_a_runaway_entropy_is_not_blamed_on_it():
    h = _steps(10, train__entropy=(0.5, 0.6))
    (line,) = health_warnings(h, 2, {}, {0: 1e-3, 10: 1.2e-2})
    assert "grew 12x" in line and "the entropy did not run away" in line


def test_the_growth_is_counted_from_the_first_probe_after_a_sync():
    """A healthy HF-engine run with a merged bf16 sync (the demo's recipe, 12 steps on CPU): the probe before step 1
    compares the engine with its own implementation at the same weights, and the first merged sync's rounding alone
    takes it 5,000x up. Counted from the first synced probe, a later doubling is not a grown mismatch."""
    h = _steps(12, train__entropy=(0.03, 0.014))
    assert health_warnings(h, 3, {}, {0: 1.5e-6, 1: 7.5e-3, 2: 7.5e-3, 6: 8.1e-3, 12: 1.8e-2}) == []
    (line,) = health_warnings(h, 3, {}, {0: 1.5e-6, 1: 7.5e-3, 6: 8.1e-3, 12: 9.0e-2})
    assert "grew 12x, 7.5e-03 -> 9.0e-02" in line


def test_greedy_is_read_where_no_sampled_accuracy_was_evaluated():
    (line,) = health_warnings(_steps(4, reward__mean=(0.5, 0.5)), 1, {0: {"eval/greedy": 0.8}, 4: {"eval/greedy": 0.5}},
                              {})
    assert line.startswith("warning: held-out greedy fell over the run, 0.800 (step 0) -> 0.500 (step 4)")


def test_the_evaluation_that_shows_the_fall_prints_the_warning_under_its_line():
    from trainer.measurement.evaluation import Evaluator

    ev = Evaluator(cfg=None, rows=[{}] * 64, dp=None, pad_id=0)
    start = ev.console_line(0, {"eval/mean@4": 0.051, "perf/eval_s": 1.0})
    same = ev.console_line(25, {"eval/mean@4": 0.047, "perf/eval_s": 1.0})
    fell = ev.console_line(50, {"eval/mean@4": 0.0, "perf/eval_s": 1.0})
    assert "\n" not in start and "\n" not in same
    assert fell.splitlines()[1] == ("warning: held-out mean@4 fell over the run, 0.051 (step 0) -> 0.000 (step 50): "
                                    "the policy got worse at the task")
