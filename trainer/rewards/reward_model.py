"""A reward model: r(prompt, completion), and a trained one as an RL reward source (``RewardModelScorer``).

**Model.** A Hugging Face ``*ForSequenceClassification`` with ``num_labels=1`` (what
`parityrl train-rm` writes, trainer.supervised.reward_model): a causal-LM backbone and a linear
``score`` head (hidden -> 1, no bias) in place of the lm_head.

**Reward of a sequence.** ``r(x, y) = w . h_T``, the score head applied to the last
hidden state of the LAST REAL token T of ``prompt + completion + EOS``. T is found
from the attention mask (the rightmost position with mask 1), so left and right
padding give the same T, and position ids restart at 0 on the first real token, so
left padding does not shift RoPE positions either (tested). HF's own
``*ForSequenceClassification.forward`` finds T as the rightmost token that is not
``config.pad_token_id``: identical for right padding when pad != EOS, which the
saved model's config records (``pad_token_id``), so the output directory also
works with plain ``transformers``. Pooling by the mask instead of the pad id keeps
it right for tokenizers whose pad token is their EOS.

**Rendering** (``render_ids``; the same function in training and scoring, so the
reward model sees at scoring time exactly the layout it was trained on): the
prompt is encoded exactly as the RL trainer encodes it (``trainer.data.datasets.encode_prompts``:
one user turn of the chat template plus the generation prompt), the completion text
follows without special tokens, then EOS -- the token sequence of a finished
assistant turn, as the policy produces it. The scorer uses the reward model's own
tokenizer (its ids must be in its vocabulary); in the SFT -> reward model -> RL
pipeline that tokenizer is a copy of the policy's, so the rendering is the policy's.
The scorer runs the score head in float32 on the (e.g. bf16) last hidden state: a
bf16 score keeps 2-3 significant digits and close completions would tie.
The RL loop hands rewards decoded text (``skip_special_tokens=True``), so a
completion cut at ``max_new_tokens`` is scored as if it had ended there.
"""
from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from transformers import AutoModelForSequenceClassification
from transformers.utils import logging as hf_logging

from trainer.data.datasets import encode_prompts
from trainer.models.policy import load_tokenizer

# How `parityrl train-rm` rendered the model's inputs, read back by the scorer.
RM_INFO_FILE = "parityrl_rm.json"


def render_ids(tokenizer, prompts: Sequence[str], completions: Sequence[str], *, use_chat_template: bool,
               max_tokens: Optional[int], where: str = "reward model") -> list[list[int]]:
    """Token ids of ``prompt + completion + EOS`` per sample (see the module docstring).

    Raises ValueError naming ``where`` and the sample when a sequence has more
    than ``max_tokens`` tokens: truncating would cut the end, where the score is read.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{where}: {len(completions)} completions for {len(prompts)} prompts")
    prompt_ids = encode_prompts(tokenizer, list(prompts), use_chat_template=use_chat_template)
    eos = tokenizer.eos_token_id
    out = []
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        if not isinstance(c, str):
            raise TypeError(f"{where}: completion {i} is {type(c).__name__}, expected str")
        ids = p + tokenizer.encode(c, add_special_tokens=False) + [eos]
        if max_tokens is not None and len(ids) > max_tokens:
            raise ValueError(f"{where}: sample {i}: prompt + completion + EOS is {len(ids)} tokens, more than "
                             f"max_tokens = {max_tokens} (prompt starts {prompts[i][:50]!r})")
        out.append(ids)
    return out


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int, *, side: str = "right",
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids), each [B, max_len]; positions restart at 0 per sequence."""
    if side not in ("left", "right"):
        raise ValueError(f"side={side!r}; expected 'left' or 'right'")
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("pad_sequences: every sequence needs at least one token")
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(0, len(s)) if side == "right" else slice(n - len(s), n)
        ids[i, cols] = torch.tensor(list(s), dtype=torch.long)
        mask[i, cols] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] index of the rightmost position with mask 1 (left or right padding alike)."""
    if not bool((attention_mask.sum(1) > 0).all()):
        raise ValueError("last_token_index: a row of the attention mask has no real token")
    cols = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (cols * (attention_mask > 0)).argmax(1)


def score_parts(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(backbone returning hidden states, score head) of a *ForSequenceClassification, PEFT-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(base, base.base_model_prefix, None)
    head = getattr(base, "score", None)
    if backbone is None or head is None:
        raise TypeError(f"{type(base).__name__}: expected a *ForSequenceClassification with a `score` head "
                        f"(backbone {base.base_model_prefix!r})")
    return backbone, head


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor) -> torch.Tensor:
    """[B] float32 rewards: the score head on the hidden state of each row's last real token."""
    backbone, head = score_parts(model)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    pooled = hidden[rows, last_token_index(attention_mask)]
    head_dtype = next(head.parameters()).dtype
    return head(pooled.to(head_dtype)).squeeze(-1).float()


@contextlib.contextmanager
def quiet_transformers():
    # Loading a causal LM as a classifier reports the dropped lm_head and the new score
    # head as a warning table; both are intended here, so it is silenced for that call.
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


class RewardModelScorer:
    """A trained reward model as a reward function: ``f(prompts, completions, **columns) -> list[float]``.

    reward_i = r(prompt_i, completion_i) - baseline (see the module docstring for r
    and the rendering), in batches of ``batch_size``, eval mode, no gradient, on
    ``device``. A baseline (e.g. the mean score of the SFT policy's completions)
    centres the rewards: group-normalised advantages (GRPO, RLOO) do not change,
    algorithms that see the reward's level (PPO's value targets, a KL-penalised
    return) do. NaN / inf scores are reported by
    ``trainer.rewards.functions.compute_rewards``, which validates every reward source by name.
    """

    def __init__(self, path: str | Path, *, name: str = "reward_model", device: torch.device | str = "cpu",
                 batch_size: int = 32, baseline: float = 0.0, max_tokens: Optional[int] = None):
        d = Path(path).expanduser()
        where = f"reward model {name!r} ({d})"
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"{where}: not a Hugging Face model directory (no config.json)")
        if batch_size < 1:
            raise ValueError(f"{where}: batch_size = {batch_size!r}: expected an integer >= 1")
        if not math.isfinite(baseline):
            raise ValueError(f"{where}: baseline = {baseline!r}: expected a finite number")
        self.name, self.where, self.device = name, where, torch.device(device)
        self.batch_size, self.baseline = batch_size, float(baseline)
        self.tokenizer = load_tokenizer(str(d))
        with quiet_transformers():
            model = AutoModelForSequenceClassification.from_pretrained(str(d), dtype="auto")
        if model.config.num_labels != 1:
            raise ValueError(f"{where}: the model has num_labels = {model.config.num_labels}; expected a reward "
                             "model with one output (num_labels = 1, as `parityrl train-rm` writes)")
        info_file = d / RM_INFO_FILE
        info = json.loads(info_file.read_text()) if info_file.is_file() else {}
        # Render as at training time; a reward model from elsewhere gets the chat template if it has one.
        self.use_chat_template = bool(info.get("use_chat_template", bool(getattr(self.tokenizer, "chat_template", None))))
        context = getattr(model.config, "max_position_embeddings", None)
        self.max_tokens = max_tokens if max_tokens is not None else context
        if context is not None and self.max_tokens > context:
            raise ValueError(f"{where}: max_tokens = {max_tokens}: expected at most the model's context of {context}")
        # The head in float32 (hidden -> 1: negligible cost): a bf16 score has ~2-3 significant
        # digits, so close pairs would round to ties and small reward differences vanish.
        score_parts(model)[1].float()
        self.model = model.to(self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        """Raw rewards r(prompt, completion), without the baseline."""
        seqs = render_ids(self.tokenizer, prompts, completions, use_chat_template=self.use_chat_template,
                          max_tokens=self.max_tokens, where=self.where)
        out: list[float] = []
        for i in range(0, len(seqs), self.batch_size):
            batch = pad_sequences(seqs[i:i + self.batch_size], self.tokenizer.pad_token_id, device=self.device)
            out += sequence_scores(self.model, *batch).tolist()
        return out

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float]:
        return [r - self.baseline for r in self.score(prompts, completions)]
