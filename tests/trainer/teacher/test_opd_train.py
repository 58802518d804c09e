"""A few on-policy distillation steps with the real vLLM engines on the tiny models (slow tier): the session's
student engine (tests/conftest.py, builtin:tiny) and a teacher engine this test starts for builtin:tiny-teacher."""
import copy
import math
from pathlib import Path

import pytest
import torch

from trainer.algorithms import ALGORITHMS, AdvantageInputs
from trainer.algorithms.ppo import gae
from trainer.lifecycle.preflight import load_recipe
from trainer.rl import loop
from trainer.rl.loop import train

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow

# float32 on both sides of the teacher (its vLLM engine, the trainer's fused kernel): the level
TEACHER_PARITY_FP32 = 1e-4


def opd_cfg(tmp_path, name, *overrides):
    # the arithmetic task's recipe with the arithmetic teacher: the session's engine serves builtin:tiny
    # (recipes/opd_tiny.yaml distils builtin:tiny-tools on episodes)
    return load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [
        "algorithm.name=opd", "teacher.path=builtin:tiny-teacher", "teacher.engine=vllm", "parity.topk=1",
        f"name={name}", f"logging.run_dir={tmp_path / name}", "logging.wandb.mode=disabled", "train.steps=3",
        "rollout.prompts_per_step=4", "algorithm.group_size=4", "train.micro_batch_size=16", "eval.every=0",
        "checkpoint.every=0", "parity.probe_prompts=0", *overrides])


def test_opd_steps_score_the_student_ids_with_the_teacher(tmp_path, vllm_engine):
    res = train(opd_cfg(tmp_path, "opd", "teacher.dtype=float32", "teacher.parity_every=1"), engine=vllm_engine)
    assert len(res.history) == 3
    for h in res.history:
        # the teacher scored every sampled token of the step; its engine agrees with the trainer's kernel
        assert h["teacher_parity/num_tokens"] == h["parity/num_tokens"] > 0
        assert h["teacher_parity/mae"] <= TEACHER_PARITY_FP32, h["teacher_parity/mae"]
        assert math.isfinite(h["distill/reverse_kl"]) and 0 <= h["distill/top1_agree"] <= 1
        assert 0 <= h["distill/teacher_noise_frac"] < 0.1
        assert h["train/grad_norm"] > 0  # the distillation advantage moved the student
    # a different model: the student's samples are less likely under the teacher on average (E[rkl] = KL >= 0)
    assert sum(h["distill/reverse_kl"] for h in res.history) > 0


def capture_score_phase(monkeypatch):
    """Records what the loop's score phase is given (the batch, the task rewards, the teacher's log-probs) and the
    advantages it returns; with a critic, also what ppo_targets returns and what it returns without the teacher."""
    seen = {}
    real_score_phase, real_ppo_targets = loop.score_phase, loop.ppo_targets

    def score_phase(run, step, batch, rewards, m, teacher_lp=None):
        out = real_score_phase(run, step, batch, rewards, m, teacher_lp)
        seen.update(batch=batch, rewards=rewards.detach().clone(), teacher_lp=teacher_lp, advantages=out[1],
                    options=run.cfg.algorithm.options, group_size=run.cfg.algorithm.group_size)
        return out

    def ppo_targets(scored, rewards, mask, group_size, cfg, controller, all_sum=None, distill=None):
        # the same targets without the teacher's term first, on a copy of the controller (its update is state)
        seen["returns_without"] = real_ppo_targets(scored, rewards, mask, group_size, cfg, copy.deepcopy(controller),
                                                   all_sum=all_sum, distill=None)[1]
        out = real_ppo_targets(scored, rewards, mask, group_size, cfg, controller, all_sum=all_sum, distill=distill)
        seen["returns"] = out[1]
        return out

    monkeypatch.setattr(loop, "score_phase", score_phase)
    monkeypatch.setattr(loop, "ppo_targets", ppo_targets)
    return seen


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])  # ppo: in each token's reward before the critic's GAE
def test_distill_coef_beside_the_task_reward(tmp_path, vllm_engine, algorithm, monkeypatch):
    seen = capture_score_phase(monkeypatch)
    coef = 0.5
    # the teacher: any model with the student's tokenizer; builtin:tiny-base (the student before its warm start) is
    # built by the student's own build, and differs from it enough for the term to be visible
    res = train(opd_cfg(tmp_path, f"{algorithm}_distill", f"algorithm.name={algorithm}", f"algorithm.distill_coef={coef}",
                        "teacher.path=builtin:tiny-base", "teacher.engine=hf", "teacher.parity_every=0",
                        "train.steps=1"), engine=vllm_engine)
    h = res.history[0]
    assert math.isfinite(h["distill/reverse_kl"]) and "teacher_parity/mae" not in h and h["train/grad_norm"] > 0
    # the teacher's term, computed here from the batch: -(log pi_student (engine) - log pi_teacher) per sampled token
    batch, mask = seen["batch"], seen["batch"].mask
    valid = mask != 0
    signal = torch.where(valid, -(batch.rollout_logprobs.double() - seen["teacher_lp"].double()), 0.0)
    assert signal[valid].abs().max() > 1e-2  # a different model: the term is not negligible
    if algorithm == "grpo":
        # the advantages the update used = the task's (GRPO of the step's rewards) + coef x the teacher's term
        task = ALGORITHMS.get("grpo").advantage(
            AdvantageInputs(rewards=seen["rewards"], mask=mask, group_size=seen["group_size"]), seen["options"])
        want = torch.where(valid, task.double() + coef * signal, 0.0)
        assert torch.allclose(seen["advantages"].double(), want, atol=1e-5, rtol=0)
    else:
        # GAE is linear in the token rewards: the value targets move by GAE(coef x the term) with values 0
        o = seen["options"]
        moved = gae(coef * signal, torch.zeros_like(signal), mask, o.gamma, o.lam)[0]
        got = (seen["returns"] - seen["returns_without"]).double()
        assert torch.allclose(got, moved, atol=1e-5, rtol=0)
