"""metrics.jsonl after a crash mid-write: the partial last line is set aside (with a note) before a resumed run
appends, so every record of both runs reads back and the fragment is kept."""
import json

import pytest

from trainer.io.run_logger import RunLogger, set_aside_partial_line


def _log(run_dir, step, value):
    log = RunLogger(run_dir, config={}, wandb_mode="disabled", total_steps=10)
    log.log(step, {"reward/mean": value}, echo=False)
    log.close()


def test_a_resumed_run_appends_after_a_crash_mid_line_without_losing_a_record(tmp_path, capsys):
    _log(tmp_path, 1, 0.5)
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 2, "reward/me')  # the process died here
    _log(tmp_path, 2, 0.75)  # the resumed run
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]  # every line parses
    assert rows == [{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.75}]
    (aside,) = tmp_path.glob("metrics.jsonl.partial-*")
    assert aside.read_text() == '{"step": 2, "reward/me'
    out = capsys.readouterr().out
    assert f"note: {metrics} ended in a partial line (22 bytes" in out and f"moved it to {aside}" in out, out


@pytest.mark.parametrize("content, kept, fragment", [
    (b"", b"", None),
    (b'{"a": 1}\n', b'{"a": 1}\n', None),
    (b'{"a"', b"", b'{"a"'),  # the first record cut: the whole file is the fragment
    (b'{"a": 1}\n{"b": 2}\n{"c', b'{"a": 1}\n{"b": 2}\n', b'{"c'),
])
def test_only_what_follows_the_last_newline_is_set_aside(tmp_path, content, kept, fragment):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(content)
    aside = set_aside_partial_line(path)
    assert path.read_bytes() == kept
    assert (aside is None) if fragment is None else aside.read_bytes() == fragment


def test_a_fragment_longer_than_the_read_block_is_found_whole(tmp_path):
    path = tmp_path / "metrics.jsonl"
    long = b'{"x": "' + b"y" * 200_000  # past the 64 kB backwards-read block, several times
    path.write_bytes(b'{"a": 1}\n' + long)
    assert set_aside_partial_line(path).read_bytes() == long and path.read_bytes() == b'{"a": 1}\n'


def test_a_missing_file_is_left_to_the_logger_to_create(tmp_path):
    assert set_aside_partial_line(tmp_path / "metrics.jsonl") is None
