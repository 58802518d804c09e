"""Preference pairs and the pairwise objective of a reward model.

**Loss** (pairwise, Bradley-Terry): for a prompt x with a preferred completion
y_c and a rejected one y_r, ``L = -log sigmoid(r(x, y_c) - r(x, y_r))``, averaged
over the batch -- Ouyang et al. 2022, "Training language models to follow
instructions with human feedback" (InstructGPT), eq. 1, and the reward-modelling
step of the StackLLaMA write-up (https://huggingface.co/blog/stackllama). Held-out
metrics: accuracy = share of pairs with r_c > r_r (a tie counts as wrong), mean
margin = mean(r_c - r_r), and the same loss. r is ``trainer.rewards.reward_model``'s.
"""
from __future__ import annotations

import math
import random
from typing import Optional

import torch

from trainer.config.schema import RecipeError
from trainer.config.supervised import RMConfig
from trainer.data.datasets import load_prompt_dataset
from trainer.rewards.reward_model import pad_sequences, render_ids, sequence_scores


def load_preference_pairs(cfg: RMConfig) -> tuple[dict[str, list], dict[str, list]]:
    """(train, held-out): each {"prompt": [...], "chosen": [...], "rejected": [...]} of strings."""
    d = cfg.data

    def load(split: str, n: Optional[int]):
        ds = load_prompt_dataset(d.source, split=split, prompt_column=d.prompt_column, answer_column=None,
                                 num_examples=n, seed=cfg.train.seed, builtin_kwargs=d.builtin_kwargs)
        for key, col in (("chosen_column", d.chosen_column), ("rejected_column", d.rejected_column)):
            if col not in ds.column_names:
                raise RecipeError(f"data.{key} = {col!r}: no such column in {d.source} (split {split!r}); "
                                  f"columns: {ds.column_names}")
        return {"prompt": ds["prompt"], "chosen": [str(x) for x in ds[d.chosen_column]],
                "rejected": [str(x) for x in ds[d.rejected_column]]}

    train = load(d.split, d.num_examples)
    if d.eval_split is not None:
        return train, load(d.eval_split, d.num_eval_examples)
    n = len(train["prompt"])
    order = list(range(n))
    random.Random(cfg.train.seed).shuffle(order)
    k = d.num_eval_examples or max(1, math.ceil(n * d.eval_fraction))
    if k >= n:
        raise RecipeError(f"data.eval_fraction = {d.eval_fraction}: holding out {k} of {n} rows leaves none to train on")
    held, kept = order[:k], order[k:]
    pick = lambda rows: {key: [col[i] for i in rows] for key, col in train.items()}
    return pick(kept), pick(held)


def encode_pairs(cfg: RMConfig, tokenizer, pairs: dict[str, list], which: str) -> tuple[list, list]:
    kw = dict(use_chat_template=cfg.data.use_chat_template, max_tokens=cfg.data.max_tokens)
    where = f"{cfg.data.source} ({which})"
    return (render_ids(tokenizer, pairs["prompt"], pairs["chosen"], where=f"{where} chosen", **kw),
            render_ids(tokenizer, pairs["prompt"], pairs["rejected"], where=f"{where} rejected", **kw))


def pairwise_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """mean(-log sigmoid(r_c - r_r)) (Ouyang et al. 2022, eq. 1); logsigmoid is stable for large margins."""
    return -torch.nn.functional.logsigmoid(r_chosen - r_rejected).mean()


def pair_metrics(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> dict[str, float]:
    """accuracy (r_c > r_r; ties are wrong), mean margin r_c - r_r, and the pairwise loss."""
    margin = (r_chosen - r_rejected).float()
    return {"accuracy": float((margin > 0).float().mean()), "margin": float(margin.mean()),
            "loss": float(pairwise_loss(r_chosen.float(), r_rejected.float()))}


@torch.no_grad()
def evaluate_pairs(model, chosen: list, rejected: list, pad_id: int, batch_size: int, device) -> dict[str, float]:
    """Held-out accuracy, margin and loss over all pairs, in eval mode (dropout off)."""
    was_training = model.training
    model.eval()
    rc, rr = [], []
    for i in range(0, len(chosen), batch_size):
        rc.append(sequence_scores(model, *pad_sequences(chosen[i:i + batch_size], pad_id, device=device)))
        rr.append(sequence_scores(model, *pad_sequences(rejected[i:i + batch_size], pad_id, device=device)))
    model.train(was_training)
    return pair_metrics(torch.cat(rc), torch.cat(rr))
