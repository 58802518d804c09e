"""Assistant turns parsed into messages: Hermes blocks, parse errors recorded, the tokenizer's parser when it has one."""
from __future__ import annotations

import pytest

from trainer.environments.tool_calls import parse_assistant, parse_hermes


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_text_without_a_tool_call_is_the_content():
    assert parse_assistant("  The answer is 5. ") == {
        "role": "assistant", "content": "The answer is 5.", "tool_calls": [], "tool_call_errors": []}


def test_several_hermes_blocks_in_one_turn():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
            '\n<tool_call>{"name": "calculate", "arguments": "{\\"expression\\": \\"4 * 5\\"}"}</tool_call>')
    message = parse_assistant(text)
    assert message["content"] == "Let me compute."
    assert message["tool_calls"] == [call("calculate", expression="2 + 3"), call("calculate", expression="4 * 5")]
    assert message["tool_call_errors"] == []


def test_openai_shaped_and_argumentless_calls_are_taken():
    text = ('<tool_call>{"type": "function", "function": {"name": "now", "arguments": {}}}</tool_call>'
            '<tool_call>{"name": "now"}</tool_call>')
    assert parse_hermes(text)["tool_calls"] == [call("now"), call("now")]


@pytest.mark.parametrize("block, reason", [
    ('<tool_call>{"name": "calculate", "arguments": {"expression": </tool_call>', "is not valid JSON"),
    ("<tool_call>[1, 2]</tool_call>", "is a JSON list; expected an object with 'name' and 'arguments'"),
    ('<tool_call>{"arguments": {}}</tool_call>', "'name' is None"),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "'arguments' is list; expected a JSON object"),
    ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>', "'arguments' is a string that is not a JSON object"),
    ('<tool_call>{"name": "f", "arguments": {}', "<tool_call> is not closed by </tool_call>"),
])
def test_a_block_that_does_not_parse_is_recorded_not_raised(block, reason):
    good = '<tool_call>{"name": "g", "arguments": {"x": 1}}</tool_call>'
    message = parse_assistant(f"Try: {good} and {block}")
    assert message["tool_calls"] == [call("g", x=1)]  # the good block still counts
    assert len(message["tool_call_errors"]) == 1 and reason in message["tool_call_errors"][0]
    assert "<tool_call>" in message["tool_call_errors"][0]  # the raw text, for the model to see
    assert message["content"].startswith("Try:") and "<tool_call>" not in message["content"]


# Qwen2.5's format as a transformers 5 response_template (the one `transformers serve` falls back on for qwen2).
QWEN_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "thinking": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)", "content": "text"},
    },
}


class WithResponseTemplate:
    """A tokenizer stand-in with transformers 5's parser (the real method, bound to this object)."""

    response_template = QWEN_RESPONSE_TEMPLATE

    def parse_response(self, text, *, prefix, tools=None):
        from transformers.utils.chat_parsing import parse_response

        return parse_response(text, self.response_template, prefix=prefix, tools=tools)


def test_the_tokenizers_response_template_is_used_when_it_has_one():
    text = ('<think>add them</think>Sure.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}'
            '\n</tool_call><|im_end|>')
    message = parse_assistant(text, WithResponseTemplate(), prefix="<|im_start|>assistant\n")
    assert message["thinking"] == "add them"  # only the template parser knows this field
    assert message["content"] == "Sure."
    assert message["tool_calls"] == [call("calculate", expression="2+3")]
    assert message["tool_call_errors"] == []


def test_a_broken_call_under_the_response_template_falls_back_to_hermes_per_block():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": </tool_call><|im_end|>')
    message = parse_assistant(text, WithResponseTemplate())
    assert message["tool_calls"] == [call("a")]
    assert len(message["tool_call_errors"]) == 1 and "is not valid JSON" in message["tool_call_errors"][0]


def test_a_tokenizer_without_a_response_template_gets_hermes():
    class Plain:
        response_template = None

        def parse_response(self, *a, **k):
            raise AssertionError("not called without a response_template")

    assert parse_assistant('<tool_call>{"name": "a"}</tool_call>', Plain())["tool_calls"] == [call("a")]


def test_text_must_be_text():
    with pytest.raises(TypeError, match="expected the assistant turn's decoded text"):
        parse_assistant([1, 2, 3])
