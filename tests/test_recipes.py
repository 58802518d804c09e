"""Every shipped recipe: the CPU ones (`*_tiny.yaml`) train 2 steps, the GPU ones load and validate.

The RM pipeline's recipes (sft_lora_tiny, rm_tiny, ppo_rm_tiny) run end to end in
tests/trainer/commands/test_rm_pipeline.py; sft_tiny.yaml is the built-in model's warm start.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.lifecycle.preflight import load_recipe

REPO = Path(__file__).resolve().parents[1]
RL_TINY = sorted(p.name for p in (REPO / "recipes").glob("*_tiny.yaml")
                 if not p.name.startswith("sft_") and p.name not in ("rm_tiny.yaml", "ppo_rm_tiny.yaml"))
GPU = sorted(p.name for p in (REPO / "recipes").glob("*_gpu.yaml"))


def test_recipe_lists_are_not_empty():
    assert len(RL_TINY) >= 9 and len(GPU) >= 3, (RL_TINY, GPU)


@pytest.mark.parametrize("name", GPU)
def test_gpu_recipes_validate_at_load(name):
    # hub ids and their config.json are not reachable here: paths are checked on the user's machine
    cfg = load_recipe(REPO / "recipes" / name, check_paths=False)
    assert cfg.train.steps >= 1


# The config.json keys the capacity check reads, and the parameter counts, of the GPU recipes' hub models
QWEN_05B = ({"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2}, 494_032_768)
OLMOE_1B_7B = ({"model_type": "olmoe", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16,
                "num_key_value_heads": 16}, 6_919_161_856)


@pytest.mark.parametrize("name", GPU)
def test_gpu_recipes_checkpoint_activations_and_fit_one_80_gib_gpu(name):
    """The GPU recipes' micro-batches (8-16 sequences of up to 1,536 tokens) need gradient checkpointing beside a
    colocated engine; what that engine reserves (weights + the recipe's KV cache) fits beside the trainer's
    weights, with sleep mode's host copy of the weights (trainer/lifecycle/capacity.py)."""
    from trainer.lifecycle.capacity import Machine, ModelSize, capacity_problems

    cfg = load_recipe(REPO / "recipes" / name, check_paths=False)
    assert cfg.train.gradient_checkpointing and cfg.rollout.sleep_mode
    config, parameters = OLMOE_1B_7B if "olmoe" in name else QWEN_05B
    machine = Machine(host_available=64 * 1024**3, gpu_total=80 * 1024**3)
    assert capacity_problems(cfg, name, machine, ModelSize(parameters, config)) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", RL_TINY)
def test_cpu_recipe_trains_two_steps(tmp_path, name, tiny_model_dir, vllm_engine):
    from trainer.rl.loop import train

    # the recipe's held-out evaluation runs (before step 1 and after the last) on 8 of its prompts: at the recipes'
    # 64 prompts x 4 samples and a greedy pass, multi-turn, the two evaluations held 5x the episodes of the two
    # steps; evaluation itself is tested in tests/trainer/measurement/test_evaluation.py
    sets = [f"logging.run_dir={tmp_path / 'run'}", "logging.wandb.mode=disabled", "train.steps=2",
            "checkpoint.every=0", "eval.num_prompts=8"]
    cfg = load_recipe(REPO / "recipes" / name, sets)
    if cfg.model.path != "builtin:tiny":  # another base than the shared engine holds: its own engine, as a user runs it
        proc = subprocess.run([sys.executable, "-m", "trainer", "train", str(REPO / "recipes" / name),
                               *[x for s in sets for x in ("--set", s)]], cwd=REPO, capture_output=True, text=True,
                              timeout=1200, env={**os.environ, "PARITYRL_CACHE": os.environ["PARITYRL_CACHE"]})
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if r["step"] > 0]
        assert [r["step"] for r in steps] == [1, 2] and all(r["parity/mae"] < 1e-2 for r in steps), steps
        assert cfg.eval.every == 0 or any(k.startswith("eval/") for r in rows for k in r), rows[-1]
        return
    res = train(cfg, engine=vllm_engine)
    assert [h["step"] for h in res.history] == [1, 2]
    for h in res.history:
        assert h["parity/mae"] < 1e-2 and h["train/grad_norm"] >= 0, (name, h)
    assert res.final_checkpoint is not None
