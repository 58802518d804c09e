"""The update passes of a step: pi_old's scores, the policy-gradient pass, and several updates per batch.

Every pass takes the ``Learner`` (trainer/rl/learner.py): the model (and its critic), the
recipe, how a micro-batch's loss is backpropagated and how an optimizer step is taken.

The loss of each micro-batch is normalised by the WHOLE batch's token/sequence counts
(``LossNormalizer``; with data parallel, of every rank's batch), so accumulating micro-batch
gradients (and summing them over ranks) equals one full-batch gradient. It also makes the
grouping of rows into micro-batches free: every pass cuts them longest-first
(``trainer.measurement.micro_batches``), so little padding is computed, and with
``train.pack_sequences`` each micro-batch's sequences are packed into fewer rows
(``trainer.models.packing``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from parity.corrections import CorrectionInputs
from trainer.algorithms import LossInputs, kl_k3
from trainer.config import RunConfig
from trainer.measurement.micro_batches import micro_batch_rows
from trainer.measurement.scoring import Scores, forward, reference_logprobs, score_batch
from trainer.models.batch import TokenBatch
from trainer.rl.learner import Learner


def updates_per_batch(cfg: RunConfig) -> int:
    """Optimizer steps on one rollout batch: ``epochs`` x ``mini_batches``."""
    return cfg.algorithm.epochs * cfg.algorithm.mini_batches


def scores_first(cfg: RunConfig) -> bool:
    """Whether pi_old is scored in a pass of its own before the update (``score_pass``): with several updates per
    batch, or a correction whose weights need the whole batch before any is used (``batch_normalize``). Otherwise
    the single on-policy update's own forward gives pi_old (its log-probs, detached)."""
    return updates_per_batch(cfg) > 1 or cfg.parity.correction.plan.batch_level


def correction_weights(cfg: RunConfig, logprobs: torch.Tensor, batch: TokenBatch, advantages: torch.Tensor,
                       all_sum=None, policy: Optional[str] = None) -> Optional[torch.Tensor]:
    """The recipe's correction weights [S, C] (float32, constants) of ``batch`` from the trainer's log-probs
    ``logprobs`` ([S, C], C <= the batch's columns), or None without a rule (``CorrectionPlan.apply``).

    Between the trainer and the engine that sampled. ``policy``: only the rules that read that policy
    (``parity.corrections.Rule.policy``): ``"old"``, pi_old (the trainer's view of the behaviour policy, scored once
    per batch); ``"current"``, the policy being updated (OPSM), given the update's own log-probs. None: every rule,
    on ``logprobs``: the single on-policy update, where the two are one policy. Every rule is local to a sequence,
    so one micro-batch's rows get the weights the whole batch gives them; ``all_sum`` pools a batch-normalised
    plan's mean over the ranks (then call it once, on the whole batch)."""
    plan = cfg.parity.correction.plan
    if policy is not None:
        plan = plan.part(policy)
    if not plan:
        return None
    c = logprobs.shape[1]
    inputs = CorrectionInputs.of(logprobs, batch.rollout_logprobs[:, :c], batch.mask[:, :c], advantages[:, :c])
    return plan.apply(inputs, all_sum=all_sum).weights.float()


def _times(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The product of two optional weight tensors (None: all ones)."""
    return b if a is None else a if b is None else a * b


def score_pass(learner: Learner, batch: TokenBatch, *, reference: bool = False) -> Scores:
    """The trainer's scores of the batch under the current policy (with the critic's values), no gradient.

    With several optimizer steps per rollout batch this is pi_old: the policy that
    generated the batch (if the last sync worked), scored once before any update. It is
    the input of the parity metrics and the denominator of every update's ratio.
    ``reference`` adds the reference policy's log-probs (``Scores.ref_logprobs``).
    """
    cfg = learner.cfg
    return score_batch(learner.model, batch, micro_batch_size=cfg.train.micro_batch_size,
                       temperature=cfg.rollout.temperature, chunk_size=cfg.parity.chunk_size,
                       value_head=learner.value_head, reference=reference, exact=learner.exact,
                       pack_sequences=cfg.train.pack_sequences)


def policy_gradient_pass(learner: Learner, batch: TokenBatch, advantages: torch.Tensor,
                         old: Optional[Scores] = None, returns: Optional[torch.Tensor] = None,
                         weights: Optional[torch.Tensor] = None) -> tuple[Scores, dict[str, float]]:
    """Forward, loss and backward over micro-batches of ``batch``: (this pass's scores, its metrics).

    ``old``: pi_old's scores (``score_pass``; its values with a critic) when this is one of
    several updates on the batch; None = the single on-policy update, where pi_old is the policy
    being differentiated (ratio 1, its log-probs detached) and this pass's detached log-probs
    serve the parity metrics: no extra forward. ``returns`` [S, C]: PPO's value targets
    (``trainer.rl.critic.ppo_targets``). ``weights`` [S, C]: the weights of these rows from the
    rules on pi_old (``correction_weights(..., policy="old")`` of the whole batch, from ``old``);
    None = computed here per micro-batch from pi_old (a batch-level correction needs them given).
    The rules on the current policy (OPSM) are computed here, per micro-batch, from this pass's own
    log-probs (detached): the policy as this update finds it. With ``parity.correction.bypass`` the
    loss's pi_old is the engine's log-probs; with ``unbiased_kl`` its KL term is weighted by
    pi_theta / pi_rollout. Gradients are left summed over the ranks on return.
    """
    cfg, model, dp, exact = learner.cfg, learner.model, learner.dp, learner.exact
    a = cfg.algorithm
    loss_fn, options = a.record.loss, a.options
    use_ref = a.record.uses_reference(options)
    entropy_grad = a.record.entropy_in_loss(options)
    temperature, chunk_size = cfg.rollout.temperature, cfg.parity.chunk_size
    norm = dp.global_normalizer(batch.mask, max_len=cfg.rollout.max_new_tokens)
    correction = cfg.parity.correction
    if weights is None and correction.plan.batch_level:
        raise ValueError("policy_gradient_pass: a batch-level correction needs its weights computed on the whole "
                         "batch first (correction_weights)")
    pack = cfg.train.pack_sequences
    scores = Scores.zeros(batch, values=learner.value_head is not None)
    totals: dict[str, float] = {}
    loss_total = 0.0
    for rows in micro_batch_rows(batch, cfg.train.micro_batch_size):
        micro = batch.select(rows)
        c = micro.targets.shape[1]
        lp, ent, top, values, routing, kept = forward(model, micro, temperature=temperature, chunk_size=chunk_size,
                                       value_head=learner.value_head, exact=exact, entropy_grad=entropy_grad,
                                       pack_sequences=pack)
        old_lp = lp.detach() if old is None else old.logprobs[rows, :c]
        ref_lp = None
        if use_ref:
            ref_lp = reference_logprobs(model, micro, temperature=temperature, chunk_size=chunk_size, exact=exact,
                                        pack_sequences=pack)
        adv = advantages[rows, :c]
        is_w = weights[rows, :c] if weights is not None else correction_weights(cfg, old_lp, micro, adv, policy="old")
        if correction.plan.reads_current_policy:
            is_w = _times(is_w, correction_weights(cfg, lp.detach(), micro, adv, policy="current"))
        critic = {} if learner.value_head is None else {"values": values, "old_values": old.values[rows, :c],
                                                         "returns": returns[rows, :c], "entropy": ent}
        out = loss_fn(LossInputs(logprobs=lp, old_logprobs=micro.rollout_logprobs if correction.bypass else old_lp,
                                 advantages=adv, mask=micro.mask, ref_logprobs=ref_lp, is_weights=is_w,
                                 behaviour_logprobs=micro.rollout_logprobs if correction.unbiased_kl else None,
                                 normalizer=norm, **critic), options)
        learner.backward(out.loss)
        loss_total += out.loss.item()
        # Each metric, like the loss, is this micro-batch's share of the whole-batch value
        # (global normaliser), so the sum over micro-batches is the batch value.
        for k, v in out.metrics.items():
            totals[k] = totals.get(k, 0.0) + v
        scores.put(rows, lp, ent, top, values, routing, kept)
    dp.all_reduce_grads(p for group in learner.param_groups() for p in group)
    # Loss terms are contributions under the global normaliser: they sum over ranks.
    metrics = dp.sum_metrics({**totals, "train/loss": loss_total})
    return scores, metrics


def mini_batch_rows(num_samples: int, cfg: RunConfig, step: int, epoch: int) -> list[torch.Tensor]:
    """Row indices of each mini-batch of one epoch: a seeded shuffle split into equal parts.

    The shuffle depends on (train.seed, step, epoch) only, so a resumed run repeats it.
    """
    g = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + step * 1009 + epoch)
    perm = torch.randperm(num_samples, generator=g)
    return list(perm.chunk(cfg.algorithm.mini_batches))


def several_updates(learner: Learner, batch: TokenBatch, advantages: torch.Tensor, old: Scores, step: int,
                    returns: Optional[torch.Tensor] = None, numerics: Optional[Scores] = None,
                    anchor_weights: Optional[torch.Tensor] = None) -> tuple[dict[str, float], Scores]:
    """``epochs`` x ``mini_batches`` optimizer steps on one rollout batch, ratios against pi_old (``old``).

    An off-policy objective (trainer/off_policy/) may anchor the ratios elsewhere than the policy that
    sampled: ``numerics`` is then the trainer's pass under the behaviour policy, against which the corrections
    weigh the engine's numerics (default: ``old``), and ``anchor_weights`` [S, C] multiply every token's term
    (the decoupled objective's pi_prox / pi_behaviour).

    ``learner.backward(loss)`` per micro-batch and ``learner.step()`` per mini-batch. Returns the
    metrics, means over the updates (``train/approx_kl_last`` is k3(pi_old || pi_theta) on the
    last mini-batch before its step: how far the epochs moved the policy), and the last pass's
    scores (with one update: pi_theta before its step, on every row).
    """
    cfg = learner.cfg
    # pi_old is fixed for the batch: its rules' weights are computed once, on the whole batch; a rule on the current
    # policy (OPSM) is computed by each update's pass from its own forward, since the policy moves between updates
    weights = correction_weights(cfg, (old if numerics is None else numerics).logprobs, batch, advantages,
                                 all_sum=learner.dp.all_sum, policy="old")
    weights = _times(weights, anchor_weights)
    sums: dict[str, float] = {}
    skipped = 0
    for epoch in range(cfg.algorithm.epochs):
        for idx in mini_batch_rows(len(batch), cfg, step, epoch):
            idx = idx.sort().values.to(batch.mask.device)
            sub = batch.select(idx)
            c = sub.targets.shape[1]
            last, metrics = policy_gradient_pass(learner, sub, advantages[idx, :c], old=old.rows(idx, c),
                                                 returns=None if returns is None else returns[idx, :c],
                                                 weights=None if weights is None else weights[idx, :c])
            metrics["train/grad_norm"] = learner.step()
            skipped += not math.isfinite(metrics["train/grad_norm"])  # trainer/distributed/gradient_guard.py
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
    n = updates_per_batch(cfg)
    metrics = {k: v / n for k, v in sums.items()}
    metrics["train/skipped_updates"] = float(skipped)
    # tokens were sampled from pi_old: k3 with log r = log(pi_theta / pi_old) estimates KL(pi_old || pi_theta)
    k3 = kl_k3(old.logprobs[idx, :c] * sub.mask, last.logprobs * sub.mask) * sub.mask
    kl = learner.dp.sum_metrics({"k3": float(k3.sum()), "n": float(sub.mask.sum())})
    metrics["train/approx_kl_last"] = kl["k3"] / max(kl["n"], 1.0)
    metrics["train/updates"] = float(n)
    return metrics, last
