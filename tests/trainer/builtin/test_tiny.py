"""Tests for trainer/builtin/tiny.py: the deterministic tiny Llama + byte-level BPE tokenizer."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.builtin import tiny
from trainer.data.tasks.arithmetic import arithmetic_dataset, sft_text

QUESTION = "Tom has 3 apples and buys 5 more. How many apples does Tom have?"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny.build_tiny_base(tmp_path_factory.mktemp("tiny") / "base")


@pytest.fixture(scope="module")
def tok(base):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base)


def test_two_builds_are_identical(base, tmp_path):
    other = tiny.build_tiny_base(tmp_path / "again")
    assert (base / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
    a, b = load_file(base / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == torch.bfloat16, name
        assert torch.equal(a[name], b[name]), name


def test_seed_changes_weights_not_tokenizer(base, tmp_path):
    other = tiny.build_tiny_base(tmp_path / "seed1", seed=1)
    assert (base / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
    a, b = load_file(base / "model.safetensors"), load_file(other / "model.safetensors")
    key = "model.embed_tokens.weight"
    assert not torch.equal(a[key], b[key])


def test_build_does_not_touch_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny.build_tiny_base(tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)


def test_chat_template_generation_prompt(tok):
    enc = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    # Hand-written: bos, role tag, question as BPE'd by the ByteLevel pre-tokenizer
    # (leading space "Ġ" glued to each word), EOS closing the turn, then the assistant tag.
    expected = (
        ["<|bos|>", "<|user|>", "Tom", "Ġhas", "Ġ3", "Ġapples", "Ġand", "Ġbuys", "Ġ5", "Ġmore", ".",
         "ĠHow", "Ġmany", "Ġapples", "Ġdoes", "ĠTom", "Ġhave", "?", "<|end|>", "<|assistant|>"]
    )  # fmt: skip
    assert tok.convert_ids_to_tokens(enc["input_ids"]) == expected
    assert enc["input_ids"][:5] == [1, 3, tok.convert_tokens_to_ids("Tom"), tok.convert_tokens_to_ids("Ġhas"),
                                    tok.convert_tokens_to_ids("Ġ3")]  # fmt: skip
    assert enc["input_ids"][-2:] == [2, 4]  # <|end|> = id 2, <|assistant|> = id 4


def test_assistant_turn_ends_with_eos_and_is_masked(tok):
    completion = sft_text(QUESTION, "8")
    assert completion == "3 + 5 = 8. The answer is 8."
    prompt_ids = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    full = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": completion}],
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids, mask = full["input_ids"], full["assistant_masks"]
    # The conversation is the generation prompt followed by the completion and EOS.
    assert ids[: len(prompt_ids)] == prompt_ids
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids[len(prompt_ids) : -1]) == completion
    assert mask == [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))
    assert tok.convert_ids_to_tokens(ids[len(prompt_ids) :]) == [
        "3", "Ġ+", "Ġ5", "Ġ=", "Ġ8", ".", "ĠThe", "Ġanswer", "Ġis", "Ġ8", ".", "<|end|>"
    ]  # fmt: skip


def test_unknown_role_is_refused(tok):
    with pytest.raises(Exception, match="unsupported chat role: critic; expected system, user, assistant or tool"):
        tok.apply_chat_template([{"role": "critic", "content": "x"}], tokenize=False)


def test_renderings_without_tools_are_unchanged(tok):
    # Pinned text: the single-turn demo's numbers (and builtin:tiny's warm start) depend on it.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "The answer is 8."}, {"role": "user", "content": "Sure?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|bos|><|system|>Be brief.<|end|><|user|>" + QUESTION + "<|end|><|assistant|>The answer is 8."
                    "<|end|><|user|>Sure?<|end|><|assistant|>")
    assert tok.apply_chat_template(messages[1:2], tokenize=False, tools=[]) == "<|bos|><|user|>" + QUESTION + "<|end|>"


TOOLS = [{"type": "function", "function": {"name": "calculate", "parameters": {"type": "object", "properties": {}}}},
         {"type": "function", "function": {"name": "lookup"}}]
CALL = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "7 - 2"}}}
EPISODE = [{"role": "user", "content": "Tom has 7 apples and eats 2."},
           {"role": "assistant", "content": "", "tool_calls": [CALL]},
           {"role": "tool", "content": "5"},
           {"role": "assistant", "content": "The answer is 5."}]


def test_tools_tool_calls_and_tool_messages(tok):
    from trainer.environments.tool_calls import parse_hermes

    text = tok.apply_chat_template(EPISODE, tools=TOOLS, tokenize=False)
    block = '<tool_call>{"name": "calculate", "arguments": {"expression": "7 - 2"}}</tool_call>'
    assert block == "<tool_call>" + json.dumps({"name": "calculate", "arguments": {"expression": "7 - 2"}}) + "</tool_call>"
    assert text == ("<|bos|><|system|>tools: calculate, lookup<|end|><|user|>Tom has 7 apples and eats 2.<|end|>"
                    "<|assistant|>" + block + "<|end|><|user|>tool: 5<|end|><|assistant|>The answer is 5.<|end|>")
    # what the model writes parses back into the message it came from
    assert parse_hermes(block)["tool_calls"] == [CALL]
    two = {"role": "assistant", "content": "Let me see.", "tool_calls": [CALL, CALL]}
    assert tok.apply_chat_template([EPISODE[0], two], tokenize=False).endswith(
        "<|assistant|>Let me see." + block + block + "<|end|>")


def test_tool_episode_is_append_only_and_masks_the_assistant(tok):
    def render(n, generation_prompt=False):
        return tok.apply_chat_template(EPISODE[:n], tools=TOOLS, tokenize=False,
                                       add_generation_prompt=generation_prompt)

    for n in range(1, len(EPISODE)):
        assert render(n + 1).startswith(render(n)), n
        if EPISODE[n]["role"] == "assistant":  # the generation prompt is where the assistant's turn starts
            assert render(n + 1).startswith(render(n, True)), n
    enc = tok.apply_chat_template(EPISODE, tools=TOOLS, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    marked = "".join(tok.decode([i], skip_special_tokens=False) for i, m in zip(ids, mask) if m)
    block = '<tool_call>{"name": "calculate", "arguments": {"expression": "7 - 2"}}</tool_call>'
    assert marked == block + "<|end|>" + "The answer is 5.<|end|>"


def test_observation_ids_of_a_tool_reply(tok):
    from trainer.sampling.turn_tokens import observation_ids

    ids = observation_ids(tok, EPISODE[:1], [{"role": "tool", "content": "5"}], TOOLS, stop_id=tok.eos_token_id)
    assert ids == tok("<|user|>tool: 5<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[0] == "<|user|>" and ids[-1] == 4


def test_round_trip_task_text_and_arbitrary_bytes(tok):
    ds = arithmetic_dataset(50, split="test")
    texts = list(ds["prompt"]) + [sft_text(p, a) for p, a in zip(ds["prompt"], ds["answer"])]
    texts += ["héllo wörld ✓  two  spaces\nnewline\ttab", "12345 + 67890 = -1"]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    # Plain encode adds no special tokens: the chat template owns <|bos|>.
    assert tok("Tom")["input_ids"] == [tok.convert_tokens_to_ids("Tom")]


def test_completions_are_short(tok):
    ds = arithmetic_dataset(200, split="train")
    completions = [sft_text(p, a) for p, a in zip(ds["prompt"], ds["answer"])]
    lengths = [len(tok(c, add_special_tokens=False)["input_ids"]) for c in completions]
    assert max(lengths) + 1 <= 16  # + EOS; fits the 16-24 token generation budget


def test_special_tokens_and_vocab(tok):
    assert len(tok) == 512  # tokenizer fills the model's vocabulary exactly
    assert tok.convert_ids_to_tokens(list(range(6))) == list(tiny.SPECIAL_TOKENS)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


def test_model_loads_with_expected_config(base, tok):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(base)
    c = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (512, 128, 384)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 4, 2, 32)
    assert c.max_position_embeddings == 256 and c.tie_word_embeddings is False
    assert model.dtype == torch.bfloat16
    assert json.loads((base / "config.json").read_text())["dtype"] == "bfloat16"
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    gen = GenerationConfig.from_pretrained(base)
    assert gen.eos_token_id == tok.eos_token_id and gen.pad_token_id == tok.pad_token_id
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    # 512*128 (embed) + 512*128 (lm_head) + 128 (final norm)
    # + 4 layers * (q 128*128 + k 128*64 + v 128*64 + o 128*128 + mlp 3*128*384 + 2 norms * 128) = 918656
    assert sum(p.numel() for p in model.parameters()) == 918656
    # Random init: the next-token distribution is near uniform, ln(512) ~= 6.24 nats.
    ids = torch.tensor([[1, 3, 10, 20]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    assert torch.all(entropy > 6.0) and torch.all(entropy <= 6.2384)


def test_tiny_base_dir_is_keyed_by_params(tmp_path, monkeypatch):
    monkeypatch.setenv("PARITYRL_CACHE", str(tmp_path / "cache"))
    assert tiny.default_cache_dir() == tmp_path / "cache"
    d = tiny.tiny_base_dir()
    assert d.parent == tmp_path / "cache" and d.name.startswith("tiny-llama-")
    assert tiny.tiny_base_dir(seed=0, vocab_size=512) == d  # defaults filled in
    assert tiny.tiny_base_dir(seed=1) != d
    assert tiny.tiny_base_dir(tmp_path / "other").parent == tmp_path / "other"
    with pytest.raises(TypeError, match="unknown tiny-base parameter"):
        tiny.tiny_base_dir(hidden=3)


def test_default_cache_dir_without_env(monkeypatch, tmp_path):
    monkeypatch.delenv("PARITYRL_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tiny.default_cache_dir() == tmp_path / ".cache" / "parityrl"


def test_ensure_builds_once(tmp_path, monkeypatch):
    calls = []
    real = tiny.build_tiny_base

    def counting(out_dir, **kw):
        calls.append(out_dir)
        return real(out_dir, **kw)

    monkeypatch.setattr(tiny, "build_tiny_base", counting)
    first = tiny.ensure_tiny_base(tmp_path)
    second = tiny.ensure_tiny_base(tmp_path)
    assert first == second == tiny.tiny_base_dir(tmp_path)
    assert len(calls) == 1
    marker = json.loads((first / "parityrl_build.json").read_text())
    assert marker["build_version"] == tiny.BUILD_VERSION and marker["params"]["vocab_size"] == 512
    # No temp directories left behind next to the result.
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [first.name]


def test_ensure_two_threads_race_build_once(tmp_path, monkeypatch):
    # flock excludes separate open() calls even within one process, so threads
    # exercise the same lock as processes do, at a fraction of the start-up cost.
    calls = []
    real = tiny.build_tiny_base

    def counting(out_dir, **kw):
        calls.append(out_dir)
        return real(out_dir, **kw)

    monkeypatch.setattr(tiny, "build_tiny_base", counting)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: tiny.ensure_tiny_base(tmp_path), range(2)))
    assert results == [tiny.tiny_base_dir(tmp_path)] * 2
    assert len(calls) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [results[0].name]


@pytest.mark.slow
def test_ensure_two_processes_race(tmp_path):
    # Separate interpreters (not fork: forking after tokenizers/torch started
    # their thread pools can deadlock the child).
    code = "import sys; from trainer.builtin.tiny import ensure_tiny_base; print(ensure_tiny_base(sys.argv[1]))"
    root = Path(tiny.__file__).resolve().parents[2]
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=root, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0].strip().splitlines()[-1] for p in procs]  # last line: libraries may print
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == [str(tiny.tiny_base_dir(tmp_path))] * 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [tiny.tiny_base_dir(tmp_path).name]


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def boom(params, tokenizer):
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(tiny, "_build_model", boom)
    with pytest.raises(RuntimeError, match="killed mid-build"):
        tiny.build_tiny_base(tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_ensure_refuses_untrusted_directory(tmp_path):
    tiny.tiny_base_dir(tmp_path).mkdir(parents=True)
    with pytest.raises(RuntimeError, match="has no parityrl_build.json"):
        tiny.ensure_tiny_base(tmp_path)


def test_build_refuses_existing_out_dir(tmp_path):
    with pytest.raises(FileExistsError, match="already exists"):
        tiny.build_tiny_base(tmp_path)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"hidden_size": 130}, "hidden_size=130 must be divisible by num_heads=4"),
        ({"hidden_size": 64, "num_heads": 4}, "head_dim = hidden_size/num_heads = 16"),
        ({"num_kv_heads": 3}, "num_heads=4 must be divisible by num_kv_heads=3"),
        ({"vocab_size": 100}, "vocab_size=100 is too small"),
        ({"vocab_size": 100_000}, "vocab_size=100000 is larger than the tokenizer corpus supports"),
        ({"num_layers": 0}, "num_layers=0 must be an int >= 1"),
        ({"seed": -1}, "seed=-1 must be an int >= 0"),
    ],
)
def test_bad_params(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny.build_tiny_base(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()


_VLLM_CHECK = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=256, seed=0, enforce_eager=True,
          kv_cache_memory_bytes=256 * 1024 * 1024)
out = llm.generate([TokensPrompt(prompt_token_ids=json.loads(sys.argv[2]))],
                   SamplingParams(max_tokens=8, logprobs=0, seed=0))
s = out[0].outputs[0]
print(json.dumps({"ids": list(s.token_ids), "lps": [next(iter(d.values())).logprob for d in s.logprobs]}))
"""


@pytest.mark.slow
def test_loads_and_generates_in_vllm(base, tok):
    # In a subprocess: a second vLLM engine in the test process would tear down the
    # distributed state of the session's shared engine when it is destroyed.
    import json
    import os
    import subprocess
    import sys

    ids = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([sys.executable, "-c", _VLLM_CHECK, str(base), json.dumps(list(ids))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sample = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 1 <= len(sample["ids"]) <= 8
    assert all(0 <= t < 512 for t in sample["ids"])
    # Near-uniform random init: each sampled token's log-prob is close to -ln(512) = -6.24.
    assert all(-8.0 < lp < -4.5 for lp in sample["lps"])
