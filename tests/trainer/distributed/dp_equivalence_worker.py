"""Worker for tests/trainer/distributed/test_data_parallel.py, launched with ``torchrun --nproc_per_node 2``.

One GRPO loss/backward on a fixed batch (no engine: completions and "rollout"
log-probs are built deterministically), split over the ranks with the loop's own
functions, against the single-process pass on the whole batch. Float32, so that the
batch composition (padding width, GEMM shapes) moves results by ~1e-7 only; in BF16
the same sequence scored in a differently padded batch differs by ~1e-3, which would
hide what is tested. Gradients are compared, not post-Adam weights: Adam's first step
is lr * sign(g) for |g| >> eps, so a gradient of +-1e-9 flips a weight by 2 lr.
Rank 0 writes the differences as JSON to argv[2] (not stdout, which both ranks share); the test asserts on them.
Usage: torchrun --nproc_per_node 2 dp_equivalence_worker.py <recipe.yaml> <result.json>
"""
import copy
import json
import os
import sys
from pathlib import Path

import torch


def fixed_batch(tokenizer, cfg, device):
    """8 prompts x group 4 of deterministic completions; rollout log-probs filled in later."""
    from rollout.types import Rollouts
    from trainer.data.datasets import encode_prompts, load_prompt_dataset

    ds = load_prompt_dataset("builtin:arithmetic", split="train", num_examples=8, seed=0)
    prompts = encode_prompts(tokenizer, [ds[i]["prompt"] for i in range(8)], use_chat_template=True,
                             max_prompt_tokens=64)
    g = torch.Generator().manual_seed(7)
    n = cfg.algorithm.group_size
    completions = [torch.randint(5, 500, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(8 * n)]
    return Rollouts(prompt_ids=[prompts[i // n] for i in range(8 * n)], completion_ids=completions,
                    rollout_logprobs=[[0.0] * len(c) for c in completions], finish_reasons=["length"] * (8 * n),
                    group_size=n)


def main() -> int:
    torch.distributed.init_process_group("gloo")
    from trainer.algorithms import ADVANTAGES, AdvantageInputs
    from trainer.builtin.resolve import resolve_model_path
    from trainer.distributed.data_parallel import DataParallel
    from trainer.lifecycle.preflight import load_recipe
    from trainer.models.batch import batch_from_rollouts
    from trainer.models.policy import add_lora, completion_logprobs, load_base_model, load_tokenizer
    from trainer.rl.learner import Learner
    from trainer.rl.update import policy_gradient_pass

    cfg = load_recipe(sys.argv[1], ["algorithm.group_size=4", "train.micro_batch_size=6"])
    dp = DataParallel.current()
    assert dp.world == 2, dp
    torch.manual_seed(0)  # identical LoRA init on every rank
    model_dir = resolve_model_path("builtin:tiny")
    tok = load_tokenizer(model_dir)
    model = add_lora(load_base_model(model_dir, "float32"), cfg.model.lora)
    with torch.no_grad():  # a non-zero adapter, so that the update is not from B = 0 only
        for i, (name, p) in enumerate(model.named_parameters()):
            if "lora_B" in name:  # seeded by position: str hash() differs between processes
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(i))
    rollouts = fixed_batch(tok, cfg, "cpu")
    full = batch_from_rollouts(rollouts, tok.pad_token_id)
    with torch.no_grad():  # "engine" log-probs: the trainer's plus a deterministic perturbation
        lp, _ = completion_logprobs(model, full, temperature=1.0)
        noise = torch.randn(lp.shape, generator=torch.Generator().manual_seed(3)) * 0.01
        full.rollout_logprobs = (lp + noise) * full.mask
    rewards = torch.tensor([float((i * 7) % 3 == 0) for i in range(len(rollouts))])
    g = cfg.algorithm.group_size

    def one_pass(m, batch, rew, dpx):
        adv = ADVANTAGES.get(cfg.algorithm.name)(AdvantageInputs(rewards=rew, mask=batch.mask, group_size=g),
                                                 cfg.algorithm.options)
        out = policy_gradient_pass(Learner(cfg=cfg, model=m, backward=lambda loss: loss.backward(), dp=dpx), batch, adv)
        parity = dpx.pooled_parity(out[0].logprobs, batch.rollout_logprobs, batch.mask)
        grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
        return out, parity, grads

    # reference: one process, the whole batch (every rank computes it; rank 0 reports)
    ref_out, ref_parity, ref_grads = one_pass(copy.deepcopy(model), full, rewards, DataParallel())
    # data parallel: this rank's shard of whole prompts, gradients summed over the ranks
    per = len(rollouts) // dp.world
    rows = slice(dp.rank * per, (dp.rank + 1) * per)
    dp_out, dp_parity, dp_grads = one_pass(model, full.select(rows), rewards[rows], dp)
    # pooling alone, on identical inputs: the rank shards of the reference's own tensors
    c = full.select(rows).mask.shape[1]
    pooled_same = dp.pooled_parity(ref_out[0].logprobs[rows, :c], full.rollout_logprobs[rows, :c],
                                   full.mask[rows, :c])
    if dp.rank == 0:
        gmax = max(float(v.abs().max()) for v in ref_grads.values())
        gdiff = max(float((ref_grads[k] - dp_grads[k]).abs().max()) for k in ref_grads)
        Path(sys.argv[2]).write_text(json.dumps({
            "loss_ref": ref_out[1]["train/loss"], "loss_dp": dp_out[1]["train/loss"],
            "grad_max": gmax, "grad_max_diff": gdiff,
            "parity_ref": ref_parity, "parity_dp": dp_parity, "parity_pooled_same_inputs": pooled_same,
        }))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from worker_exit import finish  # this script's folder is on sys.path

    finish(main())
