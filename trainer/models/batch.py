"""Rollouts -> padded tensors the policy forward and the losses consume.

Layout (one row per sample): prompts are LEFT-padded to the longest prompt P,
completions RIGHT-padded to the longest completion C, so every completion
starts at column P and the hidden states that predict completion tokens are
the contiguous slice ``[P-1, P-1+C)``. Explicit ``position_ids`` restart at 0
at each prompt's first real token, as they do in the engine — RoPE positions
must match or the parity metrics would measure the padding, not the numerics.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.support import Support
from rollout.types import Rollouts
from trainer.models.routing_replay import PAD
from trainer.vision.batch import VisionBatch

IGNORE = -100  # target id that fused_logprobs skips (log-prob 0, no gradient)


@dataclass
class TokenBatch:
    """input_ids, attention_mask, position_ids: [S, P+C]; targets, mask, rollout_logprobs: [S, C].

    targets: completion token ids, IGNORE past each completion's end.
    mask: 1.0 on real completion tokens. rollout_logprobs: 0.0 where mask is 0.
    prompt_len: P (so hidden[:, P-1 : P-1+C] predicts targets).
    topk_ids, topk_logprobs: [S, C, k] the engine's top-k tokens and log-probs at each
        completion position (0 where mask is 0), or None when the engine returned none.
    routes: [S, P+C, MoE layers, top_k] int16 expert ids aligned with input_ids (``Rollouts.routes``):
        ``rollout.routes.NO_ROUTE`` where the engine returned none, ``routing_replay.PAD`` on padding and
        after each row's last sampled token (no route matters there); None without routes.
    support: [S] each row's kept sets of a truncated sampler (``Rollouts.support``), one per completion position,
        or None when sampling was not truncated; ``kernel_support`` lays them out for ``parity.fused_logprobs``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    prompt_len: int
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    routes: torch.Tensor | None = None
    support: list[Support] | None = None
    # in-flight weight updates (``Rollouts.versions`` / ``stale_kv``): [S, C] the policy version that sampled each
    # token (long) and 1.0 where it read older weights' KV; None when every token has the batch's version
    versions: torch.Tensor | None = None
    stale_kv: torch.Tensor | None = None
    # a vision-language batch's images (their pixels, how many per row): None for text
    vision: VisionBatch | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: slice) -> "TokenBatch":
        """A micro-batch of rows; columns trimmed to what those rows need (up to the last sampled token: a
        multi-turn completion has context tokens between its sampled ones, so the count of sampled tokens
        is not where they end)."""
        mask = self.mask[idx]
        cols_used = (mask != 0).any(0).nonzero()
        c = max(int(cols_used[-1].item()) + 1 if cols_used.numel() else 0, 1)
        p = self.prompt_len
        am = self.attention_mask[idx]
        first_real = int((am[:, :p].cumsum(1) == 0).sum(1).min().item())  # common left padding
        cols = slice(first_real, p + c)
        return TokenBatch(
            input_ids=self.input_ids[idx, cols], attention_mask=am[:, cols], position_ids=self.position_ids[idx, cols],
            targets=self.targets[idx, :c], mask=mask[:, :c], rollout_logprobs=self.rollout_logprobs[idx, :c],
            prompt_len=p - first_real,
            topk_ids=None if self.topk_ids is None else self.topk_ids[idx, :c],
            topk_logprobs=None if self.topk_logprobs is None else self.topk_logprobs[idx, :c],
            routes=None if self.routes is None else self.routes[idx, cols],
            support=None if self.support is None else _pick(self.support, idx),
            versions=None if self.versions is None else self.versions[idx, :c],
            stale_kv=None if self.stale_kv is None else self.stale_kv[idx, :c],
            vision=None if self.vision is None else self.vision.select(idx),
        )

    def kernel_support(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The kept sets as ``parity.fused_logprobs``'s ``support``: (offsets [S * C + 1], ids) over the [S, C]
        completion grid, row by row, empty sets past each row's completion (None without truncation)."""
        if self.support is None:
            return None
        s, c = self.targets.shape
        parts = [sup.positions(0, min(c, len(sup))) for sup in self.support]
        parts = [Support.concat([p, Support.empty(c - len(p))]) for p in parts]
        whole = Support.concat(parts)
        device = self.targets.device
        return whole.offsets.to(device), whole.ids.to(device)


def batch_from_rollouts(rollouts: Rollouts, pad_id: int, device: torch.device | str = "cpu") -> TokenBatch:
    batch = build_token_batch(rollouts.prompt_ids, rollouts.completion_ids, pad_id, rollouts.rollout_logprobs, device,
                              completion_mask=rollouts.completion_mask or None)
    k = rollouts.topk
    if k:
        s, c = batch.mask.shape
        ids = torch.zeros((s, c, k), dtype=torch.long)
        lps = torch.zeros((s, c, k), dtype=torch.float32)
        for i, (ti, tl) in enumerate(zip(rollouts.topk_ids, rollouts.topk_logprobs)):
            if ti:
                ids[i, :len(ti)] = torch.tensor(ti, dtype=torch.long)
                lps[i, :len(tl)] = torch.tensor(tl, dtype=torch.float32)
        batch.topk_ids, batch.topk_logprobs = ids.to(device), lps.to(device)
    if rollouts.routes:
        batch.routes = aligned_routes(rollouts.routes, batch).to(device)
    if rollouts.support:
        batch.support = list(rollouts.support)
    if rollouts.versions:
        batch.versions = _padded(rollouts.versions, batch.mask.shape, torch.long).to(device)
        batch.stale_kv = _padded(rollouts.stale_kv, batch.mask.shape, torch.float32).to(device)
    return batch


def _padded(rows: list[list], shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Per-token rows laid out on the [S, C] completion grid, 0 past each row's end."""
    out = torch.zeros(shape, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r, dtype=dtype)
    return out


def _pick(values: list, idx) -> list:
    """``values[idx]`` for a list, with ``idx`` a slice or a tensor / list of row indices."""
    if isinstance(idx, slice):
        return values[idx]
    return [values[int(i)] for i in (idx.tolist() if isinstance(idx, torch.Tensor) else idx)]


def aligned_routes(routes: list[torch.Tensor], batch: TokenBatch) -> torch.Tensor:
    """Each sample's [P_i + C_i, L, k] routes placed as its tokens are in ``input_ids`` (prompt left-padded to P);
    PAD on padding and from each row's last sampled token on: the hidden state there predicts nothing the loss
    or the metrics read, so neither its route nor its lack of one matters."""
    s, width = batch.input_ids.shape
    p = batch.prompt_len
    out = torch.full((s, width, *routes[0].shape[1:]), PAD, dtype=routes[0].dtype)
    mask = batch.mask.cpu()
    for i, r in enumerate(routes):
        start = p - int(batch.attention_mask[i, :p].sum())
        sampled = mask[i].nonzero()
        end = p + int(sampled[-1]) if sampled.numel() else start
        out[i, start:end] = r[:end - start]
    return out


def build_token_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int,
                      rollout_logprobs: list[list[float]] | None = None, device: torch.device | str = "cpu", *,
                      completion_mask: list[list[int]] | None = None) -> TokenBatch:
    """Pad prompt/completion pairs into a TokenBatch; rollout_logprobs None -> zeros (SFT has none).

    completion_mask (``Rollouts.completion_mask``): 0 marks a completion token that is context, not sampled
    (a multi-turn episode's environment reply): it stays in ``input_ids`` and the attention, and gets target
    IGNORE, mask 0 and rollout log-prob 0, so no loss, metric or log-prob computation sees it."""
    if rollout_logprobs is None:
        rollout_logprobs = [[0.0] * len(c) for c in completion_ids]
    s = len(completion_ids)
    if s == 0 or len(prompt_ids) != s:
        raise ValueError(f"build_token_batch: {len(prompt_ids)} prompts for {s} completions")
    p = max(len(x) for x in prompt_ids)
    if p == 0:
        raise ValueError("build_token_batch: every prompt is empty; a completion needs at least one prompt token before it")
    c = max(1, max(len(x) for x in completion_ids))
    input_ids = torch.full((s, p + c), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((s, p + c), dtype=torch.long)
    targets = torch.full((s, c), IGNORE, dtype=torch.long)
    mask = torch.zeros((s, c), dtype=torch.float32)
    rollout_lp = torch.zeros((s, c), dtype=torch.float32)
    for i, (pr, co, lp) in enumerate(zip(prompt_ids, completion_ids, rollout_logprobs)):
        input_ids[i, p - len(pr):p] = torch.tensor(pr, dtype=torch.long)
        attention_mask[i, p - len(pr):p + len(co)] = 1
        if co:
            input_ids[i, p:p + len(co)] = torch.tensor(co, dtype=torch.long)
            targets[i, :len(co)] = torch.tensor(co, dtype=torch.long)
            mask[i, :len(co)] = 1.0
            rollout_lp[i, :len(co)] = torch.tensor(lp, dtype=torch.float32)
            if completion_mask is not None:
                context = torch.tensor(completion_mask[i], dtype=torch.long) == 0
                targets[i, :len(co)][context] = IGNORE
                mask[i, :len(co)][context] = 0.0
                rollout_lp[i, :len(co)][context] = 0.0
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    to = dict(device=device)
    return TokenBatch(input_ids.to(**to), attention_mask.to(**to), position_ids.to(**to), targets.to(**to), mask.to(**to),
                      rollout_lp.to(**to), p)
