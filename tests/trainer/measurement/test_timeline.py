"""The pipeline's timeline (trainer/measurement/timeline.py): spans by hand, busy shares by hand, and the
files it writes."""
import json

import pytest

from trainer.measurement.timeline import Timeline


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_timed_records_the_span_even_when_the_call_raises():
    clock = Clock()
    line = Timeline(clock)

    def work(x):
        clock.t += 2.5
        return x * 2

    assert line.timed("generate", 3, 1, work, 21) == 42

    def fail():
        clock.t += 1.0
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        line.timed("train", 3, 2, fail)
    assert [(s.lane, s.step, s.version, s.start, s.end) for s in line.spans] == [
        ("generate", 3, 1, 0.0, 2.5), ("train", 3, 2, 2.5, 3.5)]
    with pytest.raises(ValueError, match="timeline lane 'decode'"):
        line.add("decode", 1, 0, 0.0, 1.0)


def test_busy_fractions_count_overlapping_spans_of_a_lane_once():
    line = Timeline(Clock())
    # wall clock 0..10; generate busy 0-4 and 3-6 (overlap) = 6; train 4-5 and 6-10 = 5; sync 5-6 = 1; no eval
    for lane, start, end in [("generate", 0, 4), ("generate", 3, 6), ("train", 4, 5), ("sync", 5, 6),
                             ("train", 6, 10)]:
        line.add(lane, 1, 0, float(start), float(end))
    assert line.busy_fractions() == pytest.approx({"generate": 0.6, "train": 0.5, "sync": 0.1, "eval": 0.0})
    assert Timeline(Clock()).busy_fractions() == {}


def test_write_puts_every_span_in_jsonl_and_draws_the_png(tmp_path):
    pytest.importorskip("matplotlib")
    line = Timeline(Clock())
    line.add("generate", 1, 0, 0.0, 1.0)
    line.add("generate", 2, 0, 1.0, 2.0)
    line.add("train", 1, 0, 1.0, 3.0)
    png = line.write(tmp_path, "a run")
    rows = [json.loads(x) for x in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert rows == [{"lane": "generate", "step": 1, "version": 0, "start": 0.0, "end": 1.0},
                    {"lane": "generate", "step": 2, "version": 0, "start": 1.0, "end": 2.0},
                    {"lane": "train", "step": 1, "version": 0, "start": 1.0, "end": 3.0}]
    assert png == tmp_path / "timeline.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
