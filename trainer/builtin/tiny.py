"""The embedded default model: a tiny random-init Llama and its byte-level BPE tokenizer.

parityrl's demo and tests must run offline, so the default model is built by
this module, deterministically, instead of downloaded. ``ensure_tiny_base()``
builds it once into a cache directory named by a hash of the build parameters
and returns the path; the SFT warm start (``trainer.builtin.warm_start``) then teaches it the
arithmetic task's completion format (``trainer.data.tasks.arithmetic``).

Default sizes (~0.92M parameters)::

    vocab_size=512  hidden_size=128  intermediate_size=384  num_layers=4
    num_heads=4  num_kv_heads=2 (GQA)  head_dim=32  max_position_embeddings=256

Why these: head_dim 32 is one of vLLM's CPU attention head sizes
(``CPUAttentionBackend.get_supported_head_sizes`` in
``vllm/v1/attention/backends/cpu_attn.py``); every weight dimension is a
multiple of 128 except the K/V projections (64 rows), so FP8 128x128 weight
blocks tile the big matrices exactly; GQA (2 KV heads) keeps the standard
Llama code paths of both engines exercised. Weights are saved in bfloat16
(``dtype`` in config.json), ``tie_word_embeddings=False`` so the lm_head is a
separate matrix like in most RL targets.

Tokenizer: byte-level BPE (``tokenizers``, GPT-2 style ByteLevel pre-tokenizer
and decoder, so every string round-trips) trained on the arithmetic task's
prompts and target completions plus the integers 0..999, which together have
more than enough merges to fill the vocabulary exactly
(``len(tokenizer) == vocab_size``: the model has no untokenizable rows).

Special tokens (ids fixed, first in the vocabulary)::

    0 <|pad|>   1 <|bos|>   2 <|end|> (= EOS)   3 <|user|>   4 <|assistant|>   5 <|system|>

Chat format (``CHAT_TEMPLATE``), no newlines, every turn closed by EOS::

    <|bos|><|user|>{question}<|end|><|assistant|>{answer}<|end|>

so the generation prompt ends with ``<|assistant|>`` and a finished assistant
turn ends with the EOS token, where generation stops. The assistant content is
wrapped in ``{% generation %}`` so ``apply_chat_template(...,
return_assistant_tokens_mask=True, return_dict=True)`` marks the tokens an SFT
loss should train on.

Tools (``apply_chat_template(tools=[JSON schemas])``), for the multi-turn tool
task (``trainer.data.tasks.arithmetic_tools``); the template stays append-only::

    <|bos|><|system|>tools: calculate<|end|><|user|>{question}<|end|>
    <|assistant|><tool_call>{"name": "calculate", "arguments": {"expression": "7 - 2 + 5"}}</tool_call><|end|>
    <|user|>tool: 10<|end|><|assistant|>The answer is 10.<|end|>

Only the tool names are listed, not their schemas: the model has 256
positions. A tool call is a Hermes block, exactly ``json.dumps({"name": ...,
"arguments": ...})``, so ``trainer.environments.tool_calls.parse_hermes`` reads
back what the model writes; it is inside the ``{% generation %}`` block. A tool
result is a user turn marked ``tool: `` (the vocabulary has no room for a tool
role token). The tokenizer adds no special tokens on plain ``encode``
(the template writes ``<|bos|>`` itself).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path

from trainer.data.tasks.arithmetic import arithmetic_dataset, sft_text

__all__ = [
    "BUILD_VERSION",
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_tiny_base",
    "default_cache_dir",
    "ensure_tiny_base",
    "tiny_base_dir",
]

# Bump whenever the build's output changes for the same parameters (corpus,
# template, init, file layout): cached builds are keyed by it.
BUILD_VERSION = 2

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, "<|user|>", "<|assistant|>", "<|system|>")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    # Tool names only, not their JSON schemas: the model has 256 positions.
    "{% if tools %}{{ '<|system|>tools: ' }}"
    "{% for tool in tools %}{{ tool['function']['name'] if tool['function'] is defined else tool['name'] }}"
    "{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{{ eos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unsupported chat role: ' + message['role'] + \"; expected system, user, assistant or tool\") }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>' }}{% generation %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    # What json.dumps({"name": ..., "arguments": ...}) writes, so parse_hermes reads it back.
    "{% if fn['arguments'] is string %}"
    "{{ '<tool_call>{\"name\": ' + fn['name'] | tojson + ', \"arguments\": ' + fn['arguments'] + '}</tool_call>' }}"
    "{% else %}"
    "{{ '<tool_call>' + {'name': fn['name'], 'arguments': fn['arguments']} | tojson + '</tool_call>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{{ eos_token }}{% endgeneration %}"
    "{% elif message['role'] == 'tool' %}"
    # No <|tool|> token: the vocabulary is full, so a tool reply is a user turn with a marker.
    "{{ '<|user|>tool: ' + message['content'] + eos_token }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# vLLM CPU attention head sizes (vllm/v1/attention/backends/cpu_attn.py, vLLM 0.32).
_VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_MARKER = "parityrl_build.json"
_NUMBERS_MAX = 999  # integers 0.._NUMBERS_MAX join the tokenizer corpus


def build_tiny_base(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_position_embeddings: int = 256,
) -> Path:
    """Build the tiny Llama + tokenizer into ``out_dir`` (which must not exist yet) and return it.

    The directory holds ``config.json``, ``generation_config.json``,
    ``model.safetensors`` (bfloat16), the tokenizer files and
    ``parityrl_build.json`` (the build parameters). Same arguments -> identical
    ``tokenizer.json`` and identical weights. Atomic: files are written to a
    temporary sibling directory that is renamed onto ``out_dir`` at the end.
    """
    params = _validated_params(
        seed=seed,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
    )
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists():
        raise FileExistsError(f"out_dir={str(out_dir)!r} already exists; build_tiny_base writes a new directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tokenizer = build_tokenizer(vocab_size, max_position_embeddings)
        tokenizer.save_pretrained(tmp)
        model = _build_model(params, tokenizer)
        model.save_pretrained(tmp)
        marker = {"build_version": BUILD_VERSION, "params": params}
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, out_dir)  # raises if out_dir appeared meanwhile (non-empty dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def default_cache_dir() -> Path:
    """``$PARITYRL_CACHE`` if set, else ``~/.cache/parityrl``."""
    env = os.environ.get("PARITYRL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "parityrl"


def tiny_base_dir(cache_dir: str | Path | None = None, **params: int) -> Path:
    """Cache path of the tiny base for ``params`` (keyword arguments of ``build_tiny_base``).

    Named ``tiny-llama-<12 hex>`` from SHA-256 of the full parameter set
    (defaults filled in, so ``tiny_base_dir()`` == ``tiny_base_dir(seed=0)``)
    and ``BUILD_VERSION``. Does not build anything.
    """
    full = _full_params(params)
    key = json.dumps({"build_version": BUILD_VERSION, "params": full}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / f"tiny-llama-{digest}"


def ensure_tiny_base(cache_dir: str | Path | None = None, **params: int) -> Path:
    """Return ``tiny_base_dir(cache_dir, **params)``, building it first if it is not there.

    Idempotent and safe when several processes race: builders serialise on a
    lock file next to the directory, and the atomic rename means a reader
    never sees a half-built model.
    """
    target = tiny_base_dir(cache_dir, **params)

    def build() -> None:
        if target.exists():  # left by something other than build_tiny_base: not trusted
            raise RuntimeError(
                f"{str(target)!r} exists but has no {_MARKER}; delete it so it can be rebuilt"
            )
        try:
            build_tiny_base(target, **_full_params(params))
        except OSError:
            # Without flock (non-POSIX) a concurrent builder may have won the rename.
            if not (target / _MARKER).is_file():
                raise

    return build_once(target, _MARKER, build)


def build_once(target: Path, marker: str, build) -> Path:
    """``target``, after calling ``build()`` under a lock file next to it unless ``target/marker`` exists.

    Checked again under the lock: a process that waited finds the other's finished build.
    """
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f"{target.name}.lock"):
        if not (target / marker).is_file():
            build()
    return target


# ---------------------------------------------------------------- internals


def _full_params(params: dict) -> dict:
    """Bind ``params`` to build_tiny_base's keyword arguments, filling defaults."""
    sig = inspect.signature(build_tiny_base)
    names = [n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(params) - set(names))
    if unknown:
        raise TypeError(f"unknown tiny-base parameter(s) {unknown}; expected some of {names}")
    return {n: params.get(n, sig.parameters[n].default) for n in names}


def _validated_params(**p: int) -> dict:
    for name, value in p.items():
        lowest = 0 if name == "seed" else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
            raise ValueError(f"{name}={value!r} must be an int >= {lowest}")
    if p["vocab_size"] < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={p['vocab_size']} is too small; expected >= {256 + len(SPECIAL_TOKENS)}"
            " (256 byte tokens + special tokens)"
        )
    if p["hidden_size"] % p["num_heads"]:
        raise ValueError(f"hidden_size={p['hidden_size']} must be divisible by num_heads={p['num_heads']}")
    head_dim = p["hidden_size"] // p["num_heads"]
    if head_dim not in _VLLM_CPU_HEAD_SIZES:
        raise ValueError(
            f"head_dim = hidden_size/num_heads = {head_dim} is not a vLLM CPU attention head size;"
            f" expected one of {_VLLM_CPU_HEAD_SIZES}"
        )
    if p["num_heads"] % p["num_kv_heads"]:
        raise ValueError(f"num_heads={p['num_heads']} must be divisible by num_kv_heads={p['num_kv_heads']}")
    return dict(p)


def _tokenizer_corpus() -> list[str]:
    """Deterministic training text: every arithmetic core of both splits (several surface forms) + integers."""
    corpus = []
    for split, n in (("train", 4000), ("test", 1000)):  # ~7 passes over each split's cores
        ds = arithmetic_dataset(n, seed=0, split=split)
        for prompt, answer in zip(ds["prompt"], ds["answer"]):
            corpus += [prompt, sft_text(prompt, answer)]
    corpus += [f"{i} = {i}" for i in range(_NUMBERS_MAX + 1)]  # "12" and " 12" forms
    return corpus


def build_tokenizer(vocab_size: int, model_max_length: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    bpe.train_from_iterator(_tokenizer_corpus(), trainer)
    if bpe.get_vocab_size() != vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is larger than the tokenizer corpus supports"
            f" ({bpe.get_vocab_size()} tokens); choose vocab_size <= {bpe.get_vocab_size()}"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,  # exact round-trip of decoded text
    )


def _build_model(params: dict, tokenizer):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = LlamaConfig(
        vocab_size=params["vocab_size"],
        hidden_size=params["hidden_size"],
        intermediate_size=params["intermediate_size"],
        num_hidden_layers=params["num_layers"],
        num_attention_heads=params["num_heads"],
        num_key_value_heads=params["num_kv_heads"],
        head_dim=params["hidden_size"] // params["num_heads"],
        max_position_embeddings=params["max_position_embeddings"],
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        **ids,
    )
    # fork_rng: seeding must not disturb the caller's global torch RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params["seed"])
        model = LlamaForCausalLM(config)  # float32 init (std=initializer_range), then cast
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(**ids)
    return model


@contextlib.contextmanager
def file_lock(path: Path):
    """Exclusive advisory lock (fcntl.flock); a no-op where fcntl does not exist."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
