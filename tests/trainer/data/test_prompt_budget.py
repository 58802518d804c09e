"""data.system_prompt (chat_messages) and data.overlong_prompts (check_prompt_lengths), on the tiny tokenizer.

The tiny template writes ``<|bos|>`` then ``<|role|>content<|end|>`` per turn and
``<|assistant|>`` as the generation prompt (trainer/builtin/tiny.py); a copy of it with
SmolLM2's rule (a default system turn when the first message is not a system one)
stands in for a real template that inserts a default.
"""
from __future__ import annotations

import datasets
import pytest

from trainer.builtin import tiny
from trainer.config.schema import DataConfig, RecipeError
from trainer.data.datasets import apply_prompt_budget, chat_messages, check_prompt_lengths, encode_prompts

DEFAULT_SYSTEM = "You are a helpful AI assistant"
# The tiny template with SmolLM2's default-system rule (its chat_template.jinja) grafted in.
WITH_DEFAULT = tiny.CHAT_TEMPLATE.replace(
    "{% for message in messages %}",
    "{% if messages[0]['role'] != 'system' %}{{ '<|system|>" + DEFAULT_SYSTEM + "' + eos_token }}{% endif %}"
    "{% for message in messages %}", 1)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny.build_tiny_base(tmp_path_factory.mktemp("tiny") / "base"))


@pytest.fixture
def tok_default(tok):
    original = tok.chat_template
    tok.chat_template = WITH_DEFAULT
    yield tok
    tok.chat_template = original


def _text(tok, prompt, system_prompt):
    return tok.decode(encode_prompts(tok, [prompt], system_prompt=system_prompt)[0])


def test_system_prompt_on_a_template_without_default(tok):
    assert _text(tok, "Hi", None) == "<|bos|><|user|>Hi<|end|><|assistant|>"
    assert _text(tok, "Hi", "") == "<|bos|><|user|>Hi<|end|><|assistant|>"  # no empty turn added
    assert _text(tok, "Hi", "Be brief.") == "<|bos|><|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>"


def test_system_prompt_on_a_template_with_a_default(tok_default):
    tok = tok_default
    assert _text(tok, "Hi", None) == f"<|bos|><|system|>{DEFAULT_SYSTEM}<|end|><|user|>Hi<|end|><|assistant|>"
    # "" = the shortest rendering without system text: an explicit empty turn suppresses the default
    assert _text(tok, "Hi", "") == "<|bos|><|system|><|end|><|user|>Hi<|end|><|assistant|>"
    assert chat_messages(tok, "Hi", "")[0] == {"role": "system", "content": ""}
    assert _text(tok, "Hi", "Be brief.") == "<|bos|><|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>"


def _ds(prompts):
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": [str(i) for i in range(len(prompts))]})


# "<|bos|><|user|>" + text + "<|end|><|assistant|>": 4 special tokens around the text's own tokens.
SHORT, LONG = "Hi", "Tom has 3 apples and 5 pears."


def test_lengths_are_checked_at_load_naming_dataset_rows(tok):
    n_short, n_long = (len(encode_prompts(tok, [p])[0]) for p in (SHORT, LONG))
    assert n_short < 8 < n_long
    ds = _ds([SHORT, LONG, SHORT, LONG])
    kept, dropped = check_prompt_lengths(ds, tok, max_prompt_tokens=n_long)
    assert (len(kept), dropped) == (4, [])
    with pytest.raises(ValueError) as e:
        check_prompt_lengths(ds, tok, max_prompt_tokens=8, source="train.jsonl")
    assert str(e.value) == (f"data.max_prompt_tokens = 8: 2 of 4 prompts of 'train.jsonl' are longer: row 1 ({n_long}"
                            f" tokens), row 3 ({n_long} tokens); expected every prompt to fit (raise the limit, or set"
                            " data.overlong_prompts: drop)")


def test_drop_keeps_the_rest_in_order(tok):
    ds = _ds([LONG, SHORT, LONG, SHORT])
    kept, dropped = check_prompt_lengths(ds, tok, max_prompt_tokens=8, overlong="drop")
    assert dropped == [0, 2]
    assert kept["prompt"] == [SHORT, SHORT] and kept["answer"] == ["1", "3"]
    with pytest.raises(ValueError, match="every prompt of '<dataset>' is longer"):
        check_prompt_lengths(_ds([LONG]), tok, max_prompt_tokens=8, overlong="drop")


def test_system_prompt_counts_against_the_budget(tok_default):
    n_plain = len(encode_prompts(tok_default, [SHORT], system_prompt="")[0])
    with pytest.raises(ValueError, match="1 of 1 prompts"):  # the template's default system turn does not fit
        check_prompt_lengths(_ds([SHORT]), tok_default, max_prompt_tokens=n_plain)
    assert check_prompt_lengths(_ds([SHORT]), tok_default, max_prompt_tokens=n_plain, system_prompt="")[1] == []


def test_recipe_wrapper_raises_recipe_error_and_reports_drops(tok, capsys):
    d = DataConfig(source="mine.jsonl", max_prompt_tokens=8)
    with pytest.raises(RecipeError, match=r"^data.max_prompt_tokens = 8: 1 of 2 prompts of 'mine.jsonl'.*row 1 "):
        apply_prompt_budget(_ds([SHORT, LONG]), tok, d)
    d.overlong_prompts = "drop"
    assert apply_prompt_budget(_ds([SHORT, LONG]), tok, d)["prompt"] == [SHORT]
    assert "1 of 2 prompts are longer than data.max_prompt_tokens = 8 and were dropped" in capsys.readouterr().out
