"""The RL step loop: rollout -> reward -> advantages -> forward/loss/backward -> step -> weight sync.

Read ``train`` top to bottom: ``setup``, then one named function per phase of a step
(rollout, score + advantages, parity, update, sync + probe, log, checkpoint). The
algorithm is the record ``algorithm.name`` selects (``trainer.algorithms.ALGORITHMS``); the
loop never branches on its name, only on the record's capabilities: a learned critic
(values and reference log-probs are scored before its advantages exist,
``trainer/rl/critic.py``), a reference policy (``uses_reference``), and several optimizer steps
per rollout batch (pi_old is scored once first, ``trainer.rl.update.score_pass``).

The phases share the run's record (``Run``, trainer/rl/run.py) and hand each other typed records: the sampling
round's ``Drawn`` (trainer/sampling/drawn.py), the trainer's ``Scores`` (trainer/measurement/scoring.py); the
update passes live in trainer/rl/update.py. How a batch is drawn is ``trainer.sampling``'s, how it is measured
``trainer.measurement``'s, the run's start, stops and end ``trainer.lifecycle``'s (docs/architecture.md).
"""
from __future__ import annotations

import math
import signal
import time
from pathlib import Path
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from parity.metrics import compare_by_turn, finalize, log10_abs_histogram, turn_index
from rollout.adapters import lora_leaves
from rollout.base import EngineUnavailable
from rollout.weight_export import merged_lora_weights  # noqa: F401  (fail on a broken install before the engine starts)
from trainer.algorithms import AdvantageInputs, add_distillation, distill_rewards
from trainer.builtin.resolve import resolve_model_path
from trainer.config import RecipeError, RunConfig, to_dict
from trainer.config.validate import sequence_length
from trainer.data.datasets import PromptBatcher, apply_prompt_budget, load_prompt_dataset
from trainer.distributed.cpu_threads import apply_cpu_threads, update_threads
from trainer.distributed.data_parallel import DataParallel
from trainer.distributed.deepspeed import accelerator_kwargs, deepspeed_stage, make_backward, zero3_gather
from trainer.distributed.launch_info import launch_lines
from trainer.environments.episode_environment import EpisodeEnvironment, reward_sources
from trainer.io import checkpoint as ckpt, third_party_output
from trainer.io.run_logger import RunLogger
from trainer.lifecycle import samples_table
from trainer.lifecycle.preemption import Preemption
from trainer.lifecycle.run_state import (
    check_run_dir,
    choose_checkpoint,
    claim_run_dir,
    record_recipe,
    refuse_existing_run,
)
from trainer.lifecycle.stops import (
    CheckpointFailed,
    Preempted,
    RunStopped,
    StepBoundary,
    checkpoint_on_stop,
    claim_together,
    stop_together,
)
from trainer.lifecycle.summary import print_summary
from trainer.measurement.correction_report import correction_report
from trainer.measurement.evaluation import BestCheckpoint, Evaluator
from trainer.measurement.merge_cost import MergeCost
from trainer.measurement.parity_breakdown import append_breakdown, routing_by_layer, step_breakdown, wandb_tables
from trainer.measurement.parity_limits import enforce_parity_limits, ratio_limit_for
from trainer.measurement.probe import Probe, due, probe_prompts
from trainer.measurement.routing_parity import (
    check_engine_routes,
    install_routing,
    pooled_routing_metrics,
    replay_paused,
    with_routes,
)
from trainer.measurement.sampled_support import kept_metrics
from trainer.measurement.scoring import Scores, check_engine_logprobs
from trainer.measurement.staleness import lag_histogram, stale_kv_metrics, staleness_metrics
from trainer.models.batch import TokenBatch, batch_from_rollouts
from trainer.models.exact import ExactLogprobs
from trainer.models.memory import peak_memory_gb
from trainer.models.optim import make_scheduler
from trainer.models.policy import load_tokenizer
from trainer.models.precision import fp8_weight_quantizations
from trainer.off_policy.by_version import score_by_version, versions_present
from trainer.precision import recipe_for
from trainer.precision.checks import check_launch, check_model_config
from trainer.precision.float32_backward_gemms import with_float32_backward_gemms
from trainer.rewards.sources import build_reward_sources
from trainer.rl.critic import NegativeKLWatch, make_kl_controller, ppo_targets
from trainer.rl.learner import load_policy, prepare_policy
from trainer.rl.run import Run, TrainResult
from trainer.rl.update import policy_gradient_pass, score_pass, scores_first, several_updates, updates_per_batch
from trainer.rl.value_head import ValueHead
from trainer.sampling.async_prefetch import behaviour_weights, snapshot
from trainer.sampling.drawn import Drawn
from trainer.sampling.dynamic_sampling import fill_with_signal
from trainer.sampling.engines import make_engine
from trainer.sampling.in_flight import InFlight
from trainer.sampling.policy_sync import policy_sync
from trainer.sampling.sampler import drawn_metrics
from trainer.teacher.teacher import Teacher
from trainer.vision.parity import image_split_metrics
from trainer.vision.pixels import samples_vision_batch
from trainer.vision.prompts import check_prompt_rows, vision_prompts


def train(cfg: RunConfig, *, resume: bool = False, engine=None) -> TrainResult:
    """Run ``cfg`` to ``cfg.train.steps``. ``engine``: an already-started engine to reuse (tests share one)."""
    check_run_dir(cfg, resume=resume)  # before the lock and any load: a refused start reads and creates nothing
    # The process group first (a launch of N): a refusal of the lock on rank 0 then ends every rank.
    accelerator = Accelerator(**accelerator_kwargs())
    # one writer per run directory (trainer/lifecycle/run_state.py)
    lock = claim_together(DataParallel.current(), lambda: claim_run_dir(cfg, resume=resume))
    try:
        run = setup(cfg, resume=resume, engine=engine, accelerator=accelerator)
    except BaseException:
        lock.release()
        raise
    result = TrainResult(run_dir=cfg.run_dir)
    boundary = StepBoundary()
    boundary.begin(run.start_step + 1, _run_state(run))
    preemption = Preemption(announce=run.is_main).install()
    unlogged = None  # (step, metrics) of a step whose update is applied but whose record is not written yet
    try:
        probe_before_training(run, evaluate_before_training(run))
        for step in range(run.start_step + 1, cfg.train.steps + 1):
            boundary.begin(step, _run_state(run))
            t_step = time.perf_counter()
            drawn, m = rollout_phase(run, step)
            run.engine.release_memory()  # the update has the GPU to itself; the sync wakes the engine (CUDA)
            batch = with_routes(run.routing, run.engine, batch_from_rollouts(drawn.rollouts, run.tokenizer.pad_token_id, run.device))
            if drawn.pixels:  # the images the engine consumed, by the trainer's processor (trainer/vision/)
                batch.vision = samples_vision_batch(drawn.pixels, drawn.rollouts.group_size, len(batch),
                                                    run.vision.image_token_id).to(run.device)
            check_engine_logprobs(batch.rollout_logprobs, batch.mask, run.dp)
            rewards = torch.tensor(drawn.rewards, dtype=torch.float32, device=run.device)
            # with a teacher (on-policy distillation): its log-probs of the sampled ids, distill/* and teacher_parity/*
            teacher_lp = None if run.teacher is None else run.teacher.score_step(step, drawn.rollouts, batch, m)
            t, t_line = time.perf_counter(), run.timeline.now()
            with update_threads(cfg.train.update_cpu_threads):
                scored, advantages, returns = score_phase(run, step, batch, rewards, m, teacher_lp)
                tables = correction_phase(run, step, batch, scored, advantages, m)
                parity_phase(run, step, batch, scored, m, tables)
                samples_phase(run, step, drawn, batch, scored)
                update_phase(run, step, batch, scored, advantages, returns, m)
            run.tokens_seen += m["parity/num_tokens"]  # the batch's completion tokens, pooled over ranks
            m["train/tokens_seen"] = run.tokens_seen  # a wandb x-axis
            boundary.update_applied()
            unlogged = (step, m)
            m["perf/train_s"] = time.perf_counter() - t
            run.timeline.add("train", step, step - 1, t_line, run.timeline.now())
            run.timeline.timed("sync", step, step, sync_phase, run, step, m)
            # the step without its held-out evaluation (perf/eval_s), which benchmarks of steps must not time
            m["perf/step_s"] = time.perf_counter() - t_step
            run.timeline.timed("eval", step, step, eval_phase, run, step, m)
            m["perf/peak_memory_gb"] = peak_memory_gb(run.device)  # the run's peak so far (GiB; CPU: RSS)
            quantized = fp8_weight_quantizations(run.policy, reset=True)
            if quantized:  # only the real FP8 GEMM layers keep a weight cache (precision fp8_unified on CUDA)
                m["perf/fp8_weight_quantizations"] = quantized
            with run.records.writing(run.logger.metrics_path, step):
                run.logger.log(step, m)
            unlogged = None
            run.records.raise_together(run.dp)
            warnings = (run.truncation.check(step, m.get("rollout/frac_truncated"), cfg.rollout.max_new_tokens),
                        run.tool_use.check(step, m.get("episode/tool_calls") if cfg.env.tools else None))
            for warning in warnings if run.is_main else ():
                if warning:
                    print(warning, flush=True)
            result.history.append({"step": step, **m})
            # After logging (the step's record keeps the probe values), before the checkpoint.
            enforce_parity_limits(cfg, step, m, prefix="probe/", when=" (probe after the weight sync)",
                                   ratio=run.ratio_limit)
            checkpoint_phase(run, step, result, m)
            _stop_if_preempted(run, preemption, step)
        result.wandb = run.logger.wandb_location
        print_summary(result.history, result.final_checkpoint, run.logger, run.best)
    except (RunStopped, EngineUnavailable) as e:
        if unlogged is not None and boundary.applied:  # the stop checkpoints this step: its record goes with it
            with run.records.writing(run.logger.metrics_path, unlogged[0]):  # a failure here: the stop's error wins
                run.logger.log(*unlogged, echo=False)
        e.checkpoint_note = getattr(e, "checkpoint_note", None) or checkpoint_on_stop(
            cfg.run_dir, boundary, lambda s, state: save_step(run, s, result, state))
        raise
    finally:
        preemption.restore()
        if run.is_main:
            write_timeline(run)
        run.logger.close()
        if run.own_engine:
            run.engine.close()
        if run.teacher is not None:
            run.teacher.close()
        lock.release()
    return result


# ---------------------------------------------------------------- setup


def setup(cfg: RunConfig, *, resume: bool, engine=None, accelerator=None) -> Run:
    """Accelerator, policy (+ critic), data, rewards, optimizer, restored state, engine, logger."""
    accelerator = Accelerator(**accelerator_kwargs()) if accelerator is None else accelerator
    # DeepSpeed ZeRO-2/3 (accelerate config recipes/accelerate/zero{2,3}.yaml) or not (0).
    stage = deepspeed_stage(accelerator)
    # N processes: each holds a prompt shard and its own engine; gradients and metrics are
    # reduced explicitly (trainer/distributed/data_parallel.py explains why not DDP's wrapper), the
    # gradients by the DeepSpeed engine under ZeRO.
    dp = DataParallel.current(reduce_grads=not stage)
    precision = recipe_for(cfg.precision.recipe)
    check_launch(precision, stage=stage, world_size=dp.world)  # before the model loads (and is transformed)
    third_party_output.attach(cfg.run_dir, rank=dp.rank)  # the run directory is claimed: engine.log
    threads = apply_cpu_threads(cfg.train.cpu_threads, cfg.train.update_cpu_threads)  # before the engine starts
    if accelerator.is_main_process:
        print(launch_lines(cfg, dp.world, accelerator.device, precision.dtype_reason, threads), flush=True)
    set_seed(cfg.train.seed)
    model_dir = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(model_dir)
    environment = None
    if cfg.env.enabled:  # resolved and checked against the chat template before the model and the engine load
        environment = EpisodeEnvironment.from_config(cfg, f"recipe {cfg.name!r}")
        environment.check_template(tokenizer, cfg, f"recipe {cfg.name!r}")
        if accelerator.is_main_process and reward_sources(cfg):
            print(reward_sources(cfg), flush=True)
    vision = vision_prompts(cfg, model_dir)  # the data's images and the model agree, before the model loads
    model = load_policy(cfg, accelerator, model_dir)
    if cfg.rollout.max_staleness and dp.world > 1:
        raise RecipeError(f"rollout.max_staleness = {cfg.rollout.max_staleness} with {dp.world} processes: expected "
                          "one process (the prefetch of several ranks sharing a server is not synchronised yet)")
    check_model_config(precision, model.config)  # before the engine starts
    routing = install_routing(cfg, model)
    d = cfg.data
    dataset = load_prompt_dataset(d.source, split=d.split, prompt_column=d.prompt_column, answer_column=d.answer_column,
                                  num_examples=d.num_examples, seed=cfg.train.seed, builtin_kwargs=d.builtin_kwargs)
    dataset = apply_prompt_budget(dataset, tokenizer, d, verbose=accelerator.is_main_process)  # before the engine
    batcher = PromptBatcher(dataset, cfg.rollout.prompts_per_step, seed=cfg.train.seed)
    # the held-out rows, checked against the training prompts before the engine starts
    evaluator = Evaluator.from_config(cfg, dp, tokenizer, dataset)
    if vision is not None:  # every prompt with its images expanded, training and held-out, before the engine
        check_prompt_rows(vision, dataset, f"data.source = {d.source!r}")
        if evaluator is not None:
            check_prompt_rows(vision, evaluator.rows, f"eval.source = {cfg.eval.source or d.source!r}")
    # Rule functions and reward models (trainer/rewards/), each logged as reward/<name>.
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
    model, optimizer, policy = prepare_policy(cfg, accelerator, stage, model, optimizer, value_head)
    run = Run(cfg=cfg, accelerator=accelerator, stage=stage, dp=dp, model_dir=model_dir, tokenizer=tokenizer,
              model=model, policy=policy, value_head=value_head, optimizer=optimizer, scheduler=scheduler,
              params=params,
              backward=with_float32_backward_gemms(make_backward(accelerator, model), cfg.model.dtype,
                                                   accelerator.device),
              # Under ZeRO-3 the export gathers one module at a time on every rank (a collective).
              gather=zero3_gather(policy) if stage == 3 else None, dataset=dataset, batcher=batcher,
              reward_fns=reward_fns, kl_controller=kl_controller, kl_watch=kl_watch, modules=modules,
              environment=environment, evaluator=evaluator, best=BestCheckpoint.from_config(cfg), routing=routing,
              vision=vision)
    probe_ids, probe_images = probe_prompts(cfg, dataset, tokenizer, vision)
    run.probe = Probe(probe_ids, cfg, pad_id=tokenizer.pad_token_id, device=accelerator.device, dp=dp,
                      images=probe_images)
    run.ratio_limit = ratio_limit_for(cfg)
    run.start_step = _restore(run) if resume else refuse_existing_run(cfg)
    record_recipe(run, resumed=resume)
    # on-policy distillation's teacher (trainer/teacher/), checked against the student before either engine starts
    run.teacher = Teacher.from_config(cfg, model_dir, dp=dp, device=accelerator.device,
                                      max_model_len=sequence_length(cfg), where=f"recipe {cfg.name!r}")
    run.own_engine = engine is None
    run.engine = engine if engine is not None else make_engine(
        cfg, model_dir, max_model_len=sequence_length(cfg), dp=dp, return_routes=routing != "off",
        lora_targets=lora_leaves(policy))
    if routing != "off":
        check_engine_routes(run.engine, run.model)
    if precision.engine_logprobs:
        run.exact = run.probe.exact = ExactLogprobs(run.engine, policy, getattr(torch, cfg.model.dtype))
    run.sync = policy_sync(cfg, run.engine, policy, dp, gather=run.gather, announce=run.is_main, model_dir=model_dir)
    # an FP8 engine (the record's block_fp8_on_cuda: block-FP8 layers on CUDA, their emulation by the same quantizer on
    # CPU) multiplies by the block-FP8 values of what the sync sends: the merge's cost is measured there
    run.merge_cost = MergeCost(policy, getattr(torch, cfg.model.dtype), gather=run.gather,
                               fp8=precision.block_fp8_on_cuda)
    # Always align the engine with the policy being trained (fresh adapter = base weights,
    # resumed adapter = its weights), so a reused engine never carries another run's weights.
    run.sync(run.engine)
    if cfg.rollout.in_flight != "off":  # weight updates while the launched batches generate (trainer/sampling/in_flight.py)
        run.in_flight = InFlight(cfg.rollout.in_flight)
        run.in_flight.pushed(run.engine, run.start_step)
    run.logger = RunLogger(cfg.run_dir, config=to_dict(cfg), wandb_mode=cfg.logging.wandb.mode,
                           project=cfg.logging.wandb.project, entity=cfg.logging.wandb.entity, name=cfg.name,
                           total_steps=cfg.train.steps, print_every=cfg.logging.print_every, enabled=run.is_main,
                           resume=resume, tags=run_tags(cfg), resumed_step=run.start_step if resume else None)
    return run


def run_tags(cfg: RunConfig) -> tuple[str, ...]:
    """wandb tags, so that runs of one model compare side by side by algorithm and precision recipe."""
    return (f"algorithm:{cfg.algorithm.name}", f"precision:{cfg.precision.recipe}", f"model:{cfg.model.path}",
            f"dtype:{cfg.model.dtype}") + (("off-policy",) if cfg.rollout.max_staleness else ())


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
    run.ratio_limit.load_state_dict(state.get("parity_limit"))
    run.prefetch.load_state_dict(state.get("prefetch"))
    run.tokens_seen = float(state.get("tokens_seen", 0.0))  # older checkpoints: counted from the resume
    run.best.load_state_dict(state.get("best"))
    if run.is_main:
        print(f"resumed from {latest} (step {state['step']})", flush=True)
    return state["step"]


def probe_before_training(run: Run, evaluated: Optional[dict] = None) -> None:
    """The engine must already agree with the trainer before the first step (or the first after a resume).
    ``evaluated``: the held-out evaluation before step 1, logged in the same step-0 record."""
    m0 = run.probe(run.engine, run.model)
    if not m0:
        if evaluated and run.is_main:
            run.logger.log(0, evaluated, echo=False)
        return
    if run.is_main:
        print(f"probe before step {run.start_step + 1}: mae {m0.get('probe/mae', float('nan')):.2e}  "
              f"kl_k3 {m0.get('probe/kl_k3', float('nan')):.1e}  on {int(m0['probe/num_tokens'])} tokens", flush=True)
        if run.start_step == 0:  # a resumed run has logged this step already; wandb steps only increase
            run.logger.log(0, {**m0, **(evaluated or {})}, echo=False)
    # every rank sees the same pooled values and stops together
    enforce_parity_limits(run.cfg, run.start_step, m0, prefix="probe/", when=" (probe before training)",
                           ratio=run.ratio_limit, start=True)


# ---------------------------------------------------------------- the phases of a step


def rollout_phase(run: Run, step: int) -> tuple[Drawn, dict]:
    """Generate and score this step's groups: (the part trained on, rollout and reward metrics of all drawn)."""
    cfg, a, m = run.cfg, run.cfg.algorithm, {}
    sampler = run.sampler
    taken = run.prefetch.take(step)
    run.behaviour, run.behaviours, run.lag = None, {}, 0
    if taken is not None:  # generated during an earlier step, by the adapter it was launched with
        train_part, run.behaviour, run.lag = taken.drawn, taken.behaviour, step - 1 - taken.version
        run.behaviours = taken.behaviours  # in flight: its tokens' versions may be newer (score_phase)
        drawn = [train_part]
    elif a.dynamic_sampling:  # DAPO: keep groups with signal, draw more to refill
        train_part, drawn, ds_metrics = fill_with_signal(
            lambda round_index: run.timeline.timed("generate", step, step - 1, sampler.draw, step, round_index),
            share=cfg.rollout.prompts_per_step // run.dp.world, group_size=a.group_size, mini_batches=a.mini_batches,
            max_rounds=a.max_sampling_rounds, dp=run.dp)
        m.update(ds_metrics)
    else:
        train_part = run.timeline.timed("generate", step, step - 1, sampler.draw, step)
        if run.in_flight is not None:  # the engine's versions as policy versions, as for a prefetched batch
            train_part = run.in_flight.mapped(train_part)
        drawn = [train_part]
    m.update(drawn_metrics(Drawn.concat(drawn), run.dp))
    launch = run.prefetch.missing(step, cfg.rollout.max_staleness)
    if launch:
        # The engine still holds theta_{step-1}: the batches up to step + k are launched with it now (the first
        # step launches k, every later one the batch of step + k), and trained on after this step's update.
        # Server mode overlaps them with this step (a thread; another process). Also near the last step: the
        # final checkpoint then holds them, so the run can be extended exactly.
        def draw(s: int) -> Drawn:
            drawn = run.timeline.timed("generate", s, step - 1, sampler.draw, s)
            # in flight, the tokens' engine versions as policy versions the moment the batch is complete
            return drawn if run.in_flight is None else run.in_flight.mapped(drawn)

        run.prefetch.launch(launch, draw, snapshot(run.policy), version=step - 1,
                            threaded=cfg.rollout.mode == "server")
    return train_part, m


def score_phase(run: Run, step: int, batch: TokenBatch, rewards: torch.Tensor,
                m: dict, teacher_lp: Optional[torch.Tensor] = None) -> tuple[Scores, torch.Tensor, Optional[torch.Tensor]]:
    """(trainer scores of the batch, advantages, returns or None).

    ``teacher_lp``: a teacher's log-probs of the sampled ids: the per-token distillation reward (the student's
    side is its engine's log-probs, those it sampled with: trainer/algorithms/distill.py) goes to the record's
    advantage (a record with ``teacher``) and, times ``algorithm.distill_coef``, onto the task advantages (a
    critic's: onto each token's reward before GAE, ``ppo_targets``).

    The single on-policy update of a critic-free algorithm does its forward/backward here
    (``policy_gradient_pass``): its detached log-probs are the scores, no extra forward. With
    several updates the batch is scored once first (pi_old); a critic's advantages need the
    batch's values and reference log-probs before anything else.
    """
    cfg, a, learner = run.cfg, run.cfg.algorithm, run.learner
    run.model.train()
    distill = None if teacher_lp is None else distill_rewards(batch.rollout_logprobs, teacher_lp, batch.mask)
    if run.value_head is not None:
        scored = score_pass(learner, batch, reference=True)
        advantages, returns, critic_metrics = ppo_targets(scored, rewards, batch.mask, a.group_size, cfg,
                                                          run.kl_controller, all_sum=run.dp.all_sum, distill=distill)
        critic_metrics = run.dp.mean_metrics(critic_metrics)
        m.update(critic_metrics)
        run.kl_watch.update(step, critic_metrics["train/kl_ref"])
        return scored, advantages, returns
    advantages = a.record.advantage(AdvantageInputs(rewards=rewards, mask=batch.mask, group_size=a.group_size,
                                                    token_rewards=distill, all_sum=run.dp.all_sum), a.options)
    if a.distill_coef:
        advantages = add_distillation(advantages, distill, batch.mask, a.distill_coef)
    run.proximal = None
    if run.behaviour is not None:
        # An off-policy batch: pi_old is its behaviour adapter (parity/* = engine vs it: numerics only);
        # staleness/* = behaviour vs the current adapter (policy lag only). The update's ratios are against
        # the objective's anchor (algorithm.off_policy: trainer/off_policy/).
        scored = behaviour_pass(run, step, batch)
        # one update with the behaviour anchor: its own forward gives pi_theta (update_phase), no extra pass
        if updates_per_batch(cfg) > 1 or a.off_policy_record.weight is not None:
            run.proximal = score_pass(learner, batch)
            m.update(staleness_metrics(run.dp, run.proximal.logprobs, scored.logprobs, batch.mask, run.lag))
        return scored, advantages, None
    if not scores_first(cfg):
        scored, metrics = policy_gradient_pass(learner, batch, advantages)
        m.update(metrics)
    else:
        scored = score_pass(learner, batch)  # pi_old, before any update
    # on-policy: the behaviour policy is the current one, by construction no lag
    m.update(staleness_metrics(run.dp, scored.logprobs, scored.logprobs, batch.mask,
                               0 if cfg.rollout.max_staleness else None))
    return scored, advantages, None


def behaviour_pass(run: Run, step: int, batch: TokenBatch) -> Scores:
    """The trainer's scores of an off-policy batch under the weights that sampled it: its launch adapter, or with
    in-flight updates each token's own version (one pass per version; the step's lag becomes per token)."""
    if batch.versions is None:
        with behaviour_weights(run.policy, run.behaviour):
            return score_pass(run.learner, batch)
    missing = [v for v in versions_present(batch.versions, batch.mask) if v not in run.behaviours]
    if missing:
        raise RuntimeError(f"step {step}: tokens of policy versions {missing} have no behaviour snapshot (held: "
                           f"{sorted(run.behaviours)})")
    run.lag = (step - 1) - batch.versions
    if run.is_main:
        run.logger.log_histogram(step, "staleness/lag_hist", *lag_histogram(run.lag, batch.mask))
    return score_by_version(lambda: score_pass(run.learner, batch),
                            lambda v: behaviour_weights(run.policy, run.behaviours[v]), batch.versions, batch.mask)


def breakdown_step(cfg: RunConfig, step: int) -> bool:
    """Whether this step's tables go to wandb (and the shadow table is computed): every ``breakdown_every``, the last."""
    return step % cfg.logging.breakdown_every == 0 or step == cfg.train.steps


def correction_phase(run: Run, step: int, batch: TokenBatch, scored: Scores, advantages: torch.Tensor,
                     m: dict) -> dict:
    """``correction/*``: the raw pi_old / engine ratios and what the recipe's correction did to them (the weights the
    update used), its per-bucket tables and, on breakdown steps with ``parity.correction.shadow``, every rule's
    weights on the same batch (trainer/measurement/correction_report.py). Returns the tables for the breakdown."""
    correction = run.cfg.parity.correction
    metrics, tables = correction_report(correction, batch, scored, advantages, run.dp,
                                        shadow=correction.shadow and breakdown_step(run.cfg, step),
                                        by_turn=run.environment is not None)
    m.update(metrics)
    return tables


def parity_phase(run: Run, step: int, batch: TokenBatch, scored: Scores, m: dict,
                 tables: Optional[dict] = None) -> None:
    """pi_old vs the engine on the sampled tokens: ``parity/*``, the limits, the breakdown tables (with ``tables``,
    the correction's).

    The train log-probs are from the pre-update policy, the one that generated the rollouts
    (if the previous sync worked): this is what the metrics measure.
    """
    cfg = run.cfg
    mask = batch.mask
    if batch.stale_kv is not None:
        # in_flight keep: a token sampled over older weights' KV differs from the trainer's one-version forward by
        # more than numerics; measured apart (trainer/sampling/in_flight.py), parity/* keeps the rest
        m.update(stale_kv_metrics(run.dp, scored.logprobs, batch.rollout_logprobs, batch.mask, batch.stale_kv))
        mask = batch.mask * (1 - batch.stale_kv)
    stats = run.dp.pooled_stats(scored.logprobs, batch.rollout_logprobs, mask, train_topk_logprobs=scored.topk,
                                rollout_topk_logprobs=batch.topk_logprobs)
    m.update(finalize(stats))
    if scored.routing is not None:
        m.update(pooled_routing_metrics(scored.routing, run.dp))
        unreplayed_phase(run, step, batch, m)
    if batch.vision is not None:  # the samples with images apart from the text-only ones
        m.update(image_split_metrics(run.dp, scored.logprobs, batch.rollout_logprobs, mask, batch.vision.per_row))
    if scored.kept is not None:  # truncated sampling: the trainer's mass inside the engine's kept sets
        m.update(kept_metrics(scored.kept, batch, run.dp))
    if run.environment is not None:  # episodes: the same measures per assistant turn, pooled over ranks
        turns = int(run.dp.max_metrics({"t": float(turn_index(batch.mask).max()) if batch.mask.numel() else 0.0})["t"])
        m.update(compare_by_turn(scored.logprobs, batch.rollout_logprobs, batch.mask, turns,
                                 stats=run.dp.pooled_stats))
    if run.is_main:  # the shape of the mismatch: the pooled |d| histogram the p99 was read from, no extra pass
        run.logger.log_histogram(step, "parity/log10_abs_d", *log10_abs_histogram(stats["abs_d_hist"]))
    if "train/entropy" not in m:  # the trainer's entropy of the sampled positions (PPO's loss logs its own)
        e = run.dp.sum_metrics({"s": float((scored.entropy * batch.mask).sum()), "n": float(batch.mask.sum())})
        m["train/entropy"] = e["s"] / max(e["n"], 1.0)
    enforce_parity_limits(cfg, step, m, ratio=run.ratio_limit)
    if run.is_main:
        breakdown = step_breakdown(scored.logprobs, batch.rollout_logprobs, batch.mask, batch.targets,
                                   run.tokenizer, entropy=scored.entropy, by_turn=run.environment is not None)
        if scored.routing is not None:
            breakdown["routing_by_layer"] = routing_by_layer(m)
        breakdown.update(tables or {})
        with run.records.writing(cfg.run_dir / "parity_breakdown.jsonl", step):
            append_breakdown(cfg.run_dir, step, breakdown)
        if run.logger.wandb_run is not None and breakdown_step(cfg, step):
            run.logger.wandb_run.log(wandb_tables(breakdown), step=step)


def unreplayed_phase(run: Run, step: int, batch: TokenBatch, m: dict) -> None:
    """With replay, on the run's first step and every ``parity.unreplayed_every``-th: the batch scored once more
    with the trainer's routers choosing (``parity/unreplayed/*``): the mismatch replay removes."""
    every = run.cfg.parity.unreplayed_every
    if run.routing != "replay" or not every or not (step == run.start_step + 1 or step % every == 0):
        return
    # the policy the step's parity/* measured: an off-policy batch's behaviour adapter (a no-op on-policy)
    with behaviour_weights(run.policy, run.behaviour), replay_paused(run.model):
        own = score_pass(run.learner, batch)
    m.update(run.dp.pooled_parity(own.logprobs, batch.rollout_logprobs, batch.mask, prefix="parity/unreplayed/"))
    m.update(pooled_routing_metrics(own.routing, run.dp, prefix="parity/unreplayed/"))


def samples_phase(run: Run, step: int, drawn: Drawn, batch: TokenBatch, scored: Scores) -> None:
    """The samples table (trainer/lifecycle/samples_table.py) at the run's first step and every ``samples_every`` steps."""
    lg = run.cfg.logging
    first = step == run.start_step + 1
    if not run.is_main or not lg.samples_every or not (first or step % lg.samples_every == 0):
        return
    rows = samples_table.sample_rows(drawn, batch, scored.logprobs, run.tokenizer, lg.samples_per_step)
    with run.records.writing(run.cfg.run_dir / samples_table.SAMPLES_FILE, step):
        samples_table.append_samples(run.cfg.run_dir, step, rows)
    if run.logger.wandb_run is not None:
        column = run.cfg.data.image_column
        images = samples_table.row_image_lists(drawn, column, lg.samples_per_step) if column else None
        run.logger.wandb_run.log({"samples": samples_table.wandb_table(rows, images)}, step=step)
    if first:
        if run.environment is not None:  # was the tool offered? the template's rendering, once
            print(f"the first prompt as the model reads it:\n{samples_table.rendered_prompt(drawn, run.tokenizer)}")
        print(f"samples of step {step} (all in {run.cfg.run_dir / 'samples.jsonl'}):\n{samples_table.console_text(rows)}",
              flush=True)


def update_phase(run: Run, step: int, batch: TokenBatch, scored: Scores, advantages: torch.Tensor,
                 returns: Optional[torch.Tensor], m: dict) -> None:
    """The optimizer step(s) of this batch, then the LR schedule."""
    m["train/lr"] = run.scheduler.get_last_lr()[0]
    one_update = updates_per_batch(run.cfg) == 1
    if not scores_first(run.cfg) and run.value_head is None and run.behaviour is None:
        m["train/grad_norm"] = run.update()  # the gradient is already there (score_phase)
        m["train/skipped_updates"] = float(not math.isfinite(m["train/grad_norm"]))
    else:
        anchor, weights = off_policy_anchor(run, batch, scored, m)
        metrics, last = several_updates(run.learner, batch, advantages, anchor, step, returns=returns,
                                        numerics=scored, anchor_weights=weights)
        m.update(metrics)
        if run.behaviour is not None and one_update and run.proximal is None:  # pi_theta before its one step
            c = last.logprobs.shape[1]
            lag = run.lag[:, :c] if isinstance(run.lag, torch.Tensor) else run.lag
            m.update(staleness_metrics(run.dp, last.logprobs, scored.logprobs[:, :c], batch.mask[:, :c], lag))
    run.scheduler.step()


def off_policy_anchor(run: Run, batch: TokenBatch, scored: Scores, m: dict) -> tuple[Scores, Optional[torch.Tensor]]:
    """(the scores the update's ratios are taken against, their per-token weights or None): the behaviour pass
    ``scored`` on-policy and under ``behaviour_clip``; pi_prox with the weights pi_prox / pi_behaviour under
    ``decoupled``; the behaviour pass with M2PO's 0/1 mask under ``m2po`` (trainer/off_policy/)."""
    objective = run.cfg.algorithm.off_policy_record
    if run.behaviour is None or objective.weight is None:
        return scored, None
    weights, metrics = objective.weight(run.proximal.logprobs, scored.logprobs, batch.mask,
                                        getattr(run.cfg.algorithm, objective.parameter))
    m.update(metrics)
    return (run.proximal if objective.anchor == "proximal" else scored), weights


def write_timeline(run: Run) -> None:
    """The run's timeline (trainer/measurement/timeline.py) into its folder and, as an image, to wandb; each
    lane's busy share into wandb's summary. A failure here must not hide how the run ended."""
    try:
        fractions = run.timeline.busy_fractions()
        png = run.timeline.write(run.cfg.run_dir, f"{run.cfg.name}: rollout.max_staleness "
                                                  f"{run.cfg.rollout.max_staleness}, {run.cfg.rollout.mode} mode")
        run.logger.summary({f"timeline/{lane}_busy_frac": v for lane, v in fractions.items()})
        if png is not None:
            run.logger.log_image("timeline", png)
    except Exception as e:  # noqa: BLE001 - an OS or plotting failure: said, and the run's own outcome stands
        print(f"the run's timeline was not written: {type(e).__name__}: {e}", flush=True)


def sync_phase(run: Run, step: int, m: dict) -> None:
    """Push the updated weights into the engine, then probe it."""
    t = time.perf_counter()
    if run.in_flight is not None and run.cfg.rollout.sync_weights:
        # the launched generations go on under the new weights (trainer/sampling/in_flight.py): no wait
        m["perf/prefetch_wait_s"] = 0.0
        m.update(run.in_flight.sync(run.sync, run.engine, run.policy, run.prefetch, step))
    else:
        run.prefetch.wait()  # the next batch must come from the weights it was launched with
        m["perf/prefetch_wait_s"] = time.perf_counter() - t
        if run.cfg.rollout.sync_weights:
            m.update(run.sync(run.engine))
    m["perf/sync_s"] = time.perf_counter() - t
    m.update(run.merge_cost())  # what a merged sync loses of this update, in both modes
    warning = run.merge_cost.warning(step, m, run.sync.mode)
    if warning and run.is_main:
        print(warning, flush=True)
    if run.probe.prompt_ids and due(run.cfg, step):
        t = time.perf_counter()
        m.update(run.probe(run.engine, run.model))
        m["perf/probe_s"] = time.perf_counter() - t


def evaluate_before_training(run: Run) -> dict:
    """The held-out figures of the weights training starts from (step 0's record, with the probe's); a resumed
    run's schedule goes on from its step instead."""
    if run.evaluator is None or run.start_step != 0:
        return {}
    m = run.evaluator(run.sampler, run.model, 0, exact=run.exact)
    if run.is_main:
        print(run.evaluator.console_line(0, m), flush=True)
    run.best.update(0, m)  # the starting weights' figure is the one to beat (no checkpoint holds step 0)
    return m


def eval_phase(run: Run, step: int, m: dict) -> None:
    """The held-out evaluation of the weights the engine was just synced to, every eval.every steps and after the
    last (trainer/measurement/evaluation.py)."""
    if run.evaluator is None or not run.evaluator.due(step):
        return
    out = run.evaluator(run.sampler, run.model, step, exact=run.exact)
    if run.is_main:
        print(run.evaluator.console_line(step, out), flush=True)
    m.update(out)


def checkpoint_phase(run: Run, step: int, result: TrainResult, m: dict) -> None:
    """Every checkpoint.every steps, after the last, and at a new best of checkpoint.best_metric (kept besides
    keep_last: trainer/io/checkpoint.py)."""
    cfg = run.cfg
    every = cfg.checkpoint.every
    best = run.best.update(step, m)
    if best and run.is_main:
        print(f"best {run.best.metric} so far: {run.best.value:.4g} at step {step} (checkpoint kept)", flush=True)
    if not ((every and step % every == 0) or step == cfg.train.steps or best):
        return
    save_step(run, step, result)


def _run_state(run: Run) -> dict:
    """What a checkpoint keeps besides weights, optimizer, scheduler and RNG."""
    return {"batcher": run.batcher.state_dict(), "name": run.cfg.name, "probe": run.probe.state_dict(),
            "parity_limit": run.ratio_limit.state_dict(),
            "prefetch": run.prefetch.state_dict(), "tokens_seen": run.tokens_seen, "best": run.best.state_dict(),
            **({"kl_controller": run.kl_controller.state_dict()} if run.kl_controller else {})}


def save_step(run: Run, step: int, result: TrainResult, state: Optional[dict] = None) -> Path:
    """The checkpoint of ``step``; ``state``: ``_run_state`` as it was after that step (default: now)."""
    cfg = run.cfg
    state = _run_state(run) if state is None else state
    rngs = run.dp.gather_objects(ckpt.rng_state())  # collective: every rank's generators into rng.pt
    full = ckpt.no_room(cfg.run_dir, step) if run.is_main else None  # a full disk: every rank stops, nothing written
    stop_together(run.dp, CheckpointFailed(str(full)) if full else None)
    if run.stage:  # every rank writes its ZeRO shard
        result.final_checkpoint = ckpt.save_deepspeed_checkpoint(
            cfg.run_dir, step, engine=run.model, policy=run.policy, scheduler=run.scheduler, state=state,
            keep_last=cfg.checkpoint.keep_last, is_main=run.is_main, barrier=run.accelerator.wait_for_everyone,
            rng_states=rngs)
    else:
        error = None
        try:
            if run.is_main:
                result.final_checkpoint = ckpt.save_checkpoint(
                    cfg.run_dir, step, model=run.policy, optimizer=run.optimizer, scheduler=run.scheduler,
                    state=state, keep_last=cfg.checkpoint.keep_last, modules=run.modules, rng_states=rngs)
        except ckpt.CheckpointNotWritten as e:  # a full disk, ...: one line, exit status 6, on every rank
            error = CheckpointFailed(str(e))
            error.__cause__ = e
        stop_together(run.dp, error)
    run.accelerator.wait_for_everyone()
    return result.final_checkpoint


def _stop_if_preempted(run: Run, preemption: Preemption, step: int) -> None:
    signum = preemption.requested(run.dp)
    if signum is not None and step < run.cfg.train.steps:
        raise Preempted(f"{signal.Signals(signum).name} after step {step} of {run.cfg.train.steps}", signum)
