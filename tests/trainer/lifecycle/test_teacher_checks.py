"""A teacher must read the student's ids as the student does (trainer/lifecycle/teacher_checks.py): another vocabulary, other
special tokens or a smaller vocab size are refused naming teacher.path, before any engine starts; a larger vocab size
(padding rows) is accepted."""
import json
import shutil
from pathlib import Path

import pytest

from trainer.config import RecipeError
from trainer.lifecycle.teacher_checks import check_same_tokenizer

REPO = Path(__file__).resolve().parents[3]


def teacher_copy(tiny_model_dir, tmp_path, edit_tokenizer=None, edit_config=None):
    out = tmp_path / "teacher"
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tiny_model_dir, out)
    for name, edit in (("tokenizer.json", edit_tokenizer), ("config.json", edit_config)):
        if edit:
            data = json.loads((out / name).read_text())
            edit(data)
            (out / name).write_text(json.dumps(data))
    return str(out)


def test_the_same_tokenizer_passes(tiny_model_dir, tmp_path):
    check_same_tokenizer(tiny_model_dir, teacher_copy(tiny_model_dir, tmp_path), "t")


def test_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    def swap(tok):  # ids 300 and 301 name each other's strings (the merges, written in strings, still hold)
        vocab = tok["model"]["vocab"]
        a, b = (next(w for w, i in vocab.items() if i == k) for k in (300, 301))
        vocab[a], vocab[b] = 301, 300

    teacher = teacher_copy(tiny_model_dir, tmp_path, edit_tokenizer=swap)
    with pytest.raises(RecipeError, match=r"where: teacher.path = 'my-teacher': expected the student's tokenizer "
                                          r"\(model.path's\); its vocabulary differs .* -> 300"):
        check_same_tokenizer(tiny_model_dir, teacher, "my-teacher", "where")


def test_a_smaller_vocab_size_is_refused_and_a_larger_accepted(tiny_model_dir, tmp_path):
    def narrower(cfg):
        cfg["vocab_size"] -= 64

    def wider(cfg):
        cfg["vocab_size"] += 64

    teacher = teacher_copy(tiny_model_dir, tmp_path / "narrow", edit_config=narrower)
    size = json.loads((tmp_path / "narrow" / "teacher" / "config.json").read_text())["vocab_size"]
    with pytest.raises(RecipeError, match=f"teacher.path = 't': vocab_size {size} in its config.json; expected at "
                                          f"least the student's {size + 64}"):
        check_same_tokenizer(tiny_model_dir, teacher, "t")
    # more rows than the student's, the same tokenizer: padding rows (Qwen2.5-7B's 152,064 beside 1.5B's 151,936);
    # a teacher model of that shape is built and scored in tests/trainer/teacher/test_wider_teacher.py
    check_same_tokenizer(tiny_model_dir, teacher_copy(tiny_model_dir, tmp_path / "wide", edit_config=wider), "t")


def test_print_config_refuses_a_teacher_of_another_vocabulary(tiny_model_dir, tmp_path, capsys):
    """`parityrl train <recipe> --print-config` runs the tokenizer check when both models are here already (the
    student built-in once built, the teacher a local directory), with the line training's start would print."""
    from trainer.cli import main

    def swap(tok):
        vocab = tok["model"]["vocab"]
        a, b = (next(w for w, i in vocab.items() if i == k) for k in (300, 301))
        vocab[a], vocab[b] = 301, 300

    # the student builtin:tiny (tiny_model_dir has built it), distilled on the arithmetic task
    recipe = [str(REPO / "recipes" / "grpo_tiny.yaml"), "--set", "algorithm.name=opd"]
    same = teacher_copy(tiny_model_dir, tmp_path / "same")
    assert main(["train", *recipe, "--set", f"teacher.path={same}", "--print-config"]) == 0
    capsys.readouterr()
    other = teacher_copy(tiny_model_dir, tmp_path / "other", edit_tokenizer=swap)
    assert main(["train", *recipe, "--set", f"teacher.path={other}", "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    with pytest.raises(RecipeError) as at_start:
        check_same_tokenizer(tiny_model_dir, other, other, "recipe")
    assert err.count("\n") == 0 and err.endswith(str(at_start.value).removeprefix("recipe: ")), err
    assert f"teacher.path = {other!r}: expected the student's tokenizer" in err
