"""The token record of a multi-turn episode: the ids between turns, and what a text pipeline would have had instead.

An episode is one stream of ids (docs: DESIGN.md, "Episodes: many turns, one token stream")::

    prompt ids | turn 1 sampled ids | observation ids | turn 2 sampled ids | observation ids | ...

The sampled ids are kept as the engine returned them; nothing already in the stream is ever decoded and
encoded again (BPE is not a bijection: TRL issue 5224). The only ids made from text are each observation's
(STYLE.md rule 11), by ``observation_ids``: the chat template's own rendering of what follows an assistant turn,
checked to extend what came before. ``retokenize_drift`` measures what a pipeline that rebuilds the history as
text (decode, re-render, encode) would have trained on instead.

Both render the template to text and encode the text with ``add_special_tokens=False``, as the prompts are
encoded (``trainer.data.datasets.encode_prompts``): ``apply_chat_template(tokenize=True)`` changed its return
type across transformers versions, and the template writes any BOS itself.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

__all__ = ["PLACEHOLDER", "TemplateNotAppendOnly", "observation_ids", "retokenize_drift"]

# Content of the assistant message that stands for the sampled turn when the template is rendered: text no
# template rewrites (no whitespace for a `| trim` to remove, no markup to parse) and no prompt contains, so its
# last occurrence in the rendering marks where the sampled content ended. It is never tokenized.
PLACEHOLDER = "PARITYRL_SAMPLED_TURN_8e1c0f"


class TemplateNotAppendOnly(ValueError):
    """Rendering the conversation with more messages changed the text of what came before (or a turn's end
    could not be located): the ids after an assistant turn are not defined by the template at that boundary."""


def observation_ids(
    tokenizer: Any,
    messages: Sequence[dict],
    new_messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    *,
    stop_id: int | None,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """The ids to append after a sampled assistant turn, up to and including the next generation prompt.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template (or pass ``chat_template``).
        messages: the conversation before the sampled turn: the prompt messages, then earlier assistant turns
            and observations (their text only matters to templates that look at history, e.g. for a default
            system prompt; the result is taken from the rendering after the sampled turn).
        new_messages: the environment's reply to append (roles "user", "tool", ...; may be empty).
        tools: JSON schemas offered to the model (``apply_chat_template(tools=...)``), the same at every turn.
        stop_id: the last id the engine sampled when it stopped on a stop token (EOS, ``<|im_end|>``, ...);
            None when the turn was cut by the token limit, so no end-of-turn token was sampled.
        chat_template: a template overriding the tokenizer's.
        template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}``).

    Returns:
        ``ids`` such that ``stream + ids`` is what the engine reads next, where ``stream`` ends with the sampled
        turn. ``ids`` = encode(rest of the turn's closing text + the new messages + the generation prompt), where
        the closing text is what the template writes after an assistant message's content (ChatML:
        ``"<|im_end|>\\n"``) and "rest" removes the stop token the engine sampled (ChatML: ``"\\n"``, the token
        verl issue 6501 lost). A turn cut by length gets its whole closing text, so the next turn starts after a
        closed turn as the template would have it; whether a truncated turn ends the episode instead is the
        loop's choice (the issue ends an episode over its token budget), this function is defined for both.

    How: render ``messages + [assistant: PLACEHOLDER]`` (A) and ``messages + [assistant: PLACEHOLDER] +
    new_messages`` with the generation prompt (B); B must extend A as text (else ``TemplateNotAppendOnly``);
    the closing text is A after the placeholder, the delta is B after A. The placeholder, not the sampled text,
    stands for the turn, so the delta never depends on how the turn's text would re-tokenize.

    Non-append-only templates (Qwen3 drops the ``<think>`` of assistant turns before the last user message, so a
    user observation rewrites earlier turns): the stream keeps what the engine read, and this function raises
    rather than guess a delta from a rendering that rewrote the past. Tool observations under such templates
    are append-only and work.

    Raises:
        TemplateNotAppendOnly: B does not extend A, the placeholder is not in A, or the sampled stop token is
            not where the template's closing text starts (e.g. the engine stopped on ``<|end_of_text|>`` but the
            template closes a turn with ``<|eot_id|>``); the message names the tokenizer and shows both texts.
    """
    base = [dict(m) for m in messages] + [{"role": "assistant", "content": PLACEHOLDER}]
    first = _render(tokenizer, base, tools, False, chat_template, template_kwargs)
    second = _render(tokenizer, base + [dict(m) for m in new_messages], tools, True, chat_template, template_kwargs)
    where = _name(tokenizer, chat_template)
    end = first.rfind(PLACEHOLDER)
    if end < 0:
        raise TemplateNotAppendOnly(
            f"{where}: the rendered assistant message does not contain its content verbatim, so the end of the "
            f"sampled turn cannot be located; rendering ends {first[-200:]!r}"
        )
    closing = first[end + len(PLACEHOLDER):]
    if not second.startswith(first):
        at = _first_difference(first, second)
        raise TemplateNotAppendOnly(
            f"{where} is not append-only at this turn boundary: adding {_roles(new_messages)} changed the text "
            f"rendered before them at character {at}: before {first[max(0, at - 60):at + 60]!r}, after "
            f"{second[max(0, at - 60):at + 60]!r}. The episode's ids keep what the engine read; the reply's ids "
            "cannot be taken from a rendering that rewrites earlier turns"
        )
    if stop_id is not None:
        stop_text = tokenizer.decode([int(stop_id)], skip_special_tokens=False)
        if not stop_text or not closing.startswith(stop_text):
            raise TemplateNotAppendOnly(
                f"{where}: the turn stopped on token {int(stop_id)} ({stop_text!r}) but the template closes an "
                f"assistant turn with {closing!r}; the stop token must be where the closing text starts (set the "
                "engine's stop tokens to the template's end-of-turn token)"
            )
        closing = closing[len(stop_text):]
    return list(tokenizer(closing + second[len(first):], add_special_tokens=False)["input_ids"])


def retokenize_drift(
    tokenizer: Any,
    messages: Sequence[dict],
    full_ids: Sequence[int],
    sampled_mask: Sequence[bool | int],
    tools: Sequence[dict] | None = None,
    *,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> tuple[bool, int]:
    """Whether a text pipeline would have trained on other ids than ``full_ids``, and on how many sampled tokens.

    The text pipeline (TRL's first tool loop, issue 5224; rllm PR 272): take each turn's text as the engine
    reports it (its ids decoded without special tokens), put it in the conversation as an assistant message,
    render the whole conversation with the chat template and encode the text. That is a lower bound on such a
    pipeline's drift: one that also re-serialises parsed tool calls moves further. Definitions
    (``parity/retokenize_drift_episodes``, ``_tokens`` in DESIGN.md):

    * ``differs``: ``full_ids`` up to its last sampled id is not a prefix of the re-encoded ids (what follows
      the last sampled id conditions nothing that is trained, e.g. ChatML's ``"\\n"`` after the final
      ``<|im_end|>``). Context counts: a dropped ``"\\n"`` at a tool boundary (verl issue 6501) differs even
      when every sampled id survives.
    * ``n_tokens``: sampled positions of ``full_ids`` that the re-encoded ids do not reproduce: positions outside
      the matching blocks of ``difflib.SequenceMatcher(full_ids[:last sampled + 1], reencoded, autojunk=False)``,
      an alignment, so one split token costs the positions around it and not everything after it.

    Args:
        messages: the episode's conversation in order: prompt messages, assistant turns, observations. The k-th
            assistant message stands for the k-th run of sampled positions; its content is ignored and replaced
            by the decoded run (that is the point: what text would have said).
        full_ids: the episode's ids as trained: prompt, each turn as sampled, each observation as given.
        sampled_mask: same length; true where the engine sampled the id.
        tools, chat_template, template_kwargs: as the episode was rendered (see ``observation_ids``).

    Returns:
        ``(differs, n_tokens)``; ``(False, 0)`` for an episode with no sampled ids.

    Raises:
        ValueError: lengths differ, or the number of assistant messages is not the number of sampled runs.
    """
    ids = [int(i) for i in full_ids]
    mask = [bool(m) for m in sampled_mask]
    if len(ids) != len(mask):
        raise ValueError(f"full_ids has {len(ids)} ids but sampled_mask has {len(mask)}")
    runs = _runs(mask)
    assistant_at = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if len(assistant_at) != len(runs):
        raise ValueError(
            f"messages has {len(assistant_at)} assistant messages but sampled_mask has {len(runs)} runs of sampled "
            "ids; each assistant turn must be one run"
        )
    if not runs:
        return False, 0
    conversation = [dict(m) for m in messages]
    for at, (start, stop) in zip(assistant_at, runs):
        conversation[at] = {"role": "assistant",
                            "content": tokenizer.decode(ids[start:stop], skip_special_tokens=True)}
    # A conversation that ends with an observation ends, in the stream, with the next generation prompt.
    generation_prompt = conversation[-1].get("role") != "assistant"
    text = _render(tokenizer, conversation, tools, generation_prompt, chat_template, template_kwargs)
    # verbose=False: a whole episode may be longer than the tokenizer's model_max_length, which is no error here
    reencoded = list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    upto = runs[-1][1]
    trained = ids[:upto]
    matched = [False] * upto
    matcher = difflib.SequenceMatcher(None, trained, reencoded, autojunk=False)
    for block in matcher.get_matching_blocks():
        matched[block.a:block.a + block.size] = [True] * block.size
    n_tokens = sum(1 for i in range(upto) if mask[i] and not matched[i])
    return reencoded[:upto] != trained, n_tokens


def _render(tokenizer: Any, messages: list[dict], tools, generation_prompt: bool, chat_template, template_kwargs
            ) -> str:
    text = tokenizer.apply_chat_template(
        messages, tools=list(tools) if tools else None, tokenize=False, add_generation_prompt=generation_prompt,
        chat_template=chat_template, **(template_kwargs or {}),
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    """``[start, stop)`` of each maximal run of true values."""
    runs, start = [], None
    for i, m in enumerate(mask + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _roles(new_messages: Sequence[dict]) -> str:
    roles = [str(m.get("role")) for m in new_messages]
    return f"messages with roles {roles}" if roles else "the generation prompt"


def _name(tokenizer: Any, chat_template: str | None) -> str:
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    which = "the chat template passed as chat_template" if chat_template is not None else "its chat template"
    return f"tokenizer {name!r}, {which}"
