"""Recipe refusals at load: a file that is not UTF-8, every problem of a recipe at once (an unknown key or a
wrong type does not hide the others), and the seed's range."""
from pathlib import Path

import pytest

import trainer.config.utf8 as utf8
from trainer.cli import main
from trainer.config import RecipeError
from trainer.config.utf8 import decode_utf8, utf8_problem
from trainer.lifecycle.preflight import load_recipe

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "grpo_tiny.yaml"


def problems(overrides, path=RECIPE) -> list[str]:
    with pytest.raises(RecipeError) as e:
        load_recipe(path, overrides, check_paths=False)
    return e.value.problems


def test_a_stray_byte_is_named_by_offset_line_and_column(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_bytes(b"name: x\n# caf\xff\ntrain: {steps: 2}\n")
    (msg,) = problems([], p)
    # byte 13 = len("name: x\n# caf"); line 2, its 6th byte
    assert msg == f"{p}: byte 13 (line 2, column 6) is 0xff, not UTF-8: expected a UTF-8 text file"


def test_a_utf16_recipe_is_named_as_such(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.read_text(), encoding="utf-16")
    (msg,) = problems([], p)
    assert msg.startswith(f"{p}: byte 0 (line 1, column 1) is 0xff") and "UTF-16 byte-order mark" in msg, msg


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_bytes(b"\xef\xbb\xbf" + RECIPE.read_bytes())
    assert load_recipe(p, check_paths=False).name == "grpo_tiny"


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 1 << 20])
def test_the_streamed_check_finds_the_byte_the_whole_decode_finds(tmp_path, monkeypatch, chunk):
    # a two-byte character split across chunks, then a bad byte at offset 8 (line 2 starts at 3: its 6th byte)
    p = tmp_path / "t.txt"
    p.write_bytes("ab\nc\u00e9\u00e9".encode() + b"\xff" + b"z")
    monkeypatch.setattr(utf8, "_CHUNK", chunk)
    expected = "byte 8 (line 2, column 6) is 0xff, not UTF-8: expected a UTF-8 text file"
    assert utf8_problem(p) == expected == decode_utf8(p.read_bytes())[1]


def test_a_character_cut_at_the_end_is_named(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(b"ok\n\xc3")
    assert utf8_problem(p) == "byte 3 (line 2, column 1) is 0xc3, not UTF-8: expected a UTF-8 text file"
    p.write_bytes("ok\n\u00e9\n".encode())
    assert utf8_problem(p) is None


def test_the_cli_refuses_a_non_utf8_recipe_with_one_line(tmp_path, capsys):
    p = tmp_path / "r.yaml"
    p.write_bytes(RECIPE.read_bytes().replace(b"# GRPO", b"# GRPO \xe9"))
    assert main(["train", str(p)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"parityrl: invalid recipe: {p}: byte 7 (line 1, column 8)"), lines


def test_an_unknown_key_does_not_hide_the_other_problems():
    got = problems(["train.bogus=1", "train.steps=0", "rollout.top_p=1.5"])
    assert len(got) == 3, got
    assert "unknown key 'train.bogus'" in got[0]
    assert any("train.steps = 0" in p for p in got) and any("rollout.top_p = 1.5" in p for p in got)


def test_an_unknown_algorithm_key_and_a_range_problem_are_both_reported():
    got = problems(["algorithm.foo=1", "train.steps=0", "checkpoint.keep_last=0"])
    assert [p.split(": ", 1)[1].split(";")[0] for p in got] == [
        "unknown key 'algorithm.foo'", "train.steps = 0: expected an integer >= 1",
        "checkpoint.keep_last = 0: expected an integer >= 1"]


def test_a_wrong_type_is_reported_with_the_rest_but_no_rule_judges_its_default():
    # group_size 'abc' is left at its default (8) to check the rest: the mini_batches rule names group_size,
    # so it would judge the default, not the recipe, and is not reported; lora.r is
    got = problems(["algorithm.group_size=abc", "algorithm.mini_batches=3", "model.lora.r=0"])
    assert len(got) == 2 and "algorithm.group_size = 'abc'" in got[0] and "model.lora.r = 0" in got[1], got


def test_a_section_of_the_wrong_type_and_another_problem():
    got = problems(["train=5", "rollout.temperature=0"])
    assert len(got) == 2 and "train = 5" in got[0] and "rollout.temperature = 0" in got[1], got


def test_an_unknown_algorithm_name_hides_only_its_own_section():
    got = problems(["algorithm.name=nope", "algorithm.mini_batches=3", "train.steps=0"])
    assert len(got) == 2 and "algorithm.name = 'nope'" in got[0] and "train.steps = 0" in got[1], got


def test_an_option_refused_by_its_algorithm_and_another_problem():
    got = problems(["algorithm.kl_coef=-1", "train.steps=0"])
    assert len(got) == 2 and "algorithm.kl_coef = -1" in got[0] and "train.steps = 0" in got[1], got


@pytest.mark.parametrize("seed", [-1, 2**32, 2**40])
def test_a_seed_outside_numpys_range_is_refused(seed):
    (msg,) = problems([f"train.seed={seed}"])
    assert f"train.seed = {seed}: expected an integer in [0, 4294967295]" in msg


def test_the_seed_range_ends_are_accepted():
    for seed in (0, 2**32 - 1):
        assert load_recipe(RECIPE, [f"train.seed={seed}"], check_paths=False).train.seed == seed
