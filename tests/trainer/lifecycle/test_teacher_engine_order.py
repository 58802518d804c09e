"""A dense teacher on a colocated vLLM engine beside an MoE student is refused before any engine starts
(trainer.lifecycle.teacher_checks.check_engine_order); the other pairings pass. Configs only: nothing loads."""
import json
from pathlib import Path

import pytest

from trainer.config import RecipeError
from trainer.lifecycle.preflight import load_recipe
from trainer.lifecycle.teacher_checks import check_engine_order

REPO = Path(__file__).resolve().parents[3]
DENSE = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
       "num_experts": 8, "num_experts_per_tok": 2}


def _dir(root: Path, config: dict) -> str:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


@pytest.fixture
def dirs(tmp_path):
    return _dir(tmp_path / "dense", DENSE), _dir(tmp_path / "moe", MOE)


def _cfg(*sets):
    return load_recipe(REPO / "recipes" / "grpo_tiny.yaml", ["algorithm.name=opd", "teacher.path=/t", *sets],
                       check_paths=False)


def test_a_dense_teacher_engine_beside_an_moe_student_is_refused(dirs):
    dense, moe = dirs
    with pytest.raises(RecipeError, match=r"^r: teacher.path = '/t': a dense teacher on a colocated vLLM engine "
                                          r"\(teacher.engine vllm\) cannot run beside the mixture-of-experts student"
                                          r".*expected teacher.engine hf, server or vllm_url$"):
        check_engine_order(_cfg(), moe, dense, "r")


def test_the_pairings_vllm_can_start_pass(dirs):
    dense, moe = dirs
    for student, teacher in ((dense, moe), (moe, moe), (dense, dense)):
        check_engine_order(_cfg(), student, teacher, "r")
    # a teacher that is not a second colocated vLLM engine
    for sets in (["teacher.engine=hf"], ["teacher.engine=vllm_url", "teacher.server_url=http://h:1"],
                 ["rollout.engine=hf"]):
        check_engine_order(_cfg(*sets), moe, dense, "r")
