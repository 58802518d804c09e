"""Exact mode with engines of its own (run in a pytest process of its own by test_exact_tier.py).

Each test starts and closes its own exact-mode vLLM engine (rollout.vllm_plugins.exact_quant), as a user's run does;
closing an in-process engine tears down vLLM's process-global state that the test session's shared
engine uses, so this module never runs inside the main session.
"""
import json
from pathlib import Path

import pytest
import torch

from rollout.engine_forward import EngineForward
from rollout.types import SamplingSpec
from trainer.lifecycle.preflight import load_recipe
from trainer.rl.loop import train

REPO = Path(__file__).resolve().parents[3]
ENVS = Path(__file__).resolve().with_name("episode_envs.py")
ARCH_PROMPTS = [[1, 5, 9, 13, 20, 30], [2, 7, 8], [3, 4, 11, 12, 14, 15, 16, 17, 18, 19, 21]]
ZERO_KEYS = ("parity/mae", "parity/max_abs", "parity/kl_k3", "parity/rmse")


def _run(tmp_path, name, *sets):
    # eval.every=0 unless a case sets it: the recipe's held-out evaluation (160 completions before step 1 and
    # after the last) is read by the one case that keeps it (its parity in the exact engine, 0 too)
    cfg = load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [
        f"name={name}", f"logging.run_dir={tmp_path / name}", "logging.wandb.mode=disabled", "checkpoint.every=0",
        "precision.recipe=exact", "eval.every=0", *sets])
    train(cfg)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("dtype, sets", [
    # float32, top-k on: the engine's top-k log-probs too; prompt batches of 6 x 4; the held-out evaluation
    # (before step 1 and after the last) scored in the exact engine's numerics as well
    ("float32", ("train.steps=3", "rollout.prompts_per_step=6", "algorithm.group_size=4", "parity.topk=4",
                 "train.micro_batch_size=10", "eval.every=3", "eval.num_prompts=8")),
    # bfloat16, several updates per batch (pi_old scored before them, ratios after each step), a KL penalty
    # to the reference policy (the base model, also in the engine's numerics: trainer.models.exact.reference)
    ("bfloat16", ("train.steps=2", "rollout.prompts_per_step=3", "algorithm.group_size=8", "algorithm.epochs=2",
                  "train.micro_batch_size=8", "algorithm.kl_coef=0.05")),
    # multi-turn episodes (a user's environment file): the replies inside the completion stream are read by both
    # forwards, and every turn's tokens are identical (parity/turn_<k>/*)
    ("float32", ("train.steps=2", "rollout.prompts_per_step=4", "algorithm.group_size=4", "train.micro_batch_size=16",
                 f"env.class={ENVS}:FollowUp", "env.max_turns=2", "env.max_tokens=128")),
    # truncated sampling (top-p and top-k): both sides normalise over the sets the engine's sampler kept, the
    # trainer's rerun masking them as vLLM's sampler does; the top-k log-probs too
    ("bfloat16", ("train.steps=2", "rollout.prompts_per_step=4", "algorithm.group_size=4", "rollout.top_p=0.8",
                  "rollout.top_k=6", "rollout.temperature=1.4", "parity.topk=4", "train.micro_batch_size=16")),
])
def test_engine_and_trainer_logprobs_are_identical_at_every_step(tmp_path, dtype, sets):
    rows = _run(tmp_path, f"exact-{dtype}", f"model.dtype={dtype}", *sets)
    steps = [r for r in rows if "parity/mae" in r]
    assert len(steps) == int(sets[0].split("=")[1])
    for r in steps:
        turn_keys = [k for k in r if k.startswith("parity/turn_")]
        assert bool(turn_keys) == any(s.startswith("env.") for s in sets)
        for key in ZERO_KEYS + tuple(k for k in turn_keys if r[k] == r[k]):  # NaN: a turn no episode reached
            assert r[key] == 0.0, (r["step"], key, r[key])
        assert r["parity/num_tokens"] > 0
        if "parity/topk_kl" in r or "parity.topk=4" in sets:
            assert r["parity/topk_kl"] == 0.0
    evals = [r for r in rows if "eval/parity/mae" in r]
    assert [r["step"] for r in evals] == ([0, 3] if "eval.every=3" in sets else [])
    for r in evals:
        assert r["eval/parity/num_tokens"] > 0 and r["eval/parity/mae"] == 0.0 and r["eval/parity/max_abs"] == 0.0, r
    probes = [r for r in rows if "probe/mae" in r]
    assert probes and all(r["probe/mae"] == 0.0 and r["probe/max_abs"] == 0.0 for r in probes)
    # the policy did move between the steps (the zeros are not those of an unchanged model)
    assert any(abs(r["train/grad_norm"]) > 0 for r in steps)
    if any(s.startswith("algorithm.kl_coef") for s in sets):  # the penalty ran (means over the two epochs: the second one has moved). Measured on
        # the Trainer-built warm start: 3.16 at step 1 (k3 on tokens the reference sampled, after an update that
        # pushed the wrong answers down), 0.0056 at step 2 (tokens the updated policy sampled); earlier < 1.
        assert all(0.0 < r["train/kl_ref"] < 10.0 for r in steps)


def test_off_policy_split_numerics_exactly_zero_while_the_lag_is_measured(tmp_path):
    """rollout.max_staleness 2, colocated: parity/* compares the engine with the trainer under the adapter that
    sampled each batch (exactly 0 in exact mode), staleness/* that adapter with the trainer's current one (> 0
    from step 2): the split puts the whole mismatch of a stale batch in the lag and none in the numerics."""
    rows = [r for r in _run(tmp_path, "exact-k2", "model.dtype=float32", "rollout.max_staleness=2", "train.steps=4",
                            "rollout.prompts_per_step=4", "algorithm.group_size=4", "train.micro_batch_size=16")
            if "parity/mae" in r]
    assert [r["staleness/lag"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    for r in rows:
        for key in ZERO_KEYS:
            assert r[key] == 0.0, (r["step"], key, r[key])
    assert rows[0]["staleness/kl_k3"] == 0.0 and all(r["staleness/kl_k3"] > 0.0 for r in rows[1:])


def test_float32_numerics_stay_at_their_level_three_steps_off_policy(tmp_path):
    """Without exact mode, float32 on both sides, rollout.max_staleness 3: parity/mae at float32's level (<= 1e-4,
    docs/parity-metrics.md) at every lag, while staleness/* is the lag's."""
    cfg = load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [
        "name=fp32-k3", f"logging.run_dir={tmp_path / 'fp32-k3'}", "logging.wandb.mode=disabled", "checkpoint.every=0",
        "eval.every=0", "model.dtype=float32", "train.steps=4", "rollout.max_staleness=3", "rollout.prompts_per_step=4",
        "algorithm.group_size=4", "train.micro_batch_size=16"])
    history = train(cfg).history
    print("float32 k=3:", [(h["staleness/lag"], f"{h['parity/mae']:.1e}", f"{h['staleness/mae']:.1e}") for h in history])
    assert [h["staleness/lag"] for h in history] == [0.0, 1.0, 2.0, 3.0]
    assert all(h["parity/mae"] <= 1e-4 for h in history)
    assert all(h["staleness/mae"] > 100 * h["parity/mae"] for h in history[1:])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_architecture_matrix_decode_is_reproduced_bit_for_bit(arch):
    """Qwen2's q/k/v biases and Qwen3's per-head q/k norms, std-0.2 weights (trainer/builtin/zoo.py), exact engine."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import rollout.vllm_plugins.exact_quant  # noqa: F401  (registers the exact engine's method)
    from rollout.vllm_engine import VLLMEngine
    from rollout.vllm_plugins.names import EXACT
    from trainer.builtin.zoo import ensure_arch_model

    model_dir = str(ensure_arch_model(arch, dtype="float32"))
    config = AutoConfig.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with VLLMEngine(model_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 * 1024**2,
                    quantization=EXACT) as engine:
        ef = EngineForward(engine, config)
        ef.set_weights({k: v.detach() for k, v in hf.state_dict().items()})
        r = engine.generate(ARCH_PROMPTS, SamplingSpec(n=4, temperature=1.0, max_new_tokens=40, seed=3))
        lps = ef.logprobs([p + c for p, c in zip(r.prompt_ids, r.completion_ids)], [len(p) for p in r.prompt_ids])
    for k, lp in enumerate(lps):
        assert torch.equal(lp, torch.tensor(r.rollout_logprobs[k], dtype=torch.float32)), k




def test_float32_parity_over_episodes_is_as_small_as_single_turn(tmp_path):
    """Without exact mode, float32 on both sides: the turns after a reply agree with the engine as the first does
    (the reply's ids are in both forwards' context), within single-turn float32's level (docs/parity-metrics.md)."""
    cfg = load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [
        "name=episodes-fp32", f"logging.run_dir={tmp_path / 'episodes-fp32'}", "logging.wandb.mode=disabled",
        "checkpoint.every=0", "eval.every=0", "model.dtype=float32", "train.steps=2", "rollout.prompts_per_step=4",
        "algorithm.group_size=4", "train.micro_batch_size=16", f"env.class={ENVS}:FollowUp", "env.max_turns=2",
        "env.max_tokens=128"])
    history = train(cfg).history
    print("float32 episodes:", [{k: f"{v:.2e}" for k, v in h.items() if k.startswith("parity/turn_")} for h in history])
    for h in history:
        assert h["parity/mae"] <= 1e-4 and h["parity/turn_1/mae"] <= 1e-4
        assert h["episode/turns"] > 1 and h["parity/turn_2/mae"] <= 1e-4
