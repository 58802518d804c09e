"""Completions a user can read: a samples table every ``logging.samples_every`` steps.

Each row is one sample of the step's batch: prompt and completion text, every reward
source's value and the weighted total, the completion's length and finish reason, and the
sample's own parity (mean and max |lp_train - lp_rollout| over its tokens). Rows go to
``<run_dir>/samples.jsonl`` (one JSON object per row, with its step) and to wandb as a
table (``samples``, as TRL logs its completions table); an episode's completion is its transcript
(``transcript``: every turn and reply, marked trained or context); the first step also prints two of
them on the console (``console_rows``: different prompts first, never the same prompt and completion
twice). The rows in the table are the first two samples of the first groups, so the
table shows both what differs between prompts and what differs within a group (where
GRPO's signal comes from). With data parallel, rank 0's shard.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch

from rollout.types import Rollouts
from trainer.models.batch import TokenBatch
from trainer.vision.images import row_images


class SampledRows(Protocol):
    """What the table reads of a step's samples: ``trainer.sampling.drawn.Drawn`` has these fields (the table sits
    below the sampling room, so it names the fields it needs rather than the type)."""

    rows: list[dict]  # one prompt row per group
    rollouts: Rollouts
    rewards: list[float]  # [S] weighted total
    per_fn: dict[str, list[float]]  # [S] per reward source


def sample_indices(num_samples: int, group_size: int, k: int) -> list[int]:
    """Up to ``k`` sample indices: the first two of each group, groups in order."""
    per_group = min(2, group_size)
    idx = [g * group_size + j for g in range(num_samples // group_size) for j in range(per_group)]
    return idx[:k]


def sample_rows(drawn: SampledRows, batch: TokenBatch, train_logprobs: torch.Tensor, tokenizer, k: int) -> list[dict]:
    """The table's rows for ``k`` samples of the step's batch (``drawn``: the part trained on)."""
    r = drawn.rollouts
    mask = batch.mask.float()
    d = ((train_logprobs.float() - batch.rollout_logprobs.float()) * mask).abs().cpu()
    lengths = mask.sum(-1).cpu()
    rows = []
    for i in sample_indices(len(r), r.group_size, k):
        n = max(float(lengths[i]), 1.0)
        if r.completion_mask:
            text = transcript(r.completion_ids[i], r.completion_mask[i], tokenizer)
        else:
            text = r.completion_texts[i] if r.completion_texts else tokenizer.decode(r.completion_ids[i],
                                                                                      skip_special_tokens=True)
        rows.append({"prompt": drawn.rows[i // r.group_size]["prompt"], "completion": text,
                     "reward": drawn.rewards[i], **{f"reward/{name}": v[i] for name, v in drawn.per_fn.items()},
                     "length": len(r.completion_ids[i]), "finish_reason": r.finish_reasons[i],
                     "parity_mean_abs": float(d[i].sum()) / n, "parity_max_abs": float(d[i].max()) if n else 0.0,
                     **({"versions": version_runs(r.versions[i])} if r.versions else {}),
                     # a vision-language prompt's images as the engine consumed them (their pixels' fingerprints)
                     **({"images": [image.digest[:12] for image in r.images[i]]} if r.images else {})})
    return rows


def row_image_lists(drawn: SampledRows, column: str, k: int) -> list[list]:
    """The images (RGB PIL) of the prompts of the table's ``k`` samples, in the rows' order (``sample_rows``)."""
    r = drawn.rollouts
    return [row_images(drawn.rows[i // r.group_size].get(column), column, i // r.group_size)
            for i in sample_indices(len(r), r.group_size, k)]


def version_runs(versions: list[int]) -> str:
    """A sample's per-token policy versions as runs, oldest first: "3x12 4x8" = 12 tokens of version 3, then 8 of
    version 4 (an in-flight update in the middle of it: trainer/sampling/in_flight.py)."""
    runs: list[list[int]] = []
    for v in versions:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return " ".join(f"{v}x{n}" for v, n in runs)


def transcript(ids: list[int], mask: list[int], tokenizer) -> str:
    """An episode's completion stream as text with its turn boundaries: each run of sampled ids (trained on) as
    ``[turn k] text``, each run of context ids (the environment's reply and the template's markup around it, not
    trained on) as ``[context] text`` with its special tokens shown."""
    parts, turn, start = [], 0, 0
    for end in range(1, len(ids) + 1):
        if end < len(ids) and mask[end] == mask[start]:
            continue
        sampled = bool(mask[start])
        turn += sampled
        label = f"[turn {turn}]" if sampled else "[context]"
        parts.append(f"{label} {tokenizer.decode(ids[start:end], skip_special_tokens=sampled)}")
        start = end
    return " ".join(parts)


SAMPLES_FILE = "samples.jsonl"


def append_samples(run_dir: Path, step: int, rows: list[dict]) -> Path:
    path = Path(run_dir) / SAMPLES_FILE
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps({"step": step, **row}) + "\n")
    return path


def wandb_table(rows: list[dict], images: list[list] | None = None):
    """The rows as a wandb table; with ``images`` (per row, its prompt's images), an ``image`` column first showing
    each row's first image beside its completion."""
    import wandb

    columns = list(rows[0])
    data = [[row[c] for c in columns] for row in rows]
    if images is not None:
        columns = ["image", *columns]
        data = [[wandb.Image(imgs[0]) if imgs else None, *values] for imgs, values in zip(images, data)]
    return wandb.Table(columns=columns, data=data)


def console_rows(rows: list[dict], n: int = 2) -> list[dict]:
    """Up to ``n`` rows worth reading side by side: one per prompt first, then other completions of the same
    prompts; a (prompt, completion) already chosen is skipped (two samples of one prompt often agree)."""
    chosen, seen, prompts = [], set(), set()
    for new_prompt_only in (True, False):
        for row in rows:
            key = (row["prompt"], row["completion"])
            if len(chosen) == n or key in seen or (new_prompt_only and row["prompt"] in prompts):
                continue
            chosen.append(row)
            seen.add(key)
            prompts.add(row["prompt"])
    return chosen


def console_text(rows: list[dict], n: int = 2, width: int = 160) -> str:
    """A few rows for the console (``console_rows``): what the policy writes, and what it was scored."""
    out = []
    for row in console_rows(rows, n):
        rewards = "  ".join(f"{k.split('/', 1)[1]} {v:.3g}" for k, v in row.items() if k.startswith("reward/"))
        out.append(f"  prompt     {_one_line(row['prompt'], width)}\n"
                   f"  completion {_one_line(row['completion'], width)}\n"
                   f"  reward {row['reward']:.3g} ({rewards})  length {row['length']} ({row['finish_reason']})  "
                   f"parity mean |d| {row['parity_mean_abs']:.2e}")
    return "\n".join(out)


def _one_line(text: str, width: int) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


def rendered_prompt(drawn: SampledRows, tokenizer, indent: str = "  | ") -> str:
    """The first sample's prompt exactly as the model reads it: its ids decoded with the special tokens, so the chat
    template's roles and any tools it offers are visible (a tool the model is never offered is never called)."""
    text = tokenizer.decode(drawn.rollouts.prompt_ids[0], skip_special_tokens=False)
    return "\n".join(indent + line for line in text.splitlines())
