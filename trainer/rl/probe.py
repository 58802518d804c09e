"""The parity probe: a few fixed prompts generated and scored right after every weight sync.

The step's own parity metrics measure the engine that produced the step's rollouts,
i.e. the weights pushed one step earlier, on prompts that change every step. The
probe measures the weights *just* pushed, on the same prompts every time, with the
same sampling seed: a broken or partial sync shows up before the next rollout is
spent on it, and its values are comparable across the run (a trend in ``probe/mae``
is the policy drifting into regions where the two numerics disagree more, not a
change of prompts).

Cost: one engine call of ``parity.probe_prompts`` samples and one gradient-free
forward of them (about 0.02-0.05 s on the built-in task on 2 CPU cores).
"""
from __future__ import annotations

import torch

from rollout.types import SamplingSpec
from trainer.config import RunConfig
from trainer.distributed.data_parallel import DataParallel
from trainer.models.batch import batch_from_rollouts
from trainer.models.policy import completion_logprobs

# A fixed seed distinct from every step's (engines.sampling_spec uses seed * 1_000_003 + step).
PROBE_SEED = 0x5EED


def probe_spec(cfg: RunConfig) -> SamplingSpec:
    r = cfg.rollout
    return SamplingSpec(n=1, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                        seed=PROBE_SEED + cfg.train.seed, logprobs_topk=cfg.parity.topk)


def run_probe(engine, model, prompt_ids: list[list[int]], cfg: RunConfig, *, pad_id: int,
              device: torch.device | str, dp=None) -> dict[str, float]:
    """Generate one completion per probe prompt, score it with ``model``; ``probe/*`` parity metrics.

    Scored in eval mode without gradient; the model's train/eval mode is restored. With
    data parallel (``dp``), every rank probes its own engine on the same prompts and the
    metrics pool all ranks' tokens.
    """
    rollouts = engine.generate(prompt_ids, probe_spec(cfg))
    batch = batch_from_rollouts(rollouts, pad_id, device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            lp, _, *top = completion_logprobs(model, batch, temperature=cfg.rollout.temperature,
                                              chunk_size=cfg.parity.chunk_size, topk_ids=batch.topk_ids)
    finally:
        model.train(was_training)
    # One process: DataParallel() pools nothing, i.e. parity.metrics.compare with the probe/ prefix.
    return (dp or DataParallel()).pooled_parity(lp, batch.rollout_logprobs, batch.mask,
                                                train_topk_logprobs=top[0] if top else None,
                                                rollout_topk_logprobs=batch.topk_logprobs, prefix="probe/")
