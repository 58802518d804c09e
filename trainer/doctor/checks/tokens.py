"""Tokens: the same prompt ids on both sides, one BOS, the same stop ids, and completions that survive a round trip
through text.

- ``template``: the trainer renders the chat template to text and encodes it without special tokens
  (``trainer.data.datasets.encode_prompts``); an engine's chat path (vLLM's ``LLM.chat``, a server's chat route)
  renders it to ids in one call (``apply_chat_template(tokenize=True)``). Both must give the same ids.
- ``double BOS``: a prompt whose ids start with BOS twice (a template that writes BOS, encoded with special tokens).
- ``text path BOS``: the rendered prompt sent as text to a completions route (which adds special tokens) gains a
  second BOS: said as a warning, since parityrl sends ids, but a user's own text pipeline would drift.
- ``stop ids``: the engine stops on the ids the model's generation_config / config declare.
- ``retokenization``: sampled completions decoded and encoded again give other ids (a text-based multi-turn
  pipeline, or a reward computed on text and fed back, would train on tokens the engine never sampled).
"""
from __future__ import annotations

from rollout.model_files import eos_token_ids
from trainer.data.datasets import chat_messages, load_prompt_dataset
from trainer.doctor.context import NUM_PROMPTS, Doctor, EngineCannotStart
from trainer.doctor.records import PASS, WARN, Check, Finding, at_most, skipped

NAME = "tokens"


def _ids(encoded) -> list[int]:
    """``apply_chat_template(tokenize=True)``'s ids: a list in transformers 4, a BatchEncoding in 5."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _prompts(doc: Doctor) -> list[str]:
    d = doc.cfg.data
    data = load_prompt_dataset(d.source, split=d.split, prompt_column=d.prompt_column, answer_column=d.answer_column,
                               num_examples=d.num_examples, seed=doc.cfg.train.seed, builtin_kwargs=d.builtin_kwargs)
    return [data[i]["prompt"] for i in range(min(NUM_PROMPTS, len(data)))]


def _template(doc: Doctor) -> list[Finding]:
    tok, d = doc.tokenizer, doc.cfg.data
    if not d.use_chat_template:
        return [skipped(NAME, "template", "data.use_chat_template is false: prompts are encoded as plain text")]
    prompts, trainer_ids = _prompts(doc), doc.prompt_ids
    engine_ids = [_ids(tok.apply_chat_template(chat_messages(tok, p, d.system_prompt), add_generation_prompt=True,
                                               tokenize=True)) for p in prompts]
    differ = [i for i, (a, b) in enumerate(zip(trainer_ids, engine_ids)) if a != b]
    first = None
    if differ:
        a, b = trainer_ids[differ[0]], engine_ids[differ[0]]
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        first = {"prompt": differ[0], "position": at, "trainer": a[at:at + 4], "engine": b[at:at + 4]}
    out = [at_most(NAME, "template: prompts whose ids differ", len(differ) / len(prompts), 0.0,
                   "the chat template rendered to ids in one call differs from rendered-then-encoded: special tokens "
                   "written as text are split, or the template's output is stripped", details=first)]
    bos = tok.bos_token_id
    if bos is None:
        out.append(skipped(NAME, "double BOS", "the tokenizer has no BOS token"))
        return out
    doubled = sum(1 for ids in trainer_ids if ids[:2] == [bos, bos])
    out.append(at_most(NAME, "double BOS: prompts", doubled, 0, "the prompts start with BOS twice: the template writes "
                                                             "BOS and the encoding adds another"))
    texts = [tok.decode(ids) for ids in trainer_ids]
    text_path = sum(1 for t in texts if tok(t, add_special_tokens=True)["input_ids"][:2] == [bos, bos])
    out.append(Finding(NAME, "text path BOS: prompts", float(text_path), "0", PASS if text_path == 0 else WARN,
                       "" if text_path == 0 else "the rendered prompt sent as text with special tokens (an OpenAI "
                                                 "completions route) gains a second BOS; parityrl sends ids"))
    return out


def _engine_side(doc: Doctor) -> list[Finding]:
    try:
        engine = doc.engine
    except EngineCannotStart as e:
        return [skipped(NAME, "stop ids", f"the engine cannot load this model: {e}")]
    declared = sorted(set(eos_token_ids(doc.model_dir)))
    used = sorted(set(int(e) for e in getattr(engine, "eos_ids", [])))
    missing, extra = sorted(set(declared) - set(used)), sorted(set(used) - set(declared))
    out = [at_most(NAME, "stop ids: differences", float(len(missing) + len(extra)), 0.0,
                   f"the engine stops on {used}, the model declares {declared} (generation_config.json / config.json)",
                   details={"engine": used, "model": declared})]
    r = doc.batch()
    drift = 0
    for c in r.completion_ids:
        text = doc.tokenizer.decode(c)
        drift += doc.tokenizer(text, add_special_tokens=False)["input_ids"] != list(c)
    frac = drift / max(1, len(r.completion_ids))
    out.append(Finding(NAME, "retokenization: completions that change", frac, "0", PASS if drift == 0 else WARN,
                       "" if drift == 0 else "decoded and encoded again these completions give other ids; parityrl "
                                             "trains on the sampled ids, but a pipeline that goes through text does not"))
    return out


def run(doc: Doctor) -> list[Finding]:
    return _template(doc) + _engine_side(doc)


CHECK = Check(NAME, "do both sides see the same token ids?", run, needs_engine=False)
