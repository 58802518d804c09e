"""Multi-turn SFT examples (`data.messages_fn`, trainer/supervised/sft.py): prompt/completion split, the loss mask
over the assistant's tokens only, and the recipe rules."""
from pathlib import Path

import pytest

from trainer.builtin.tiny import build_tokenizer
from trainer.commands.sft import load_sft_recipe
from trainer.config import RecipeError
from trainer.data.tasks.arithmetic_tools import arithmetic_tools_dataset, sft_messages
from trainer.environments.loading import resolve_tools
from trainer.models.batch import IGNORE, build_token_batch
from trainer.supervised import sft

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "sft_tools_tiny.yaml"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(512, 256)  # the tiny model's tokenizer and chat template, without a model


def _text(tok, ids):
    return "".join(tok.decode([i], skip_special_tokens=False) for i in ids)


def test_one_transcript_trains_exactly_the_assistant_tokens(tok):
    row = arithmetic_tools_dataset(1, seed=0).to_list()[0]
    tools = resolve_tools("builtin:arithmetic_calculator").schemas
    prompt, completion, mask = sft.conversation_example(tok, sft_messages(**row), tools)
    assert _text(tok, prompt) == ("<|bos|><|system|>tools: calculate<|end|><|user|>" + row["prompt"]
                                  + "<|end|><|assistant|>")
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "6 - 2 + 1"}}</tool_call><|end|>'
    assert _text(tok, completion) == call + "<|user|>tool: 5<|end|><|assistant|>" + "The answer is 5.<|end|>"
    trained = [i for i, m in zip(completion, mask) if m]
    context = [i for i, m in zip(completion, mask) if not m]
    assert _text(tok, trained) == call + "The answer is 5.<|end|>"
    assert _text(tok, context) == "<|user|>tool: 5<|end|><|assistant|>"
    # the mask is one run of 1s, the tool reply's 0s, then 1s again
    runs = "".join(str(m) for m in mask)
    assert runs.strip("1") == "0" * len(context) and runs.startswith("1") and runs.endswith("1")

    batch = build_token_batch([prompt], [completion], tok.pad_token_id, completion_mask=[mask])
    assert batch.input_ids[0, batch.prompt_len:].tolist() == completion  # context stays in the input
    assert [t for t in batch.targets[0].tolist() if t != IGNORE] == trained
    assert batch.mask[0].tolist() == [float(m) for m in mask]


def test_recipe_pairs_fit_their_limits(tok):
    cfg = load_sft_recipe(RECIPE, ["data.num_examples=16"])
    prompts, completions, masks, pixels = sft._pairs(cfg, tok)
    assert len(prompts) == len(completions) == len(masks) == 16 and pixels is None
    assert max(map(len, prompts)) <= cfg.data.max_prompt_tokens
    assert max(map(len, completions)) <= cfg.data.max_completion_tokens
    assert all(len(c) == len(m) and c[-1] == tok.eos_token_id and m[-1] == 1 for c, m in zip(completions, masks))


def test_conversation_errors(tok):
    with pytest.raises(ValueError, match="at least one assistant message"):
        sft.conversation_example(tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="marks no assistant tokens"):
        plain = ("{% for m in messages %}{% if m['role'] == 'assistant' %}>{% endif %}{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}>{% endif %}")
        sft.conversation_example(_with_template(tok, plain), [{"role": "user", "content": "a"},
                                                              {"role": "assistant", "content": "b"}])


def _with_template(tok, template):
    other = build_tokenizer(512, 256)
    other.chat_template = template
    return other


def test_an_unknown_tools_spec_is_a_recipe_error(tok, tmp_path):
    cfg = load_sft_recipe(RECIPE, ["data.num_examples=2", "data.tools=builtin:nope"])
    with pytest.raises(RecipeError, match="data.tools = 'builtin:nope'"):
        sft._pairs(cfg, tok)


def test_a_completion_over_its_budget_is_a_recipe_error_naming_the_key(tok):
    cfg = load_sft_recipe(RECIPE.parent / "sft_tiny.yaml", ["data.num_examples=2", "data.max_completion_tokens=4"])
    with pytest.raises(RecipeError, match=r"data.max_completion_tokens = 4: builtin:arithmetic example 0's completion "
                                          r"has \d+ tokens with EOS"):
        sft._pairs(cfg, tok)
