"""The warning when tool episodes stop calling tools, and the first prompt shown as the model reads it."""
from types import SimpleNamespace

from rollout.types import Rollouts
from trainer.lifecycle.samples_table import rendered_prompt
from trainer.lifecycle.tool_use import ToolUseWatch


def test_no_call_for_three_steps_warns_then_every_ten_while_it_lasts():
    w = ToolUseWatch()
    assert [w.check(s, 0.0) for s in (1, 2)] == [None, None]
    msg = w.check(3, 0.0)
    assert msg.startswith("warning: step 3: no episode called a tool for 3 steps (episode/tool_calls 0)")
    assert [w.check(s, 0.0) for s in range(4, 13)] == [None] * 9
    assert w.check(13, 0.0).startswith("warning: step 13: no episode called a tool for 13 steps")
    assert w.check(14, 0.5) is None and w.check(15, 0.0) is None  # a call resets the count
    assert w.check(16, None) is None  # not a tool run


def test_the_first_prompt_is_decoded_with_its_special_tokens(tiny_model_dir):
    from trainer.models.policy import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    drawn = SimpleNamespace(rollouts=Rollouts(prompt_ids=[ids], completion_ids=[[5]], rollout_logprobs=[[-1.0]],
                                              finish_reasons=["length"], group_size=1))
    shown = rendered_prompt(drawn, tok)
    assert tok.bos_token in shown and "What is 2 + 3?" in shown
    assert all(line.startswith("  | ") for line in shown.splitlines())
