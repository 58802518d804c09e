"""The RL step loop: rollout -> reward -> advantages -> forward/loss/backward -> step -> weight sync.

Read ``train`` top to bottom: ``setup``, then one named function per phase of a step
(rollout, score + advantages, parity, update, sync + probe, log, checkpoint). The
algorithm is the record ``algorithm.name`` selects (``trainer.algorithms.ALGORITHMS``); the
loop never branches on its name, only on the record's capabilities: a learned critic
(values and reference log-probs are scored before its advantages exist,
``trainer/rl/critic.py``), a reference policy (``uses_reference``), and several optimizer steps
per rollout batch (pi_old is scored once first, ``score_pass``).
"""
from __future__ import annotations

import signal
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch

from parity.correction import importance_weights
from parity.guards import MaeRatioLimit, threshold_violations
from parity.metrics import finalize, log10_abs_histogram
from rollout.base import RolloutEngine
from rollout.server_engine import EngineUnavailable
from trainer.algorithms import AdvantageInputs, LossInputs, kl_k3
from trainer.config import RecipeError, RunConfig, correction_config, to_dict
from trainer.distributed.data_parallel import DataParallel
from trainer.io import checkpoint as ckpt
from trainer.io.run_logger import RunLogger
from trainer.models.batch import TokenBatch, batch_from_rollouts
from trainer.models.optim import make_scheduler
from trainer.models.policy import (
    add_lora,
    completion_hidden,
    completion_logprobs,
    load_base_model,
    load_tokenizer,
    logprobs_from_hidden,
)
from trainer.rl.async_rollout import Prefetch, behaviour_weights, snapshot
from trainer.rl.critic import NegativeKLWatch, make_kl_controller, ppo_targets
from trainer.rl.dynamic_sampling import Drawn, fill_with_signal
from trainer.rl.engines import make_engine, sampling_spec, sync_weights
from trainer.rl.parity_report import append_breakdown, step_breakdown, wandb_tables
from trainer.rl.preemption import Preemption
from trainer.rl.probe import Probe, due
from trainer.rl.run_state import choose_checkpoint, claim_run_dir, record_recipe
from trainer.rl.stops import (
    EngineFailed,
    Preempted,
    RewardFailed,
    RunStopped,
    StepBoundary,
    checkpoint_on_stop,
    stop_together,
)
from trainer.rl.truncation import TruncationWatch
from trainer.rl.value_head import ValueHead


@dataclass
class TrainResult:
    run_dir: Path
    history: list[dict] = field(default_factory=list)
    final_checkpoint: Optional[Path] = None
    wandb: str = ""


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _check_logprobs(rollout_lp: torch.Tensor, mask: torch.Tensor, dp: DataParallel) -> None:
    # Counted over all ranks, so that every rank raises together (a rank left waiting in
    # the next collective would hang the job instead of stopping it).
    bad = dp.sum_metrics({"n": float(((~torch.isfinite(rollout_lp)) & (mask > 0)).sum())})["n"]
    if bad:
        raise RuntimeError(f"the engine returned {int(bad)} non-finite sampled-token log-probs; the trainer cannot "
                           "score a token the engine considers impossible (check top_k/top_p and logprobs mode)")


def _forward(model, micro: TokenBatch, cfg: RunConfig, value_head=None, exact=None):
    """(log-probs, entropy, top-k log-probs or None, values or None) of one micro-batch from one forward.

    Entropy comes from the same kernel pass: it feeds the breakdown of the mismatch by
    trainer entropy and PPO's entropy bonus. Values: the critic on the same hidden states.
    ``exact`` (``trainer.models.exact.ExactLogprobs``, precision.recipe exact): log-probs,
    entropy and top-k take the engine's numbers, the gradients stay this forward's.
    """
    hidden, lm_head, values = completion_hidden(model, micro, value_head)
    lp, ent, *top = logprobs_from_hidden(hidden, lm_head, micro, temperature=cfg.rollout.temperature,
                                         chunk_size=cfg.parity.chunk_size, return_entropy=True,
                                         topk_ids=micro.topk_ids)
    top = top[0] if top else None
    if exact is not None:
        lp, ent, top = exact(micro, lp, ent, top, cfg.rollout.temperature)
    return lp, ent, top, values


class _Scores:
    """Per-token trainer outputs of a whole batch, filled micro-batch by micro-batch."""

    def __init__(self, batch: TokenBatch, values: bool = False) -> None:
        self.logprobs = torch.zeros_like(batch.rollout_logprobs)
        self.entropy = torch.zeros_like(batch.rollout_logprobs)
        self.topk = None if batch.topk_ids is None else torch.zeros_like(batch.topk_logprobs)
        self.values = torch.zeros_like(batch.rollout_logprobs) if values else None

    def put(self, rows: slice, lp, ent, top, values=None) -> None:
        c = lp.shape[1]
        self.logprobs[rows, :c] = lp.detach()
        self.entropy[rows, :c] = ent.detach()
        if self.topk is not None:
            self.topk[rows, :c] = top
        if self.values is not None:
            self.values[rows, :c] = values.detach()

    def as_dict(self) -> dict:
        out = {"train_logprobs": self.logprobs, "entropy": self.entropy, "train_topk_logprobs": self.topk}
        if self.values is not None:
            out["values"] = self.values
        return out


@torch.no_grad()
def score_pass(model, batch: TokenBatch, cfg: RunConfig, value_head=None, with_ref: bool = False,
               exact=None) -> dict:
    """The trainer's log-probs (and entropy, top-k, values) of the batch under the current policy, no gradient.

    With several optimizer steps per rollout batch this is pi_old: the policy that
    generated the batch (if the last sync worked), scored once before any update. It is
    the input of the parity metrics and the denominator of every update's ratio.
    ``with_ref`` adds ``ref_logprobs``: the base model (adapter disabled) on the same tokens.
    """
    scores = _Scores(batch, values=value_head is not None)
    ref = torch.zeros_like(batch.rollout_logprobs) if with_ref else None
    mb = cfg.train.micro_batch_size
    for start in range(0, len(batch), mb):
        rows = slice(start, start + mb)
        micro = batch.select(rows)
        scores.put(rows, *_forward(model, micro, cfg, value_head, exact))
        if with_ref:
            with model.disable_adapter():
                lp, _ = completion_logprobs(model, micro, temperature=cfg.rollout.temperature,
                                            chunk_size=cfg.parity.chunk_size)
            if exact is not None:
                lp = exact.reference(micro, lp, cfg.rollout.temperature)
            ref[rows, :lp.shape[1]] = lp
    out = scores.as_dict()
    if with_ref:
        out["ref_logprobs"] = ref
    return out


def policy_gradient_pass(model, batch: TokenBatch, advantages: torch.Tensor, cfg: RunConfig, backward,
                         old_logprobs: Optional[torch.Tensor] = None, value_head=None,
                         old_values: Optional[torch.Tensor] = None, returns: Optional[torch.Tensor] = None,
                         dp: DataParallel = DataParallel(), exact=None) -> dict:
    """Forward, loss and backward over micro-batches of ``batch``; returns metrics and the train log-probs.

    ``old_logprobs`` [S, C]: pi_old's log-probs (``score_pass``) when this is one of several
    updates on the batch; None = the single on-policy update, where pi_old is the policy
    being differentiated (ratio 1, its log-probs detached) and this pass's detached
    log-probs serve the parity metrics: no extra forward. ``value_head``, ``old_values``,
    ``returns`` [S, C]: PPO's critic and its targets (``trainer.rl.critic.ppo_targets``).

    The loss of each micro-batch is normalised by the WHOLE batch's token/sequence
    counts (``LossNormalizer``; with data parallel, of every rank's batch), so accumulating
    micro-batch gradients (and summing them over ranks) equals one full-batch gradient.
    Gradients are left summed over the ranks on return.
    """
    a = cfg.algorithm
    loss_fn, options = a.record.loss, a.options
    use_ref = a.record.uses_reference(options)
    norm = dp.global_normalizer(batch.mask, max_len=cfg.rollout.max_new_tokens)
    correction = correction_config(cfg)
    mb = cfg.train.micro_batch_size
    scores = _Scores(batch, values=value_head is not None)
    totals: dict[str, float] = {}
    loss_total = 0.0
    for start in range(0, len(batch), mb):
        rows = slice(start, start + mb)
        micro = batch.select(rows)
        c = micro.targets.shape[1]
        lp, ent, top, values = _forward(model, micro, cfg, value_head, exact)
        old = lp.detach() if old_logprobs is None else old_logprobs[rows, :c]
        ref_lp = None
        if use_ref:
            # The reference policy is the base model: the same weights with the adapter off,
            # so no second copy of the model is held.
            with torch.no_grad(), model.disable_adapter():
                ref_lp, _ = completion_logprobs(model, micro, temperature=cfg.rollout.temperature,
                                                chunk_size=cfg.parity.chunk_size)
            if exact is not None:
                ref_lp = exact.reference(micro, ref_lp, cfg.rollout.temperature)
        # Rollout/trainer mismatch correction between pi_old (the trainer's view of the
        # behaviour policy) and the engine that sampled: weights are local to a token (tis,
        # mis) or a row (seq_mis), so computing them per micro-batch equals doing it once.
        is_w = None
        if correction.mode != "none":
            is_w, _ = importance_weights(old, micro.rollout_logprobs, micro.mask, correction)
        critic = {} if value_head is None else {"values": values, "old_values": old_values[rows, :c],
                                                 "returns": returns[rows, :c], "entropy": ent}
        out = loss_fn(LossInputs(logprobs=lp, old_logprobs=old, advantages=advantages[rows, :c], mask=micro.mask,
                                 ref_logprobs=ref_lp, is_weights=is_w, normalizer=norm, **critic), options)
        backward(out.loss)
        loss_total += out.loss.item()
        # Each metric, like the loss, is this micro-batch's share of the whole-batch value
        # (global normaliser), so the sum over micro-batches is the batch value.
        for k, v in out.metrics.items():
            totals[k] = totals.get(k, 0.0) + v
        scores.put(rows, lp, ent, top, values)
    dp.all_reduce_grads(p for group in _param_groups(model, value_head) for p in group)
    # Loss terms are contributions under the global normaliser: they sum over ranks.
    metrics = dp.sum_metrics({**totals, "train/loss": loss_total})
    if correction.mode != "none":  # the fractions and ESS of the batch (averaged over ranks)
        old_all = scores.logprobs if old_logprobs is None else old_logprobs
        metrics.update(dp.mean_metrics(importance_weights(old_all, batch.rollout_logprobs, batch.mask, correction)[1]))
    return {"metrics": metrics, **scores.as_dict()}


def mini_batch_rows(num_samples: int, cfg: RunConfig, step: int, epoch: int) -> list[torch.Tensor]:
    """Row indices of each mini-batch of one epoch: a seeded shuffle split into equal parts.

    The shuffle depends on (train.seed, step, epoch) only, so a resumed run repeats it.
    """
    g = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + step * 1009 + epoch)
    perm = torch.randperm(num_samples, generator=g)
    return list(perm.chunk(cfg.algorithm.mini_batches))


def _param_groups(model, value_head) -> list:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [trainable] if value_head is None else [trainable, list(value_head.parameters())]


def _several_updates(model, batch: TokenBatch, advantages, old_logprobs, cfg: RunConfig, step: int, backward,
                     update, value_head=None, old_values=None, returns=None,
                     dp: DataParallel = DataParallel(), exact=None, current: Optional[dict] = None) -> dict:
    """``epochs`` x ``mini_batches`` optimizer steps on one rollout batch, ratios against pi_old.

    ``backward(loss)`` per micro-batch and ``update()`` (clip, step, zero; returns the
    pre-clip grad norm) per mini-batch: ``trainer.distributed.deepspeed.make_backward`` /
    ``optimizer_step``, which drive the DeepSpeed engine when there is one.

    Metrics are means over the updates; ``train/approx_kl_last`` is k3(pi_old || pi_theta)
    on the last mini-batch before its step (how far the epochs moved the policy).
    """
    a = cfg.algorithm
    sums: dict[str, float] = {}
    for epoch in range(a.epochs):
        for idx in mini_batch_rows(len(batch), cfg, step, epoch):
            idx = idx.sort().values.to(batch.mask.device)
            sub = batch.select(idx)
            c = sub.targets.shape[1]
            critic = {} if value_head is None else {"value_head": value_head, "old_values": old_values[idx, :c],
                                                     "returns": returns[idx, :c]}
            out = policy_gradient_pass(model, sub, advantages[idx, :c], cfg, backward,
                                       old_logprobs=old_logprobs[idx, :c], dp=dp, exact=exact, **critic)
            out["metrics"]["train/grad_norm"] = update()
            for k, v in out["metrics"].items():
                sums[k] = sums.get(k, 0.0) + v
    n = a.epochs * a.mini_batches
    if current is not None and n == 1:  # the one update's log-probs: pi_theta before its step, every row
        current["train_logprobs"] = out["train_logprobs"]
    metrics = {k: v / n for k, v in sums.items()}
    # tokens were sampled from pi_old: k3 with log r = log(pi_theta / pi_old) estimates KL(pi_old || pi_theta)
    k3 = kl_k3(old_logprobs[idx, :c] * sub.mask, out["train_logprobs"] * sub.mask) * sub.mask
    kl = dp.sum_metrics({"k3": float(k3.sum()), "n": float(sub.mask.sum())})
    metrics["train/approx_kl_last"] = kl["k3"] / max(kl["n"], 1.0)
    metrics["train/updates"] = float(n)
    return metrics


class ParityLimitExceeded(RunStopped):
    """The step's rollout/trainer mismatch broke a recipe limit with ``parity.on_violation: stop``."""

    exit_status = 3


def _enforce_parity_limits(cfg: RunConfig, step: int, m: dict, *, prefix: str = "parity/", when: str = "",
                           ratio: MaeRatioLimit | None = None) -> None:
    problems = threshold_violations(m, max_mae=cfg.parity.max_mae, max_kl_k3=cfg.parity.max_kl_k3, prefix=prefix)
    problems += ratio.violations(m, prefix) if ratio is not None else []
    if not problems:
        return
    msg = f"step {step}{when}: " + "; ".join(problems)
    if cfg.parity.on_violation == "stop":
        consequence = ("this step's update was not applied" if prefix == "parity/" else
                       "the engine disagrees with the trainer on the fixed probe prompts; no further rollout was made "
                       "with these weights")
        raise ParityLimitExceeded(f"{msg} (parity.on_violation: stop; {consequence})")
    warnings.warn(msg, stacklevel=2)


def _draw_round(engine, batcher, tokenizer, reward_fns, cfg: RunConfig, step: int, round_index: int,
                dp: DataParallel) -> Drawn:
    """One prompt batch of ``step``: this rank's shard generated and scored.

    Round ``round_index`` > 0 (dynamic sampling) samples with the seeds of the sample indices
    after the previous rounds', so no two rounds of a step share a seed.
    """
    from trainer.data.datasets import encode_prompts
    from trainer.data.rewards import compute_rewards

    d = cfg.data
    t = time.perf_counter()
    rows = dp.shard(next(batcher))  # every rank draws the same batch and keeps its slice
    prompts = [r["prompt"] for r in rows]
    prompt_ids = encode_prompts(tokenizer, prompts, use_chat_template=d.use_chat_template,
                                max_prompt_tokens=d.max_prompt_tokens, system_prompt=d.system_prompt)
    spec = sampling_spec(cfg, step)
    first = round_index * cfg.rollout.prompts_per_step * spec.n + dp.offset(len(prompt_ids) * spec.n)
    rollouts, error = None, None
    try:
        rollouts = engine.generate(prompt_ids, replace(spec, index_offset=first))
    except Exception as e:  # noqa: BLE001 - every rank stops with it (stop_together)
        error = e if isinstance(e, EngineUnavailable) else EngineFailed(
            f"step {step}: the rollout engine failed to generate: {type(e).__name__}: {' '.join(str(e).split())}")
        error.__cause__ = e if error is not e else None
    stop_together(dp, error)
    generate_s = time.perf_counter() - t
    t = time.perf_counter()
    g = spec.n
    completions = tokenizer.batch_decode(rollouts.completion_ids, skip_special_tokens=True)
    columns = {k: [r[k] for r in rows for _ in range(g)] for k in rows[0] if k != "prompt"}
    total, per_fn, error = None, None, None
    try:
        total, per_fn = compute_rewards(reward_fns, cfg.reward.weights, [p for p in prompts for _ in range(g)],
                                        completions, columns)
    except Exception as e:  # noqa: BLE001 - the user's function: one line naming it, every rank stops
        raised_in = "; ".join(getattr(e, "__notes__", []))  # compute_rewards notes the function that raised
        error = RewardFailed(f"step {step}: " + (f"{raised_in}: {type(e).__name__}: {e}" if raised_in else str(e)))
        error.__cause__ = e
    stop_together(dp, error)
    return Drawn(rows=rows, rollouts=rollouts, rewards=total, per_fn=per_fn, generate_s=generate_s,
                 reward_s=time.perf_counter() - t)


def _drawn_metrics(drawn: Drawn, dp: DataParallel) -> dict[str, float]:
    """Rollout and reward metrics of every sample drawn this step (timings: this rank's)."""
    r = drawn.rollouts
    m = {"perf/rollout_s": drawn.generate_s,
         "perf/rollout_tokens_per_s": r.num_completion_tokens / max(drawn.generate_s, 1e-9),
         "perf/reward_s": drawn.reward_s}
    m.update(dp.mean_metrics({"rollout/mean_length": _mean([len(c) for c in r.completion_ids]),
                              "rollout/frac_truncated": _mean([float(f == "length") for f in r.finish_reasons])}))
    m.update(dp.mean_metrics({"reward/mean": _mean(drawn.rewards),
                              **{f"reward/{name}": _mean(vals) for name, vals in drawn.per_fn.items()}}))
    m.update(_spread_metrics(drawn, dp))
    return m


def _spread_metrics(drawn: Drawn, dp: DataParallel) -> dict[str, float]:
    """reward/std and the share of groups whose rewards are all equal (no GRPO signal: zero advantage),
    completion length min/max: pooled over every rank exactly (sums, max)."""
    rewards = torch.tensor(drawn.rewards, dtype=torch.float64)
    g = drawn.rollouts.group_size
    groups = rewards.view(-1, g) if rewards.numel() else rewards.view(0, g)
    lengths = [len(c) for c in drawn.rollouts.completion_ids] or [0]
    s = dp.sum_metrics({"n": float(rewards.numel()), "sum": float(rewards.sum()), "sum2": float((rewards ** 2).sum()),
                        "groups": float(groups.shape[0]),
                        "flat": float((groups.max(1).values == groups.min(1).values).sum()) if groups.numel() else 0.0})
    x = dp.max_metrics({"max_len": float(max(lengths)), "neg_min_len": -float(min(lengths))})
    n = max(s["n"], 1.0)
    var = max(s["sum2"] / n - (s["sum"] / n) ** 2, 0.0)
    return {"reward/std": var ** 0.5, "reward/frac_zero_std_groups": s["flat"] / max(s["groups"], 1.0),
            "rollout/max_length": x["max_len"], "rollout/min_length": -x["neg_min_len"]}


@dataclass
class Run:
    """What ``setup`` builds and the phases of a step share."""

    cfg: RunConfig
    accelerator: object
    stage: int  # DeepSpeed ZeRO stage, 0 = none
    dp: DataParallel
    model_dir: str
    tokenizer: object
    model: object  # the PEFT policy, or the DeepSpeed engine around it
    policy: object  # the PEFT model itself (weight sync, adapter checkpoint)
    value_head: Optional[ValueHead]
    optimizer: object
    scheduler: object
    params: list
    backward: object
    gather: object  # ZeRO-3: gathers one module's parameters for the weight export
    dataset: object
    batcher: object
    reward_fns: dict
    kl_controller: object = None
    kl_watch: Optional[NegativeKLWatch] = None
    modules: dict = field(default_factory=dict)  # extra modules in the checkpoint (PPO's value head)
    engine: Optional[RolloutEngine] = None
    own_engine: bool = True
    logger: Optional[RunLogger] = None
    probe: Optional[Probe] = None
    ratio_limit: Optional[MaeRatioLimit] = None  # its baseline: the first mae measured (the probe before step 1)
    exact: object = None  # trainer.models.exact.ExactLogprobs when precision.recipe is exact
    start_step: int = 0
    tokens_seen: float = 0.0  # completion tokens trained on so far (checkpointed)
    truncation: TruncationWatch = field(default_factory=TruncationWatch)
    # rollout.max_staleness 1 (trainer/rl/async_rollout.py): the next step's batch, and the behaviour
    # adapter of the batch this step trains on (None: the current weights generated it)
    prefetch: Prefetch = field(default_factory=Prefetch)
    behaviour: Optional[dict] = None

    @property
    def device(self):
        return self.accelerator.device

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def update(self) -> float:
        """Clip, optimizer step, zero: the pre-clip gradient norm."""
        from trainer.distributed.deepspeed import optimizer_step

        return optimizer_step(self.accelerator, self.model, self.optimizer, self.params, self.cfg.train.max_grad_norm)


def train(cfg: RunConfig, *, resume: bool = False, engine=None) -> TrainResult:
    """Run ``cfg`` to ``cfg.train.steps``. ``engine``: an already-started engine to reuse (tests share one)."""
    lock = claim_run_dir(cfg, resume=resume)  # one writer per run directory (trainer/rl/run_state.py)
    try:
        run = setup(cfg, resume=resume, engine=engine)
    except BaseException:
        lock.release()
        raise
    result = TrainResult(run_dir=cfg.run_dir)
    boundary = StepBoundary()
    boundary.begin(run.start_step + 1, _run_state(run))
    preemption = Preemption(announce=run.is_main).install()
    unlogged = None  # (step, metrics) of a step whose update is applied but whose record is not written yet
    try:
        probe_before_training(run)
        for step in range(run.start_step + 1, cfg.train.steps + 1):
            boundary.begin(step, _run_state(run))
            t_step = time.perf_counter()
            drawn, m = rollout_phase(run, step)
            batch = batch_from_rollouts(drawn.rollouts, run.tokenizer.pad_token_id, run.device)
            _check_logprobs(batch.rollout_logprobs, batch.mask, run.dp)
            rewards = torch.tensor(drawn.rewards, dtype=torch.float32, device=run.device)
            t = time.perf_counter()
            scored, advantages, returns = score_phase(run, step, batch, rewards, m)
            parity_phase(run, step, batch, scored, m)
            samples_phase(run, step, drawn, batch, scored)
            update_phase(run, step, batch, scored, advantages, returns, m)
            run.tokens_seen += m["parity/num_tokens"]  # the batch's completion tokens, pooled over ranks
            m["train/tokens_seen"] = run.tokens_seen  # a wandb x-axis
            boundary.update_applied()
            unlogged = (step, m)
            m["perf/train_s"] = time.perf_counter() - t
            sync_phase(run, step, m)
            m["perf/step_s"] = time.perf_counter() - t_step
            run.logger.log(step, m)
            unlogged = None
            _warn_truncation(run, step, m)
            result.history.append({"step": step, **m})
            # After logging (the step's record keeps the probe values), before the checkpoint.
            _enforce_parity_limits(cfg, step, m, prefix="probe/", when=" (probe after the weight sync)",
                                   ratio=run.ratio_limit)
            checkpoint_phase(run, step, result)
            _stop_if_preempted(run, preemption, step)
        result.wandb = run.logger.wandb_location
        _print_summary(result, run.logger)
    except (RunStopped, EngineUnavailable) as e:
        if unlogged is not None and boundary.applied:  # the stop checkpoints this step: its record goes with it
            run.logger.log(*unlogged, echo=False)
        e.checkpoint_note = checkpoint_on_stop(cfg.run_dir, boundary, lambda s, state: save_step(run, s, result, state))
        raise
    finally:
        preemption.restore()
        run.logger.close()
        if run.own_engine:
            run.engine.close()
        lock.release()
    return result


# ---------------------------------------------------------------- setup


def setup(cfg: RunConfig, *, resume: bool, engine=None) -> Run:
    """Accelerator, policy (+ critic), data, rewards, optimizer, restored state, engine, logger."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from rollout.weight_export import merged_lora_weights  # noqa: F401  (import early: fail before the engine starts)
    from trainer.commands.train_rm import build_reward_sources
    from trainer.data.datasets import PromptBatcher, apply_prompt_budget, load_prompt_dataset
    from trainer.distributed.deepspeed import (
        accelerator_kwargs,
        check_deepspeed_recipe,
        deepspeed_stage,
        make_backward,
        zero3_gather,
    )
    from trainer.models.builtin import resolve_model_path

    accelerator = Accelerator(**accelerator_kwargs())
    # DeepSpeed ZeRO-2/3 (accelerate config recipes/accelerate/zero{2,3}.yaml) or not (0).
    stage = deepspeed_stage(accelerator)
    check_deepspeed_recipe(cfg, stage)
    # N processes: each holds a prompt shard and its own engine; gradients and metrics are
    # reduced explicitly (trainer/distributed/data_parallel.py explains why not DDP's wrapper), the
    # gradients by the DeepSpeed engine under ZeRO.
    dp = DataParallel.current(reduce_grads=not stage)
    set_seed(cfg.train.seed)
    model_dir = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(model_dir)
    model = _load_policy(cfg, accelerator, model_dir)
    if cfg.rollout.max_staleness and dp.world > 1:
        raise RecipeError(f"rollout.max_staleness = {cfg.rollout.max_staleness} with {dp.world} processes: expected "
                          "one process (the prefetch of several ranks sharing a server is not synchronised yet)")
    if cfg.precision.recipe == "exact":  # before the engine starts: refuse what exact mode does not cover
        from trainer.models.exact import check_exact

        check_exact(model.config, stage=stage, world_size=dp.world)
    d = cfg.data
    dataset = load_prompt_dataset(d.source, split=d.split, prompt_column=d.prompt_column, answer_column=d.answer_column,
                                  num_examples=d.num_examples, seed=cfg.train.seed, builtin_kwargs=d.builtin_kwargs)
    dataset = apply_prompt_budget(dataset, tokenizer, d, verbose=accelerator.is_main_process)  # before the engine
    batcher = PromptBatcher(dataset, cfg.rollout.prompts_per_step, seed=cfg.train.seed)
    # Rule functions and reward models (trainer/commands/train_rm.py), each logged as reward/<name>.
    reward_fns, _ = build_reward_sources(cfg.reward, accelerator.device)
    value_head, kl_controller, kl_watch, modules = None, None, None, {}
    if cfg.algorithm.record.critic:
        value_head = ValueHead(model.config.hidden_size).to(accelerator.device)
        kl_controller, kl_watch = make_kl_controller(cfg.algorithm.options), NegativeKLWatch()
        modules = {"value_head": value_head}
    params = [p for p in model.parameters() if p.requires_grad] + ([] if value_head is None else
                                                                    list(value_head.parameters()))
    optimizer = torch.optim.AdamW(params, lr=cfg.train.learning_rate, betas=tuple(cfg.train.adam_betas),
                                  weight_decay=cfg.train.weight_decay)
    t = cfg.train
    scheduler = make_scheduler(optimizer, t.lr_schedule, t.warmup_steps, t.steps, t.warmup_ratio)
    model, optimizer, policy = _prepare(cfg, accelerator, stage, model, optimizer, value_head)
    run = Run(cfg=cfg, accelerator=accelerator, stage=stage, dp=dp, model_dir=model_dir, tokenizer=tokenizer,
              model=model, policy=policy, value_head=value_head, optimizer=optimizer, scheduler=scheduler,
              params=params, backward=make_backward(accelerator, model),
              # Under ZeRO-3 the export gathers one module at a time on every rank (a collective).
              gather=zero3_gather(policy) if stage == 3 else None, dataset=dataset, batcher=batcher,
              reward_fns=reward_fns, kl_controller=kl_controller, kl_watch=kl_watch, modules=modules)
    run.probe = Probe(_probe_prompt_ids(cfg, dataset, tokenizer), cfg, pad_id=tokenizer.pad_token_id,
                      device=accelerator.device, dp=dp)
    run.ratio_limit = MaeRatioLimit(cfg.parity.max_mae_ratio)
    run.start_step = _restore(run) if resume else _refuse_existing_run(cfg)
    record_recipe(run, resumed=resume)
    run.own_engine = engine is None
    run.engine = engine if engine is not None else make_engine(
        cfg, model_dir, max_model_len=d.max_prompt_tokens + cfg.rollout.max_new_tokens, dp=dp)
    if cfg.precision.recipe == "exact":
        from trainer.models.exact import ExactLogprobs

        run.exact = run.probe.exact = ExactLogprobs(run.engine, policy, getattr(torch, cfg.model.dtype))
    # Always align the engine with the policy being trained (fresh adapter = base weights,
    # resumed adapter = its merge), so a reused engine never carries another run's weights.
    _sync(run)
    run.logger = RunLogger(cfg.run_dir, config=to_dict(cfg), wandb_mode=cfg.logging.wandb.mode,
                           project=cfg.logging.wandb.project, entity=cfg.logging.wandb.entity, name=cfg.name,
                           total_steps=cfg.train.steps, print_every=cfg.logging.print_every, enabled=run.is_main,
                           resume=resume, tags=run_tags(cfg))
    return run


def run_tags(cfg: RunConfig) -> tuple[str, ...]:
    """wandb tags, so that runs of one model compare side by side by algorithm and precision recipe."""
    return (f"algorithm:{cfg.algorithm.name}", f"precision:{cfg.precision.recipe}", f"model:{cfg.model.path}",
            f"dtype:{cfg.model.dtype}") + (("off-policy",) if cfg.rollout.max_staleness else ())


def _load_policy(cfg: RunConfig, accelerator, model_dir: str):
    from trainer.distributed.deepspeed import model_load_context

    with model_load_context(accelerator):
        model = add_lora(load_base_model(model_dir, cfg.model.dtype, accelerator.device), cfg.model.lora)
    if cfg.precision.recipe == "fp8_unified":
        # The trainer's decoder linears run the engine's FP8 forward (quantized merged
        # LoRA weight, quantized activations): one quantizer, parity.precision.
        from trainer.models.precision import convert_to_fp8

        convert_to_fp8(model)
    return model


def _prepare(cfg: RunConfig, accelerator, stage: int, model, optimizer, value_head):
    """(model, optimizer, policy) after accelerate's prepare: the DeepSpeed engine under ZeRO, else as they were.

    The scheduler is never prepared: it drives the AdamW param groups, which DeepSpeed's ZeRO
    optimizer steps with (checked in bench/zero_cpu_check.py).
    """
    from trainer.distributed.deepspeed import fill_deepspeed_config, unwrap_policy, wrap_for_prepare

    if not stage:
        # The model is not prepared: no DDP wrapper (see DataParallel); it is already on the device.
        return model, accelerator.prepare(optimizer), model
    fill_deepspeed_config(accelerator, micro_batch_size=cfg.train.micro_batch_size,
                          max_grad_norm=cfg.train.max_grad_norm)
    # PPO's value head goes inside the engine with the policy (PolicyForward).
    engine, optimizer = accelerator.prepare(wrap_for_prepare(accelerator, model, value_head), optimizer)
    return engine, optimizer, unwrap_policy(accelerator, engine)


def _restore(run: Run) -> int:
    """Load the newest complete checkpoint into the run; returns its step."""
    run_dir = run.cfg.run_dir
    latest = choose_checkpoint(run_dir, verbose=run.is_main)
    if run.stage:
        state = ckpt.load_deepspeed_checkpoint(latest, engine=run.model, scheduler=run.scheduler,
                                               world_size=run.accelerator.num_processes, rank=run.dp.rank)
    else:
        state = ckpt.load_checkpoint(latest, model=run.policy, optimizer=run.optimizer, scheduler=run.scheduler,
                                     modules=run.modules, rank=run.dp.rank)
    if run.kl_controller is not None:
        run.kl_controller.load_state_dict(state["kl_controller"])
    run.batcher.load_state_dict(state["batcher"])
    run.probe.load_state_dict(state.get("probe"))
    run.prefetch.load_state_dict(state.get("prefetch"))
    run.tokens_seen = float(state.get("tokens_seen", 0.0))  # older checkpoints: counted from the resume
    if run.is_main:
        print(f"resumed from {latest} (step {state['step']})", flush=True)
    return state["step"]


def _refuse_existing_run(cfg: RunConfig) -> int:
    if ckpt.step_dirs(cfg.run_dir):
        raise FileExistsError(f"{cfg.run_dir} already holds checkpoints; pass --resume to continue it, or choose "
                              "another name / logging.run_dir (nothing was overwritten)")
    return 0


def _probe_prompt_ids(cfg: RunConfig, dataset, tokenizer) -> list:
    """The probe's prompts: the dataset's first rows, the same every step and after a resume."""
    from trainer.data.datasets import encode_prompts

    d = cfg.data
    n_probe = min(cfg.parity.probe_prompts, len(dataset))
    if not n_probe:
        return []
    return encode_prompts(tokenizer, [dataset[i]["prompt"] for i in range(n_probe)],
                          use_chat_template=d.use_chat_template, max_prompt_tokens=d.max_prompt_tokens,
                          system_prompt=d.system_prompt)


def probe_before_training(run: Run) -> None:
    """The engine must already agree with the trainer before the first step (or the first after a resume)."""
    m0 = run.probe(run.engine, run.model)
    if not m0:
        return
    if run.is_main:
        print(f"probe before step {run.start_step + 1}: mae {m0.get('probe/mae', float('nan')):.2e}  "
              f"kl_k3 {m0.get('probe/kl_k3', float('nan')):.1e}  on {int(m0['probe/num_tokens'])} tokens", flush=True)
        if run.start_step == 0:  # a resumed run has logged this step already; wandb steps only increase
            run.logger.log(0, m0, echo=False)
    # every rank sees the same pooled values and stops together
    _enforce_parity_limits(run.cfg, run.start_step, m0, prefix="probe/", when=" (probe before training)",
                           ratio=run.ratio_limit)


# ---------------------------------------------------------------- the phases of a step


def rollout_phase(run: Run, step: int) -> tuple[Drawn, dict]:
    """Generate and score this step's groups: (the part trained on, rollout and reward metrics of all drawn)."""
    cfg, a, m = run.cfg, run.cfg.algorithm, {}

    def draw(round_index: int) -> Drawn:
        return _draw_round(run.engine, run.batcher, run.tokenizer, run.reward_fns, cfg, step, round_index, run.dp)

    taken = run.prefetch.take(step)
    run.behaviour = None
    if taken is not None:  # generated during the previous step, by the adapter it was launched with
        train_part, run.behaviour = taken
        drawn = [train_part]
    elif a.dynamic_sampling:  # DAPO: keep groups with signal, draw more to refill
        train_part, drawn, ds_metrics = fill_with_signal(
            draw, share=cfg.rollout.prompts_per_step // run.dp.world, group_size=a.group_size,
            mini_batches=a.mini_batches, max_rounds=a.max_sampling_rounds, dp=run.dp)
        m.update(ds_metrics)
    else:
        train_part = draw(0)
        drawn = [train_part]
    m.update(_drawn_metrics(Drawn.concat(drawn), run.dp))
    if cfg.rollout.max_staleness:
        # The engine still holds theta_{step-1}: the next batch is launched with it now, and trained on
        # after this step's update. Server mode overlaps it with this step (a thread; another process).
        # Also after the last step: the final checkpoint then holds it, so the run can be extended exactly.
        run.prefetch.launch(step + 1, lambda: _draw_round(run.engine, run.batcher, run.tokenizer, run.reward_fns, cfg,
                                                          step + 1, 0, run.dp),
                            snapshot(run.policy), threaded=cfg.rollout.mode == "server")
    return train_part, m


def score_phase(run: Run, step: int, batch: TokenBatch, rewards: torch.Tensor, m: dict):
    """(trainer scores of the batch, advantages, returns or None).

    The single on-policy update of a critic-free algorithm does its forward/backward here
    (``policy_gradient_pass``): its detached log-probs are the scores, no extra forward. With
    several updates the batch is scored once first (pi_old); a critic's advantages need the
    batch's values and reference log-probs before anything else.
    """
    cfg, a = run.cfg, run.cfg.algorithm
    run.model.train()
    if run.value_head is not None:
        scored = score_pass(run.model, batch, cfg, value_head=run.value_head, with_ref=True, exact=run.exact)
        advantages, returns, critic_metrics = ppo_targets(scored, rewards, batch.mask, a.group_size, cfg,
                                                          run.kl_controller, all_sum=run.dp.all_sum)
        critic_metrics = run.dp.mean_metrics(critic_metrics)
        m.update(critic_metrics)
        run.kl_watch.update(step, critic_metrics["train/kl_ref"])
        return scored, advantages, returns
    advantages = a.record.advantage(
        AdvantageInputs(rewards=rewards, mask=batch.mask, group_size=a.group_size, all_sum=run.dp.all_sum), a.options)
    if run.behaviour is not None:
        # An off-policy batch: pi_old is its behaviour adapter (parity/* = engine vs it: numerics only);
        # staleness/* = behaviour vs the current adapter (policy lag only). Ratios against pi_old.
        with behaviour_weights(run.policy, run.behaviour):
            scored = score_pass(run.model, batch, cfg, exact=run.exact)
        if _updates(cfg) > 1:  # one update: its own forward gives pi_theta (update_phase), no extra pass
            current = score_pass(run.model, batch, cfg, exact=run.exact)
            m.update(run.dp.pooled_parity(current["train_logprobs"], scored["train_logprobs"], batch.mask,
                                          prefix="staleness/"))
        return scored, advantages, None
    if _updates(cfg) == 1:
        scored = policy_gradient_pass(run.model, batch, advantages, cfg, run.backward, dp=run.dp, exact=run.exact)
        m.update(scored["metrics"])
    else:
        scored = score_pass(run.model, batch, cfg, exact=run.exact)  # pi_old, before any update
    # on-policy: the behaviour policy is the current one, by construction no lag
    m.update(run.dp.pooled_parity(scored["train_logprobs"], scored["train_logprobs"], batch.mask, prefix="staleness/"))
    return scored, advantages, None


def _updates(cfg: RunConfig) -> int:
    return cfg.algorithm.epochs * cfg.algorithm.mini_batches


def parity_phase(run: Run, step: int, batch: TokenBatch, scored: dict, m: dict) -> None:
    """pi_old vs the engine on the sampled tokens: ``parity/*``, the limits, the breakdown tables.

    The train log-probs are from the pre-update policy, the one that generated the rollouts
    (if the previous sync worked): this is what the metrics measure.
    """
    cfg = run.cfg
    stats = run.dp.pooled_stats(scored["train_logprobs"], batch.rollout_logprobs, batch.mask,
                                train_topk_logprobs=scored["train_topk_logprobs"],
                                rollout_topk_logprobs=batch.topk_logprobs)
    m.update(finalize(stats))
    if run.is_main:  # the shape of the mismatch: the pooled |d| histogram the p99 was read from, no extra pass
        run.logger.log_histogram(step, "parity/log10_abs_d", *log10_abs_histogram(stats["abs_d_hist"]))
    if "train/entropy" not in m:  # the trainer's entropy of the sampled positions (PPO's loss logs its own)
        e = run.dp.sum_metrics({"s": float((scored["entropy"] * batch.mask).sum()), "n": float(batch.mask.sum())})
        m["train/entropy"] = e["s"] / max(e["n"], 1.0)
    _enforce_parity_limits(cfg, step, m, ratio=run.ratio_limit)
    if run.is_main:
        breakdown = step_breakdown(scored["train_logprobs"], batch.rollout_logprobs, batch.mask, batch.targets,
                                   run.tokenizer, entropy=scored["entropy"])
        append_breakdown(cfg.run_dir, step, breakdown)
        if run.logger.wandb_run is not None and (step % cfg.logging.breakdown_every == 0 or step == cfg.train.steps):
            run.logger.wandb_run.log(wandb_tables(breakdown), step=step)


def samples_phase(run: Run, step: int, drawn: Drawn, batch: TokenBatch, scored: dict) -> None:
    """The samples table (trainer/rl/samples.py) at the run's first step and every ``samples_every`` steps."""
    from trainer.rl import samples

    lg = run.cfg.logging
    first = step == run.start_step + 1
    if not run.is_main or not lg.samples_every or not (first or step % lg.samples_every == 0):
        return
    rows = samples.sample_rows(drawn, batch, scored["train_logprobs"], run.tokenizer, lg.samples_per_step)
    samples.append_samples(run.cfg.run_dir, step, rows)
    if run.logger.wandb_run is not None:
        run.logger.wandb_run.log({"samples": samples.wandb_table(rows)}, step=step)
    if first:
        print(f"samples of step {step} (all in {run.cfg.run_dir / 'samples.jsonl'}):\n{samples.console_text(rows)}",
              flush=True)


def update_phase(run: Run, step: int, batch: TokenBatch, scored: dict, advantages, returns, m: dict) -> None:
    """The optimizer step(s) of this batch, then the LR schedule."""
    m["train/lr"] = run.scheduler.get_last_lr()[0]
    if _updates(run.cfg) == 1 and run.value_head is None and run.behaviour is None:
        m["train/grad_norm"] = run.update()  # the gradient is already there (score_phase)
    else:
        critic = {} if run.value_head is None else {"value_head": run.value_head, "old_values": scored["values"],
                                                     "returns": returns}
        current: dict = {}
        m.update(_several_updates(run.model, batch, advantages, scored["train_logprobs"], run.cfg, step, run.backward,
                                  run.update, dp=run.dp, exact=run.exact, current=current, **critic))
        if run.behaviour is not None and "train_logprobs" in current:  # off-policy batch, one update
            c = current["train_logprobs"].shape[1]
            m.update(run.dp.pooled_parity(current["train_logprobs"], scored["train_logprobs"][:, :c],
                                          batch.mask[:, :c], prefix="staleness/"))
    run.scheduler.step()


def sync_phase(run: Run, step: int, m: dict) -> None:
    """Push the updated weights into the engine, then probe it."""
    t = time.perf_counter()
    run.prefetch.wait()  # the next batch must come from the weights it was launched with
    m["perf/prefetch_wait_s"] = time.perf_counter() - t
    if run.cfg.rollout.sync_weights:
        m.update(_sync(run))
    m["perf/sync_s"] = time.perf_counter() - t
    if run.probe.prompt_ids and due(run.cfg, step):
        t = time.perf_counter()
        m.update(run.probe(run.engine, run.model))
        m["perf/probe_s"] = time.perf_counter() - t


def _sync(run: Run) -> dict:
    # Every rank leaves together: with a shared server rank 0 pushes while the others
    # wait for it before their next generate; a failed push stops every rank.
    out, error = {}, None
    try:
        out = sync_weights(run.engine, run.policy, run.cfg.precision.recipe, gather=run.gather,
                           dtype=getattr(torch, run.cfg.model.dtype), chunk_bytes=run.cfg.rollout.sync_chunk_bytes)
    except Exception as e:  # noqa: BLE001 - re-raised by raise_together on this rank
        error = e
    run.dp.raise_together(error)
    return out


def _warn_truncation(run: Run, step: int, m: dict) -> None:
    msg = run.truncation.check(step, m.get("rollout/frac_truncated"), run.cfg.rollout.max_new_tokens)
    if msg and run.is_main:
        print(msg, flush=True)


def checkpoint_phase(run: Run, step: int, result: TrainResult) -> None:
    cfg = run.cfg
    every = cfg.checkpoint.every
    if not ((every and step % every == 0) or step == cfg.train.steps):
        return
    save_step(run, step, result)


def _run_state(run: Run) -> dict:
    """What a checkpoint keeps besides weights, optimizer, scheduler and RNG."""
    return {"batcher": run.batcher.state_dict(), "name": run.cfg.name, "probe": run.probe.state_dict(),
            "prefetch": run.prefetch.state_dict(), "tokens_seen": run.tokens_seen,
            **({"kl_controller": run.kl_controller.state_dict()} if run.kl_controller else {})}


def save_step(run: Run, step: int, result: TrainResult, state: Optional[dict] = None) -> Path:
    """The checkpoint of ``step``; ``state``: ``_run_state`` as it was after that step (default: now)."""
    cfg = run.cfg
    state = _run_state(run) if state is None else state
    rngs = run.dp.gather_objects(ckpt.rng_state())  # collective: every rank's generators into rng.pt
    if run.stage:  # every rank writes its ZeRO shard
        result.final_checkpoint = ckpt.save_deepspeed_checkpoint(
            cfg.run_dir, step, engine=run.model, policy=run.policy, scheduler=run.scheduler, state=state,
            keep_last=cfg.checkpoint.keep_last, is_main=run.is_main, barrier=run.accelerator.wait_for_everyone,
            rng_states=rngs)
    elif run.is_main:
        result.final_checkpoint = ckpt.save_checkpoint(
            cfg.run_dir, step, model=run.policy, optimizer=run.optimizer, scheduler=run.scheduler, state=state,
            keep_last=cfg.checkpoint.keep_last, modules=run.modules, rng_states=rngs)
    run.accelerator.wait_for_everyone()
    return result.final_checkpoint


def _stop_if_preempted(run: Run, preemption: Preemption, step: int) -> None:
    signum = preemption.requested(run.dp)
    if signum is not None and step < run.cfg.train.steps:
        raise Preempted(f"{signal.Signals(signum).name} after step {step} of {run.cfg.train.steps}", signum)


def _print_summary(result: TrainResult, logger: RunLogger) -> None:
    h = result.history
    if not h or not logger.enabled:
        return
    k = max(1, min(5, len(h) // 4))
    first = _mean([r["reward/mean"] for r in h[:k]])
    last = _mean([r["reward/mean"] for r in h[-k:]])
    mae = _mean([r["parity/mae"] for r in h if "parity/mae" in r])
    kl = _mean([r["parity/kl_k3"] for r in h if "parity/kl_k3" in r])
    worst = max((r.get("parity/max_abs", 0.0) for r in h), default=0.0)
    summary = {"summary/reward_first": first, "summary/reward_last": last, "summary/parity_mae_mean": mae,
               "summary/parity_kl_k3_mean": kl}
    logger.summary(summary)
    print("\n=== parityrl run summary ===")
    print(f"reward   first {k} step(s): {first:.3f}   last {k} step(s): {last:.3f}   change {last - first:+.3f}")
    print(f"parity   mean |d| over the run: {mae:.2e}   mean kl_k3: {kl:.2e}   worst token |d|: {worst:.2e}")
    print(f"checkpoint  {result.final_checkpoint}")
    print(f"metrics     {logger.metrics_path}")
    print(f"wandb       {logger.wandb_location}")
