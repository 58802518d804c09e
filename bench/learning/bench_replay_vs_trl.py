"""A parityrl run's batches replayed through TRL's GRPOTrainer: do the two trainers' updates stay together over a run?

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind PYTHONPATH=. \\
        python bench/learning/bench_replay_vs_trl.py --seed 0 --steps 40 --work /tmp/replay
    # TRL: the dev extra, or pip install --no-deps 'trl==1.16.*'

First parityrl trains at bench/learning/bench_learning_vs_trl.py's settings (recipes/grpo_tiny.yaml in float32, 16
prompts x 8 completions x 24 tokens, lr 2e-3, LoRA r 16 alpha 32 on every linear layer, the schedule of
``--schedule``, held-out evaluation off) in a process of its own, and every step's batch is recorded as the loop
hands it on (prompt ids, completion ids, the engine's log-probs, finish reasons, rewards: ``rollout_phase``'s
``Drawn``), with the step's loss, gradient norm and learning rate and the LoRA weights before step 1 and after each
update (``update_phase``): ``record-<seed>.pt`` in ``--work`` (kept: a second invocation replays it again).

Then TRL 1.16's real training loop (``GRPOTrainer.train``: advantages, ``_compute_loss`` with ``loss_type="dapo"``,
beta 0, Transformers' clipping, fused AdamW, scheduler) is fed exactly those batches, in order, through its
``rollout_func`` hook, the rewards looked up, from the same starting LoRA weights: as
tests/trainer/algorithms/test_grpo_vs_trl.py does for one batch. Both trainers then see the same samples, so whether
those were on-policy for TRL does not matter (one update per batch, no KL).

Per step it prints both trainers' loss, gradient norm and learning rate, and the LoRA weights' difference
|W_TRL - W_parityrl| relative to parityrl's movement so far |W_parityrl - W_0|. What float32 rounding alone does over
as many steps is measured beside it: TRL replayed once more from the starting weights nudged by one float32 rounding
(each element times 1 +- 2^-24), |W_TRL' - W_TRL| / |W_TRL - W_0|. The verdict: the updates are the same over the run
when parityrl's difference stays within ``--factor`` (10) times that rounding growth at every step (or under 1e-5 of
the movement); otherwise the first step where it leaves it is named, with what that step's batch had.

The recorded batches also give parityrl's groups with no signal (all 8 rewards equal, advantage 0) per step; TRL
counts its own (``frac_reward_zero_std``) in its real runs.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

PROMPTS, GROUP, TOKENS, LR = 16, 8, 24, 2e-3
RECIPE = "recipes/grpo_tiny.yaml"


def lora_state(model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(model).items()}


def record_worker(seed: int, steps: int, schedule: str, out: Path, extra: list[str]) -> None:
    """parityrl's run with every step's batch, metrics and LoRA weights recorded; written to ``out``."""
    import trainer.rl.loop as loop
    from trainer.lifecycle.preflight import load_recipe

    run_dir = out.parent / f"parityrl-{seed}"
    cfg = load_recipe(RECIPE, [f"train.steps={steps}", f"train.seed={seed}", "model.dtype=float32",
                               "checkpoint.every=0", "eval.every=0", f"train.lr_schedule={schedule}",
                               f"name=replay-vs-trl-{seed}", f"logging.run_dir={run_dir}",
                               "logging.wandb.mode=disabled", *extra])
    start: dict[str, torch.Tensor] = {}
    recorded: list[dict] = []
    rollout_phase, update_phase = loop.rollout_phase, loop.update_phase

    def recording_rollout(run, step):
        if not start:  # before step 1's update: the weights both trainers start from
            start.update(lora_state(run.policy))
        drawn, m = rollout_phase(run, step)
        r = drawn.rollouts
        recorded.append({"step": step, "prompt_ids": [list(p) for p in r.prompt_ids],
                         "completion_ids": [list(c) for c in r.completion_ids],
                         "logprobs": [list(x) for x in r.rollout_logprobs], "finish": list(r.finish_reasons),
                         "rewards": [float(x) for x in drawn.rewards]})
        return drawn, m

    def recording_update(run, step, batch, scored, advantages, returns, m):
        update_phase(run, step, batch, scored, advantages, returns, m)
        recorded[-1].update(loss=float(m["train/loss"]), grad_norm=float(m["train/grad_norm"]),
                            lr=float(m["train/lr"]), weights=lora_state(run.policy))

    # the loop calls its phases by their module names: the recording wraps them, the run is otherwise untouched
    loop.rollout_phase, loop.update_phase = recording_rollout, recording_update
    loop.train(cfg)
    if len(recorded) != steps or any("weights" not in r for r in recorded):
        raise SystemExit(f"recorded {len(recorded)} steps ({sum('weights' in r for r in recorded)} updates), "
                         f"expected {steps}: the loop's phases changed (trainer/rl/loop.py)")
    torch.save({"seed": seed, "schedule": schedule, "extra": extra, "start": start, "steps": recorded}, out)


def record(seed: int, steps: int, schedule: str, work: Path, extra: list[str]) -> Path:
    """The recording of ``seed`` in ``work``, made in a process of its own (a vLLM engine) if it is not there."""
    out = work / f"record-{seed}.pt"
    if out.is_file():
        saved = torch.load(out, weights_only=False)
        if (len(saved["steps"]), saved["schedule"], saved["extra"]) == (steps, schedule, extra):
            print(f"replaying {out} (recorded before)", flush=True)
            return out
    log = work / f"parityrl-{seed}.log"
    print(f"recording parityrl's run (seed {seed}, {steps} steps; log {log})", flush=True)
    with open(log, "w") as f:
        subprocess.run([sys.executable, __file__, "--record-worker", str(out), "--seed", str(seed), "--steps",
                        str(steps), "--schedule", schedule] + [a for s in extra for a in ("--set", s)],
                       check=True, stdout=f, stderr=subprocess.STDOUT,
                       env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    return out


def replay_trl(rec: dict, work: Path, start: dict[str, torch.Tensor], device: str = "cpu") -> dict:
    """TRL's GRPOTrainer.train fed the recorded batches in order from the LoRA weights ``start``, on ``device`` (cpu,
    cuda): per step its loss, gradient norm, learning rate, mean reward, groups without signal and the LoRA weights
    after the update."""
    from datasets import Dataset
    from peft import LoraConfig, set_peft_model_state_dict
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.builtin.resolve import resolve_model_path
    from trainer.models.policy import load_base_model, load_tokenizer

    steps = rec["steps"]
    model_dir = resolve_model_path("builtin:tiny")
    tokenizer = load_tokenizer(model_dir)
    fed = {"step": 0}

    def rollout(prompts, trainer):  # TRL's own prompt draw is ignored: the step's recorded batch, group by group
        s = steps[fed["step"]]
        fed["step"] += 1
        if len(prompts) != len(s["completion_ids"]):
            raise RuntimeError(f"TRL asked for {len(prompts)} completions, step {s['step']} recorded "
                               f"{len(s['completion_ids'])}")
        return {"prompt_ids": s["prompt_ids"], "completion_ids": s["completion_ids"], "logprobs": s["logprobs"]}

    def recorded_reward(prompts, completions, completion_ids, **kw):
        s = steps[fed["step"] - 1]
        if [list(c) for c in completion_ids] != s["completion_ids"]:
            raise RuntimeError(f"step {s['step']}: TRL scores other completions than the recorded ones (reordered)")
        return s["rewards"]

    cfg = GRPOConfig(output_dir=str(work / "trl"), max_steps=len(steps), per_device_train_batch_size=PROMPTS * GROUP,
                     num_generations=GROUP, max_completion_length=TOKENS, learning_rate=LR, logging_steps=1,
                     report_to=[], save_strategy="no", bf16=False, use_cpu=device == "cpu", use_vllm=False,
                     beta=0.0, temperature=1.0, loss_type="dapo", lr_scheduler_type=rec["schedule"],
                     gradient_checkpointing=False, seed=rec["seed"], disable_tqdm=True)
    lora = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*rollout_func.*experimental")
        trainer = GRPOTrainer(model=load_base_model(model_dir, "float32"), reward_funcs=recorded_reward, args=cfg,
                              train_dataset=Dataset.from_dict({"prompt": [f"prompt {i}" for i in range(64)]}),
                              processing_class=tokenizer, peft_config=LoraConfig(**lora), rollout_func=rollout)
    model = trainer.model
    if set(lora_state(model)) != set(start):
        raise RuntimeError("TRL's LoRA adapts other matrices than parityrl's: "
                           f"{sorted(set(lora_state(model)) ^ set(start))[:4]}")
    set_peft_model_state_dict(model, start)
    out: dict[str, list] = {"weights": [], "loss": [], "grad_norm": [], "lr": [], "reward": [], "zero_std": [],
                            "entropy": []}

    class Record(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kw):
            out["weights"].append(lora_state(model))

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "grad_norm" in logs:
                out["loss"].append(float(logs["loss"]))
                out["grad_norm"].append(float(logs["grad_norm"]))
                out["lr"].append(float(logs["learning_rate"]))
                out["reward"].append(float(logs["reward"]))
                out["zero_std"].append(float(logs["frac_reward_zero_std"]))
                out["entropy"].append(float(logs["entropy"]))

    trainer.add_callback(Record())
    for printer in (PrinterCallback, ProgressCallback):  # this script prints its own rows
        trainer.remove_callback(printer)
    trainer.train()
    if len(out["weights"]) != len(steps) or fed["step"] != len(steps):
        raise RuntimeError(f"TRL took {len(out['weights'])} optimizer steps on {fed['step']} batches, "
                           f"expected {len(steps)}")
    return out


def nudged(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Each element times 1 +- 2^-24 (random signs): one float32 rounding of every weight."""
    g = torch.Generator().manual_seed(seed)
    return {k: v * (1 + (torch.randint(0, 2, v.shape, generator=g) * 2 - 1).to(v.dtype) * 2.0 ** -24)
            for k, v in weights.items()}


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a) ** 0.5


def zero_signal_groups(rewards: list[float]) -> int:
    """Groups of GROUP samples whose rewards are all equal: advantage 0 on both sides, no gradient."""
    return sum(len(set(rewards[i:i + GROUP])) == 1 for i in range(0, len(rewards), GROUP))


def compare(rec: dict, trl: dict, rounding: dict, factor: float) -> tuple[list[dict], int | None]:
    """Per-step rows and the first step whose weight difference exceeds the rounding bound (None: none does)."""
    rows, first = [], None
    start = rec["start"]
    for k, s in enumerate(rec["steps"]):
        moved = distance(s["weights"], start)
        diff = distance(trl["weights"][k], s["weights"]) / moved
        noise = distance(rounding["weights"][k], trl["weights"][k]) / distance(trl["weights"][k], start)
        together = diff <= max(factor * noise, 1e-5)
        if not together and first is None:
            first = s["step"]
        rows.append({"step": s["step"], "loss": (s["loss"], trl["loss"][k]),
                     "grad_norm": (s["grad_norm"], trl["grad_norm"][k]), "lr": (s["lr"], trl["lr"][k]),
                     "reward": (sum(s["rewards"]) / len(s["rewards"]), trl["reward"][k]),
                     "zero_signal": (zero_signal_groups(s["rewards"]), round(trl["zero_std"][k] * PROMPTS)),
                     "truncated": sum(f == "length" for f in s["finish"]), "diff": diff, "rounding": noise,
                     "together": together})
    return rows, first


def draw_excess(rec: dict, trl: dict) -> tuple[float, float]:
    """(mean, standard error over steps) of the sampled tokens' log-prob plus the entropy at their positions, per token.

    For a sampler that draws the policy's distribution, E[log p(x_t)] = -H_t at every position given its prefix, so
    the token mean of log p + H is 0 up to noise; a colder draw (the likelier tokens too often) makes it positive.
    The log-probs are the engine's (the trainer's to parity/mae ~3e-7); the entropy is TRL's log of the same
    completions under the weights the engine sampled with (its ``entropy``: a token mean over the batch)."""
    per_step = []
    for s, entropy in zip(rec["steps"], trl["entropy"]):
        lps = [x for c in s["logprobs"] for x in c]
        per_step.append(sum(lps) / len(lps) + entropy)
    mean = sum(per_step) / len(per_step)
    spread = (sum((x - mean) ** 2 for x in per_step) / (len(per_step) - 1)) ** 0.5 if len(per_step) > 1 else 0.0
    return mean, spread / len(per_step) ** 0.5


def print_rows(rows: list[dict]) -> None:
    print(f"{'step':>4} {'loss parityrl / TRL':>24} {'grad norm parityrl / TRL':>22} {'lr p / TRL':>19} "
          f"{'reward':>6} {'no-signal groups p/TRL':>22} {'cut':>3} {'|dW|/|W-W0|':>11} {'rounding':>9}")
    for r in rows:
        print(f"{r['step']:>4} {r['loss'][0]:>+12.6f}/{r['loss'][1]:<+11.6f} {r['grad_norm'][0]:>10.6f}/"
              f"{r['grad_norm'][1]:<11.6f} {r['lr'][0]:>9.3g}/{r['lr'][1]:<9.3g} {r['reward'][0]:>6.3f} "
              f"{r['zero_signal'][0]:>11d}/{r['zero_signal'][1]:<10d} {r['truncated']:>3d} {r['diff']:>11.2e} "
              f"{r['rounding']:>9.2e}{'' if r['together'] else '  <-'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--schedule", choices=["constant", "linear"], default="constant",
                   help="both trainers' learning-rate schedule (no warm-up)")
    p.add_argument("--work", type=Path, help="keep the recording (record-<seed>.pt), parityrl's run and its log here; "
                   "an existing recording of the same settings is replayed without training again")
    p.add_argument("--factor", type=float, default=10.0,
                   help="how many times the rounding growth parityrl's weight difference may reach")
    p.add_argument("--trl-device", choices=["cpu", "cuda"], default="cpu",
                   help="where TRL's replay trains (parityrl's run takes the recipe's device: CUDA where there is one)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override for parityrl's run (repeatable)")
    p.add_argument("--record-worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.record_worker:
        return record_worker(args.seed, args.steps, args.schedule, args.record_worker, args.set)
    try:
        import trl
    except ImportError:
        raise SystemExit("TRL is not installed (the dev extra, or pip install --no-deps 'trl==1.16.*'): nothing to "
                         "replay into") from None
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rec = torch.load(record(args.seed, args.steps, args.schedule, work, args.set), weights_only=False)
        print(f"TRL {trl.__version__}: replaying {len(rec['steps'])} recorded batches, then again from the starting "
              "weights nudged by one float32 rounding", flush=True)
        trl_run = replay_trl(rec, work, rec["start"], args.trl_device)
        rounding = replay_trl(rec, work, nudged(rec["start"], args.seed), args.trl_device)
    rows, first = compare(rec, trl_run, rounding, args.factor)
    print_rows(rows)
    worst = max(rows, key=lambda r: r["diff"])
    print(f"largest weight difference {worst['diff']:.2e} of parityrl's movement (step {worst['step']}); rounding "
          f"alone grows to {max(r['rounding'] for r in rows):.2e}; groups without signal: parityrl "
          f"{sum(r['zero_signal'][0] for r in rows)} of {PROMPTS * len(rows)}")
    excess, se = draw_excess(rec, trl_run)
    print(f"parityrl's draws: sampled log-prob + entropy {excess:+.4f} +- {se:.4f} nats per token (0 for a sampler "
          "that draws the policy's distribution)")
    if first is None:
        print(f"verdict: the same updates over {len(rows)} steps (within {args.factor:g}x float32 rounding's growth at "
              "every step): the difference in learning is in the samples, not the update")
    else:
        r = next(r for r in rows if r["step"] == first)
        print(f"verdict: the trainers part at step {first}: weight difference {r['diff']:.2e} against rounding's "
              f"{r['rounding']:.2e}; that step: loss {r['loss'][0]:+.6f} vs {r['loss'][1]:+.6f}, grad norm "
              f"{r['grad_norm'][0]:.6f} vs {r['grad_norm'][1]:.6f}, lr {r['lr'][0]:.3g} vs {r['lr'][1]:.3g}, "
              f"{r['zero_signal'][0]} groups without signal, {r['truncated']} completions cut at {TOKENS} tokens")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: trainer/, rollout/
    main()
