"""Every bad input of the corpus (bad_input_corpus.py) is refused the same way: exit status 2, one line
naming the key and the value, before ``train()`` -- so before any model or engine starts."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from bad_input_corpus import CASES, Case, classify, expected_words, materialise  # noqa: E402

import trainer.rl.loop  # noqa: E402
from trainer.cli import main  # noqa: E402
from trainer.lifecycle.stops import RewardFailed  # noqa: E402


@pytest.fixture
def no_training(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the bad input reached train(): models and the engine would start")

    monkeypatch.setattr(trainer.rl.loop, "train", refuse)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_refused_before_training_with_one_line(case, tmp_path, monkeypatch, capsys, no_training, tiny_model_dir):
    monkeypatch.chdir(tmp_path)  # relative run directories land here
    status = main(materialise(case, tmp_path))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert status == case.status, err
    assert len(lines) == case.lines and all(ln.startswith("parityrl: invalid recipe: ") for ln in lines), err
    for word in expected_words(case, tmp_path):
        assert word in lines[0], (word, lines[0])


def test_corpus_is_large_and_distinct():
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)


# The shape a user sees: a real process, stderr with no traceback, no engine constructed.
@pytest.mark.parametrize("case_id", ["recipe_empty", "data_malformed_jsonl_line", "reward_function_missing",
                                     "lora_target_absent", "run_dir_is_a_file"])
def test_refusal_as_a_process(case_id, tmp_path, tiny_model_dir):
    case = next(c for c in CASES if c.id == case_id)
    bucket, last = classify(case, tmp_path, timeout=300)
    assert bucket == "early+clear", last


def test_unexpected_error_is_one_line_and_debug_shows_it(tmp_path, monkeypatch, capsys, tiny_model_dir):
    def boom(*a, **k):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(trainer.rl.loop, "train", boom)
    argv = materialise(Case("ok"), tmp_path)
    assert main(argv) == 1
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines == ["parityrl: error: RuntimeError: boom second line (an unexpected failure: run with --debug or "
                     "PARITYRL_DEBUG=1 for the traceback)"]
    with pytest.raises(RuntimeError, match="boom"):
        main(argv + ["--debug"])


@pytest.mark.parametrize("rank", ["0", "1"])
def test_mid_run_stop_has_its_status_and_is_said_once(rank, tmp_path, monkeypatch, capsys, tiny_model_dir):
    def stop(*a, **k):
        e = RewardFailed("step 3: reward function 'r' returned nan at sample 5, expected a finite number")
        e.checkpoint_note = "checkpoint of the last completed step 2 written to X; continue with --resume"
        raise e

    monkeypatch.setattr(trainer.rl.loop, "train", stop)
    monkeypatch.setenv("RANK", rank)
    assert main(materialise(Case("ok"), tmp_path)) == 5
    err = capsys.readouterr().err
    if rank == "1":
        assert err == ""
    else:
        recipe = tmp_path / "recipe.yaml"
        assert err.splitlines() == ["parityrl: stopped: step 3: reward function 'r' returned nan at sample 5, expected "
                                    "a finite number; checkpoint of the last completed step 2 written to X; continue "
                                    f"with `parityrl train {recipe} --resume`"]
