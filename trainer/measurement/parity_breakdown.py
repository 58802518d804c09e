"""Per-step parity breakdowns: where in the completions the mismatch sits.

Written to ``<run_dir>/parity_breakdown.jsonl`` every step (one JSON object per
step, appended like ``metrics.jsonl``) and sent to wandb as tables every
``logging.breakdown_every`` steps. The numbers come from ``parity.metrics``;
this module only adds token text and the file/wandb plumbing.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from parity.metrics import error_by_entropy, error_by_position, error_by_rollout_prob, error_by_turn, worst_tokens


def step_breakdown(train_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor,
                   tokenizer, entropy: Optional[torch.Tensor] = None, k: int = 10, by_turn: bool = False) -> dict:
    """Mean |d| by completion position, by rollout-probability bin, by trainer-entropy bin, the worst k tokens,
    and (``by_turn``: multi-turn episodes) by assistant turn."""
    m = mask > 0
    out = {"by_position": error_by_position(train_lp, rollout_lp, m),
           "by_rollout_prob": error_by_rollout_prob(train_lp, rollout_lp, m)}
    if by_turn:
        out["by_turn"] = error_by_turn(train_lp, rollout_lp, m)
    if entropy is not None:
        out["by_entropy"] = error_by_entropy(train_lp, rollout_lp, m, entropy)
    out["worst_tokens"] = [
        {**row._asdict(), "token_id": int(targets[row.sample, row.position]),
         "token": tokenizer.decode([int(targets[row.sample, row.position])])}
        for row in worst_tokens(train_lp, rollout_lp, m, k)
    ]
    return out


def routing_by_layer(metrics: dict[str, float]) -> list[dict]:
    """Per MoE layer, the step's routing agreement (``parity/routing_agree/layer_<l>``), and without replay
    (``parity/unreplayed/...``) when the step measured it: a table of where routers flip."""
    rows, layer = [], 0
    while f"parity/routing_agree/layer_{layer}" in metrics:
        row = {"moe_layer": layer, "agree": metrics[f"parity/routing_agree/layer_{layer}"]}
        unreplayed = metrics.get(f"parity/unreplayed/routing_agree/layer_{layer}")
        if unreplayed is not None:
            row["agree_unreplayed"] = unreplayed
        rows.append(row)
        layer += 1
    return rows


def append_breakdown(run_dir: Path, step: int, breakdown: dict) -> None:
    with open(Path(run_dir) / "parity_breakdown.jsonl", "a") as f:
        f.write(json.dumps({"step": step, **breakdown}) + "\n")


def wandb_tables(breakdown: dict) -> dict:
    """The breakdown as wandb.Table objects keyed under ``parity_tables/``."""
    import wandb

    tables = {}
    for name, rows in breakdown.items():
        if rows:
            cols = list(rows[0].keys())
            tables[f"parity_tables/{name}"] = wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in rows])
    return tables
