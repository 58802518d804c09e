"""DeepSpeed ZeRO-2/3 training steps on 2 CPU processes, checked against a single-process reference.

    torchrun --nproc_per_node 2 bench/checks/zero_cpu_check.py --zero 2
    torchrun --nproc_per_node 2 bench/checks/zero_cpu_check.py --zero 3 [--dtype float32] [--optim adamw]
    accelerate launch --config_file recipes/accelerate/zero3.yaml bench/checks/zero_cpu_check.py --zero 3
    torchrun --nproc_per_node 2 bench/checks/zero_cpu_check.py --zero 0   # no DeepSpeed: trainer.distributed.data_parallel

(PARITYRL_CACHE, HF_HUB_OFFLINE=1 as for the tests.) DeepSpeed runs through accelerate's
DeepSpeed plugin, from the environment ``accelerate launch`` sets for
``recipes/accelerate/zero{2,3}.yaml``: under torchrun the script sets it itself
(ACCELERATE_USE_DEEPSPEED=true, ACCELERATE_DEEPSPEED_CONFIG_FILE=recipes/accelerate/zero{2,3}.json,
ACCELERATE_DEEPSPEED_ZERO3_INIT=false); values already in the environment win. No vLLM.

Rank 0 first computes the reference in plain PyTorch (before any process group): the
builtin tiny model + LoRA (``trainer.config.LoraConfig()``; lora_A and lora_B set to
seeded random values, so every adapter gets a gradient and the merge is not the
identity), ``--steps`` steps on a fixed 8-sequence batch: ``completion_logprobs``, a
policy-gradient log-prob loss normalised by the batch's token count, backward,
``clip_grad_norm_``, optimizer step, LambdaLR step; ``merged_lora_weights`` before and
after. Every rank then loads and prepares the policy with the loop's own setup
(``trainer.rl.learner.load_policy`` and ``prepare_policy``: DeepSpeed's config filled from the
recipe, the model loaded outside zero.Init, the engine around ``PolicyForward``) and runs the
same steps on its shard (rows ``[4r, 4r+4)``) in micro-batches (``--micro``) with the loop's
``make_backward`` and ``optimizer_step``, every rank's loss normalised by the WHOLE batch's
token count as the loop does, and exports with ``zero3_gather``. ``--zero 0`` runs the
loop's non-DeepSpeed data parallel instead (model not prepared,
``trainer.distributed.data_parallel.DataParallel.all_reduce_grads``). Checks (rank 0; every rank
exits with the result):

- loss, every step: the ranks' losses sum to the reference loss (step 1: rtol 1e-5,
  the same forward on fewer rows; later steps: the gradient tolerance below);
- grad norm, every step: DeepSpeed's (the one it clipped with) vs ``clip_grad_norm_``'s
  (``--optim adamw``: step 1 only, and no weight comparisons; ``compare`` says why);
- trainable parameters after the last step (SGD moves them by ``lr * clip * grad``,
  so they carry the reduced gradient), against the largest reference update;
- export before training: bit-identical; after: within one bf16 step (rtol 2**-7) plus
  the gradient tolerance times the largest change training made to a merged weight;
- the recipe's dtypes survive DeepSpeed (base ``--dtype``, adapters float32), the
  loop's un-prepared LR scheduler drives the optimizer that steps, clipping was active;
- ZeRO-3: parameters above the persistence threshold are partitioned, and while the
  export gathers a module no other partitioned parameter is whole;
- DeepSpeed: the checkpoint the loop would write (``engine.save_checkpoint`` with
  ``exclude_frozen_parameters``: every rank its optimizer shard; the adapter saved by the
  main process inside ``gathered_trainable``) restores the weights exactly, a step taken
  after loading it repeats the step taken after saving it bit for bit, and the saved
  adapter file holds the trained adapter.

Gradient tolerances (measured, see ``grad_rtol``): float32 base, or ZeRO-2: 1e-5
relative. bfloat16 base under ZeRO-3: 2e-2 of the largest update, because ZeRO-3 puts an
identity autograd node on every module's inputs and outputs (its fetch/release hooks),
which changes the order in which bf16 gradient contributions are summed: plain PyTorch
with the same identity nodes reproduces ZeRO-3's gradients bit for bit (0.0), both 0.77%
(of the largest element) away from the hook-free gradient; with a float32 base the gap
is 4e-7.

Prints one line ``ZERO_CPU_CHECK {json}`` (rank 0) and exits 1 if any check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

ROWS, PER_RANK, MICRO, STEPS = 8, 4, 2, 2
LR, MAX_GRAD_NORM = 0.05, 1.0


def grad_rtol(stage: int, dtype: str) -> float:
    """Relative tolerance of gradients / updates (module docstring: why ZeRO-3 + bf16 is looser; on a CPU
    without native BF16 every bf16 comparison is, see ``parity.precision.host_has_native_bf16``)."""
    from parity.precision import host_has_native_bf16

    return 2e-2 if (dtype == "bfloat16" and (stage == 3 or not host_has_native_bf16())) else 1e-5


def fixed_batch():
    """8 prompt/completion pairs of different lengths (ids of the tiny vocab) and +-1 advantages."""
    import torch

    from trainer.models.batch import build_token_batch

    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(6, 500, (3 + (i * 5) % 7,), generator=g).tolist() for i in range(ROWS)]
    completions = [torch.randint(6, 500, (2 + (i * 3) % 6,), generator=g).tolist() for i in range(ROWS)]
    batch = build_token_batch(prompts, completions, pad_id=0)
    advantages = torch.tensor([1.0 if i % 3 else -1.0 for i in range(ROWS)])[:, None].expand_as(batch.mask)
    return batch, advantages.contiguous()


def recipe(args):
    """The loop's recipe of these steps: the base dtype, the LoRA targets, micro-batch size and clipping."""
    from trainer.config import LoraConfig, RunConfig

    cfg = RunConfig()
    cfg.model.dtype = args.dtype
    cfg.model.lora = LoraConfig() if args.targets is None else LoraConfig(target_modules=args.targets)
    cfg.train.micro_batch_size, cfg.train.max_grad_norm = args.micro, MAX_GRAD_NORM
    return cfg


def make_policy(model_dir: str, cfg):
    """Tiny model + LoRA (single process, no accelerator): the reference's policy, ``seed_adapters``'d."""
    from trainer.models.policy import add_lora, load_base_model

    return seed_adapters(add_lora(load_base_model(model_dir, cfg.model.dtype), cfg.model.lora))


def seed_adapters(model):
    """Deterministic non-zero adapters (the same on every rank and in the reference)."""
    import torch

    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def loss_of(model, micro, adv, n_tokens: float, scale: float):
    """-sum(adv * logprob) / n_tokens (the whole batch's count) * scale."""
    from trainer.models.policy import completion_logprobs

    lp, _ = completion_logprobs(model, micro, temperature=1.0)
    c = lp.shape[1]
    return -(adv[:, :c] * lp * micro.mask).sum() / n_tokens * scale


def make_optimizer(params, name: str):
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=LR)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def make_scheduler(optimizer):
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)


def trainable_state(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def reference(args, model_dir: str) -> dict:
    """The single-process steps on the full batch (rank 0, before any process group exists)."""
    import torch

    from rollout.weight_export import merged_lora_weights

    model = make_policy(model_dir, recipe(args))
    batch, adv = fixed_batch()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, args.optim)
    sched = make_scheduler(opt)
    start = trainable_state(model)
    before = dict(merged_lora_weights(model))
    losses, norms = [], []
    for _ in range(args.steps):
        loss = loss_of(model, batch, adv, float(batch.mask.sum()), 1.0)
        loss.backward()
        losses.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return {"losses": losses, "grad_norms": norms, "before": before, "after": dict(merged_lora_weights(model)),
            "start": start, "trainable": trainable_state(model), "lr": sched.get_last_lr()[0]}


class GatherProbe:
    """Wraps a ``gather``: counts partitioned parameters of OTHER modules that are whole while one is gathered."""

    def __init__(self, model, gather) -> None:
        self.partitioned = [p for p in model.parameters() if hasattr(p, "ds_id") and not getattr(p, "ds_persist", False)]
        self.gather, self.calls, self.violations, self.max_whole = gather, 0, 0, 0

    def __call__(self, params):
        import contextlib

        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        inner, probe = self.gather(params), self

        @contextlib.contextmanager
        def ctx():
            with inner:
                mine = {id(p) for p in params}
                whole = [p for p in probe.partitioned if p.ds_status == ZeroParamStatus.AVAILABLE]
                probe.calls += 1
                probe.max_whole = max(probe.max_whole, sum(p.ds_numel for p in whole))
                probe.violations += sum(id(p) not in mine for p in whole)
                yield

        return ctx()


def distributed_steps(args, model_dir: str) -> dict:
    """The steps as the loop would run them with trainer.distributed.deepspeed (DeepSpeed) or trainer.distributed.data_parallel (--zero 0)."""
    import torch.distributed as dist
    from accelerate import Accelerator

    from rollout.weight_export import merged_lora_weights
    from trainer.distributed.data_parallel import DataParallel
    from trainer.distributed.deepspeed import (
        accelerator_kwargs,
        deepspeed_stage,
        fill_deepspeed_config,
        gathered_trainable,
        is_zero3_partitioned,
        make_backward,
        optimizer_step,
        zero3_gather,
    )
    from trainer.models.policy_forward import unwrap_policy
    from trainer.rl.learner import load_policy, prepare_policy

    accelerator = Accelerator(**accelerator_kwargs())
    stage = deepspeed_stage(accelerator)
    if stage != args.zero:
        raise SystemExit(f"expected ZeRO-{args.zero}, the accelerator runs stage {stage} "
                         f"(ACCELERATE_DEEPSPEED_CONFIG_FILE={os.environ.get('ACCELERATE_DEEPSPEED_CONFIG_FILE')})")
    world, rank = accelerator.num_processes, accelerator.process_index
    if world * PER_RANK != ROWS:
        raise SystemExit(f"run with {ROWS // PER_RANK} processes (torchrun --nproc_per_node {ROWS // PER_RANK}), "
                         f"got {world}")
    dp = DataParallel.current()
    cfg = recipe(args)
    policy = seed_adapters(load_policy(cfg, accelerator, model_dir))
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, args.optim)
    scheduler = make_scheduler(optimizer)  # kept out of prepare(), as the loop does
    if stage and args.no_wrap:  # the failure demonstration: the PEFT model prepared itself, not the loop's way
        fill_deepspeed_config(accelerator, micro_batch_size=args.micro, max_grad_norm=MAX_GRAD_NORM)
        model, optimizer = accelerator.prepare(policy, optimizer)
        policy = unwrap_policy(accelerator, model)
    else:  # without DeepSpeed the model is not prepared: trainer.distributed.data_parallel reduces the gradients
        model, optimizer, policy = prepare_policy(cfg, accelerator, stage, policy, optimizer)

    out: dict = {"stage": stage, "world": world, "distributed_type": accelerator.distributed_type.value,
                 "deepspeed_config_file": os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") if stage else None,
                 "launched_by_accelerate": "ACCELERATE_MIXED_PRECISION" in os.environ,
                 "engine": type(model).__name__, "zero3_partitioned": is_zero3_partitioned(policy),
                 "optimizer": type(model.optimizer if stage else optimizer.optimizer).__name__,
                 "frozen_dtypes": sorted({str(p.dtype) for p in policy.parameters() if not p.requires_grad}),
                 "trainable_dtypes": sorted({str(p.dtype) for p in policy.parameters() if p.requires_grad})}
    if stage == 3:
        # Parameters above the persistence threshold must be partitioned (smaller ones stay whole by design).
        keep = accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"]
        big = [p for p in policy.parameters() if p.ds_numel > keep]
        out.update(big_params=len(big), partitioned_big_params=sum(p.ds_tensor.numel() < p.ds_numel for p in big))
    gather = GatherProbe(policy, zero3_gather(policy)) if stage == 3 else zero3_gather(policy)
    before = dict(merged_lora_weights(policy, gather=gather))

    batch, adv = fixed_batch()
    n_tokens = float(batch.mask.sum())  # the whole batch's count: every rank normalises by it (sum semantics)
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    sub, sub_adv = batch.select(shard), adv[shard]
    rank_losses, norms = [], []
    model.train()
    backward = make_backward(accelerator, model)  # DeepSpeed: loss x world (it averages over ranks)
    for _ in range(args.steps):
        loss_sum = 0.0
        for start in range(0, PER_RANK, args.micro):
            rows = slice(start, start + args.micro)
            loss = loss_of(model, sub.select(rows), sub_adv[rows], n_tokens, 1.0)
            backward(loss)
            loss_sum += float(loss.detach())
        if not stage:
            dp.all_reduce_grads(params)  # what the loop does without DeepSpeed
        norms.append(optimizer_step(accelerator, model, optimizer, params, MAX_GRAD_NORM))
        scheduler.step()
        step_losses = [None] * world
        dist.all_gather_object(step_losses, loss_sum)
        rank_losses.append(step_losses)
    # The lr held by the optimizer that steps: DeepSpeed's (engine) or the torch one.
    out.update(rank_losses=rank_losses, grad_norms=norms,
               lr=float(model.get_lr()[0] if stage else optimizer.optimizer.param_groups[0]["lr"]))

    after = dict(merged_lora_weights(policy, gather=gather))
    with gathered_trainable(policy):
        trainable = trainable_state(policy)
    if stage == 3:
        out.update(gather_calls=gather.calls, gather_violations=gather.violations, max_whole_numel=gather.max_whole,
                   total_partitioned_numel=sum(p.ds_numel for p in gather.partitioned))
    if stage:
        out["checkpoint"] = checkpoint_roundtrip(accelerator, model, policy, optimizer, params, sub, sub_adv,
                                                 n_tokens, args.micro, trainable)
    return {"out": out, "before": before, "after": after, "trainable": trainable, "rank": rank}


def checkpoint_roundtrip(accelerator, model, policy, optimizer, params, sub, sub_adv, n_tokens, micro, trainable):
    """The DeepSpeed checkpoint the loop would write (sharded optimizer via engine.save_checkpoint, adapter
    via gathered_trainable + save_pretrained): saved, one more step taken, loaded, the step replayed."""
    import shutil
    import tempfile

    import torch
    import torch.distributed as dist
    from peft.utils import load_peft_weights

    from trainer.distributed.deepspeed import gathered_trainable, make_backward, optimizer_step

    where = [tempfile.mkdtemp(prefix="zero_ckpt_") if accelerator.is_main_process else None]
    dist.broadcast_object_list(where, src=0)  # one directory for every rank (one machine here)
    root = where[0]
    backward = make_backward(accelerator, model)

    def one_step():
        for start in range(0, PER_RANK, micro):
            rows = slice(start, start + micro)
            backward(loss_of(model, sub.select(rows), sub_adv[rows], n_tokens, 1.0))
        optimizer_step(accelerator, model, optimizer, params, MAX_GRAD_NORM)
        with gathered_trainable(policy):
            return trainable_state(policy)

    try:
        model.save_checkpoint(root, tag="step", exclude_frozen_parameters=True)  # collective: every rank writes
        with gathered_trainable(policy):  # collective gather; only the main process writes
            if accelerator.is_main_process:
                policy.save_pretrained(f"{root}/adapter")
        dist.barrier()
        first = one_step()
        model.load_checkpoint(root, tag="step", load_module_strict=False, load_optimizer_states=True,
                              load_lr_scheduler_states=False)
        with gathered_trainable(policy):
            restored = trainable_state(policy)
        replay = one_step()
        adapter = load_peft_weights(f"{root}/adapter", device="cpu")
        saved = {k.replace(".default.", "."): v for k, v in trainable.items()}
        result = {"files": sorted(os.listdir(f"{root}/step")),
                  "weights_restored": all(torch.equal(restored[k], v) for k, v in trainable.items()),
                  "step_replayed_bitwise": all(torch.equal(replay[k], v) for k, v in first.items()),
                  "adapter_file_equals_weights": set(adapter) == set(saved) and all(
                      torch.equal(adapter[k], saved[k]) for k in adapter)}
        dist.barrier()
        return result
    finally:
        if accelerator.is_main_process:
            shutil.rmtree(root, ignore_errors=True)


def compare(args, ref: dict, got: dict) -> dict:
    """The checks (module docstring). With AdamW only step 1's loss and grad norm and the first-step-free checks
    are compared: Adam's update lr * g / (|g| + eps) turns a 1e-9 gradient difference on an element whose
    gradient is near eps into a visible weight difference (measured, ZeRO-2: 1.2e-4 on an update of 0.05),
    which every later step then feeds forward."""
    import torch

    out, checks = got["out"], {}
    rtol = grad_rtol(out["stage"], args.dtype)
    steps = args.steps if args.optim == "sgd" else 1
    sums = [sum(step) for step in out["rank_losses"]]
    # Step 1 runs the same forward on fewer rows (1e-5); later steps start from updated weights (gradient rtol).
    from parity.precision import host_has_native_bf16

    first = 1e-5 if (args.dtype != "bfloat16" or host_has_native_bf16()) else rtol  # emulated bf16: shard-variant
    checks["loss"] = all(abs(s - r) <= (first if i == 0 else max(rtol, 1e-5)) * abs(r)
                         for i, (s, r) in enumerate(zip(sums[:steps], ref["losses"][:steps])))
    checks["grad_norm"] = all(abs(d - r) <= rtol * r for d, r in zip(out["grad_norms"][:steps], ref["grad_norms"][:steps]))
    checks["clip_active"] = all(r > MAX_GRAD_NORM for r in ref["grad_norms"])
    checks["trainable_names"] = set(got["trainable"]) == set(ref["trainable"])
    update = max(float((ref["trainable"][n] - ref["start"][n]).abs().max()) for n in ref["trainable"])
    diff = max(float((got["trainable"][n] - t).abs().max()) for n, t in ref["trainable"].items())
    if args.optim == "sgd":
        checks["trainable_after_steps"] = checks["trainable_names"] and diff <= rtol * update
    checks["export_names"] = set(got["before"]) == set(ref["before"]) == set(got["after"]) == set(ref["after"])
    checks["export_before_bitwise"] = checks["export_names"] and all(
        torch.equal(got["before"][n], t) for n, t in ref["before"].items())
    after_diff = max(float((got["after"][n].float() - t.float()).abs().max()) for n, t in ref["after"].items())
    moved = max(float((ref["after"][n].float() - ref["before"][n].float()).abs().max()) for n in ref["after"])
    if args.optim == "sgd":
        # One bf16 step (ulp(v) <= 2**-7 |v|, 7 stored mantissa bits) plus the gradient tolerance times the
        # largest change training made to a merged weight (near-zero merged entries get only the latter).
        checks["export_after_training"] = checks["export_names"] and all(
            torch.allclose(got["after"][n].float(), t.float(), rtol=2 ** -7, atol=rtol * moved)
            for n, t in ref["after"].items())
    checks["export_moved_by_training"] = any(not torch.equal(got["before"][n], got["after"][n]) for n in got["after"])
    base = {"bfloat16": "torch.bfloat16", "float32": "torch.float32"}[args.dtype]
    checks["dtypes_kept"] = out["frozen_dtypes"] == [base] and out["trainable_dtypes"] == ["torch.float32"]
    checks["lr_scheduler_drives_optimizer"] = out["lr"] is not None and abs(out["lr"] - ref["lr"]) < 1e-12
    if out["stage"]:
        ck = out["checkpoint"]
        checks["checkpoint_roundtrip"] = ck["weights_restored"] and ck["step_replayed_bitwise"] and \
            ck["adapter_file_equals_weights"]
    if out["stage"] == 3:
        checks["zero3_params_partitioned"] = out["zero3_partitioned"] and out["partitioned_big_params"] == out["big_params"] > 0
        checks["one_module_at_a_time"] = out["gather_calls"] > 0 and out["gather_violations"] == 0
    report = dict(out)
    report.update(ref_losses=ref["losses"], ref_grad_norms=ref["grad_norms"], grad_rtol=rtol, checked_steps=steps,
                  max_abs_diff_trainable=diff, max_ref_update=update, max_abs_diff_export_after=after_diff,
                  max_ref_export_change=moved, exported_tensors=len(ref["after"]), checks=checks,
                  ok=all(checks.values()))
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--zero", type=int, choices=(0, 2, 3), required=True,
                   help="ZeRO stage; 0: no DeepSpeed, the loop's own data parallel (trainer.distributed.data_parallel)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="base model dtype")
    p.add_argument("--optim", choices=("sgd", "adamw"), default="sgd",
                   help="sgd (default): the update carries the gradient itself; adamw: the loop's optimizer")
    p.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps (default {STEPS})")
    p.add_argument("--micro", type=int, choices=(1, 2, 4), default=MICRO,
                   help=f"micro-batch size on each rank's {PER_RANK} rows (default {MICRO}: 2 backwards per step)")
    p.add_argument("--targets", type=lambda s: s.split(","), default=None,
                   help="LoRA target modules, comma-separated (default: trainer.config.LoraConfig()'s)")
    p.add_argument("--no-wrap", action="store_true",
                   help="failure demonstration: prepare the PEFT model itself, so the backbone is called without "
                        "the engine's forward; under ZeRO-3 micro-batch gradients then overwrite each other")
    p.add_argument("--report", type=Path, default=None,
                   help="also write the report JSON to this file (the ranks share stdout, where lines can interleave)")
    args = p.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("launch with: torchrun --nproc_per_node 2 bench/checks/zero_cpu_check.py --zero 2|3")
    if args.zero:
        os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")
        os.environ.setdefault("ACCELERATE_DEEPSPEED_CONFIG_FILE",
                              str(REPO / "recipes" / "accelerate" / f"zero{args.zero}.json"))
        os.environ.setdefault("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false")  # as zero3.yaml (see model_load_context)

    import torch
    import torch.distributed as dist

    from trainer.builtin.resolve import resolve_model_path
    from trainer.distributed.teardown import leave_process_group

    model_dir = resolve_model_path("builtin:tiny")
    ref = reference(args, model_dir) if int(os.environ["RANK"]) == 0 else None
    got = distributed_steps(args, model_dir)
    ok = torch.tensor([1])
    if got["rank"] == 0:
        report = compare(args, ref, got)
        report.update(dtype=args.dtype, optim=args.optim, steps=args.steps, micro=args.micro, targets=args.targets,
                      no_wrap=args.no_wrap)
        print("ZERO_CPU_CHECK " + json.dumps(report), flush=True)
        if args.report:
            args.report.write_text(json.dumps(report))
        ok[0] = int(report["ok"])
    dist.broadcast(ok, src=0)
    leave_process_group()
    return 0 if int(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
