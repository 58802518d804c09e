"""A few on-policy distillation steps with the real vLLM engines on the tiny models (slow tier): the session's
student engine (tests/conftest.py, builtin:tiny) and a teacher engine this test starts for builtin:tiny-teacher."""
import math
from pathlib import Path

import pytest

from trainer.lifecycle.preflight import load_recipe
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


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])  # ppo: in each token's reward before the critic's GAE
def test_distill_coef_beside_the_task_reward(tmp_path, vllm_engine, algorithm):
    res = train(opd_cfg(tmp_path, f"{algorithm}_distill", f"algorithm.name={algorithm}", "algorithm.distill_coef=0.5",
                        "teacher.engine=hf", "teacher.parity_every=0", "train.steps=1"), engine=vllm_engine)
    h = res.history[0]
    assert math.isfinite(h["distill/reverse_kl"]) and "teacher_parity/mae" not in h and h["train/grad_norm"] > 0
