"""The recipe's teacher: section and algorithm.distill_coef (trainer/config/validate.py ``_check_teacher``): each
mistake refused in one line naming the key, the value and what was expected."""
from pathlib import Path

import pytest

from trainer.config import RecipeError
from trainer.lifecycle.preflight import load_recipe

REPO = Path(__file__).resolve().parents[3]
OPD = REPO / "recipes" / "opd_tiny.yaml"
GRPO = REPO / "recipes" / "grpo_tiny.yaml"


def refused(recipe, *overrides) -> str:
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe, list(overrides), check_paths=False)
    return str(e.value)


def test_opd_recipe_loads_with_its_teacher():
    cfg = load_recipe(OPD, check_paths=False)
    assert cfg.algorithm.name == "opd" and cfg.teacher.path == "builtin:tiny-tools-teacher" and cfg.teacher.engine == "vllm"
    assert cfg.teacher.dtype is None and cfg.algorithm.distill_coef == 0.0
    cfg = load_recipe(GRPO, ["algorithm.distill_coef=0.5", "teacher.path=builtin:tiny-teacher"], check_paths=False)
    assert cfg.algorithm.distill_coef == 0.5


def test_opd_without_a_teacher():
    msg = refused(OPD, "teacher.path=null")
    assert "teacher.path = None: expected a model with the student's tokenizer for algorithm.name opd" in msg


def test_distill_coef_without_a_teacher_and_a_teacher_nothing_reads():
    assert "teacher.path = None: expected a model with the student's tokenizer for algorithm.distill_coef" in \
        refused(GRPO, "algorithm.distill_coef=0.1")
    assert "teacher.path = 'builtin:tiny-teacher': expected null unless" in refused(GRPO, "teacher.path=builtin:tiny-teacher")


@pytest.mark.parametrize("overrides, key, expected", [
    (["algorithm.distill_coef=-1"], "algorithm.distill_coef = -1", "a number >= 0"),
    (["algorithm.name=rloo", "algorithm.distill_coef=0.5"], "algorithm.distill_coef = 0.5",
     "0 for rloo: its loss takes one advantage per sequence"),
])
def test_distill_coef_refusals(overrides, key, expected):
    msg = refused(GRPO, "teacher.path=builtin:tiny-teacher", *overrides)
    assert key in msg and expected in msg


def test_distill_coef_with_ppo_loads():
    cfg = load_recipe(GRPO, ["teacher.path=builtin:tiny-teacher", "algorithm.name=ppo", "algorithm.group_size=1",
                             "algorithm.distill_coef=0.5"], check_paths=False)
    assert cfg.algorithm.name == "ppo" and cfg.algorithm.distill_coef == 0.5


def test_opd_refuses_its_own_coefficient_and_bad_teacher_keys():
    assert "algorithm.distill_coef = 0.5: expected 0 with algorithm.name opd" in refused(OPD, "algorithm.distill_coef=0.5")
    assert "teacher.parity_every = -1" in refused(OPD, "teacher.parity_every=-1")
    assert "teacher.engine" in refused(OPD, "teacher.engine=tcp")
    assert "teacher.dtype" in refused(OPD, "teacher.dtype=int8")


def test_opd_discount_key():
    assert load_recipe(OPD, check_paths=False).algorithm.options.gamma == 0.0  # the per-token surrogate
    assert load_recipe(OPD, ["algorithm.gamma=1"], check_paths=False).algorithm.options.gamma == 1.0
    assert "algorithm.gamma = 1.5: expected a number in [0, 1]" in refused(OPD, "algorithm.gamma=1.5")
    assert "algorithm.gamma" in refused(OPD, "algorithm.gamma=yes")


def test_unknown_builtin_teacher_is_refused_with_the_key(tmp_path):
    with pytest.raises(RecipeError, match=r"teacher.path = 'builtin:nope': unknown built-in model"):
        load_recipe(OPD, ["teacher.path=builtin:nope"])
    with pytest.raises(RecipeError, match=r"teacher.path = .*: no such directory"):
        load_recipe(OPD, [f"teacher.path={tmp_path / 'missing'}"])


def test_teacher_server_keys():
    cfg = load_recipe(OPD, ["teacher.engine=server", "teacher.server_url=http://127.0.0.1:8001"], check_paths=False)
    assert cfg.teacher.server_url == "http://127.0.0.1:8001" and cfg.teacher.server_timeout_s == 300.0
    assert "teacher.server_url = None: expected the teacher server's http://HOST:PORT" in \
        refused(OPD, "teacher.engine=server")
    assert "teacher.server_url = 'localhost:8001': expected http://HOST:PORT" in \
        refused(OPD, "teacher.engine=server", "teacher.server_url=localhost:8001")
    assert "teacher.server_url = 'http://127.0.0.1:8001': expected null unless teacher.engine is server or vllm_url" in \
        refused(OPD, "teacher.server_url=http://127.0.0.1:8001")
    assert "teacher.server_timeout_s = 0" in refused(OPD, "teacher.engine=server",
                                                     "teacher.server_url=http://127.0.0.1:8001",
                                                     "teacher.server_timeout_s=0")


def test_teacher_vllm_url_keys():
    cfg = load_recipe(OPD, ["teacher.engine=vllm_url", "teacher.server_url=https://teacher.example/vllm"],
                      check_paths=False)
    assert cfg.teacher.engine == "vllm_url" and cfg.teacher.server_url == "https://teacher.example/vllm"
    assert "teacher.server_url = None: expected a vLLM server's http(s)://HOST[:PORT] with teacher.engine vllm_url" \
        in refused(OPD, "teacher.engine=vllm_url")
    assert "teacher.server_url = 'http://127.0.0.1:8001/v1': expected the server's root, without /v1" in \
        refused(OPD, "teacher.engine=vllm_url", "teacher.server_url=http://127.0.0.1:8001/v1")
    assert "teacher.server_url = 'localhost:8001': expected http(s)://HOST[:PORT]" in \
        refused(OPD, "teacher.engine=vllm_url", "teacher.server_url=localhost:8001")
