"""The recipe's env: section: every mistake refused when the recipe is read, naming the file, key and value."""
from pathlib import Path

import pytest
import yaml

from trainer.config import RecipeError, to_dict
from trainer.environments.episode_environment import EpisodeEnvironment
from trainer.lifecycle.preflight import check_before_loading, load_recipe

ENVS = Path(__file__).resolve().parents[1] / "rl" / "episode_envs.py"


def recipe(tmp_path: Path, env: str, extra: str = "") -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(f"name: t\nmodel: {{path: 'builtin:tiny'}}\nlogging: {{run_dir: {tmp_path / 'run'}}}\n"
                 f"env: {env}\n{extra}")
    return p


def test_a_tools_recipe_reads_and_round_trips_the_class_key(tmp_path):
    cfg = load_recipe(recipe(tmp_path, f"{{class: '{ENVS}:FollowUp', max_turns: 2, max_tokens: 200}}"))
    assert cfg.env.class_ == f"{ENVS}:FollowUp" and cfg.env.enabled
    written = to_dict(cfg)["env"]
    assert written["class"] == f"{ENVS}:FollowUp" and "class_" not in written  # as a recipe writes it
    assert load_recipe(recipe(tmp_path, yaml.safe_dump(written, default_flow_style=True).strip())).env == cfg.env


@pytest.mark.parametrize("env, says", [
    ("{class: 'x:A', tools: 'builtin:arithmetic_calculator', max_tokens: 200}", "env.tools = 'builtin:arithmetic_calculator': expected null with env.class set"),
    ("{tools: 'calculator', max_tokens: 200}", "env.tools = 'calculator': expected 'module:Name'"),
    ("{tools: 'builtin:arithmetic_calculator', max_turns: 0, max_tokens: 200}", "env.max_turns = 0: expected an integer >= 1"),
    ("{tools: 'builtin:arithmetic_calculator', max_tokens: 20}", "env.max_tokens = 20: expected null or at least"),
    ("{tools: 'builtin:arithmetic_calculator', timeout_s: 0, max_tokens: 200}", "env.timeout_s = 0"),
    ("{tools: 'builtin:nothing', max_tokens: 200}", "env.tools = 'builtin:nothing': unknown builtin tools"),
    ("{class: 'builtin:arithmetic_calculator', max_tokens: 1000}", "env.max_tokens = 1000: an episode's token budget of 1000"),
    (f"{{class: '{ENVS}:Missing', max_tokens: 200}}", "has no attribute 'Missing'"),
    ("{klass: 'x:A'}", "unknown key 'env.klass' (did you mean 'env.class'?)"),
])
def test_refused_with_the_key_and_what_was_expected(tmp_path, env, says):
    with pytest.raises(RecipeError) as e:  # what `parityrl train` runs before anything loads
        check_before_loading(recipe(tmp_path, env), model=False)
    assert says in str(e.value) and "r.yaml" in str(e.value), str(e.value)


def test_an_environment_class_without_step_is_refused_by_name(tmp_path):
    bad = tmp_path / "envs.py"
    bad.write_text("class NoStep:\n    def reset(self, row):\n        return None\n")
    with pytest.raises(RecipeError, match=r"env.class = .*NoStep.*has no method step\(self, message\)"):
        check_before_loading(recipe(tmp_path, f"{{class: '{bad}:NoStep', max_tokens: 200}}"), model=False)


def test_a_tool_without_type_hints_is_refused_by_name(tmp_path):
    bad = tmp_path / "tools.py"
    bad.write_text("def add(a, b):\n    return a + b\n\nTOOLS = {'add': add}\n")
    with pytest.raises(RecipeError, match=r"env.tools = .*TOOLS.*'add'"):
        check_before_loading(recipe(tmp_path, f"{{tools: '{bad}:TOOLS', max_tokens: 200}}"), model=False)


def test_reward_models_and_a_reward_named_env_are_refused_with_env(tmp_path):
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe(tmp_path, "{tools: 'builtin:arithmetic_calculator', max_tokens: 200}",
                           "reward: {functions: {env: 'trainer.data.tasks.arithmetic:exact_answer_reward'}}\n"))
    assert "reward.functions.env" in str(e.value)


def test_tools_on_a_template_without_tool_support_are_refused(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    cfg = load_recipe(recipe(tmp_path, "{tools: 'builtin:arithmetic_calculator', max_tokens: 200}"))
    env = EpisodeEnvironment.from_config(cfg, "r.yaml")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    env.check_template(tok, cfg, "r.yaml")  # the tiny template lists the tools
    tok.chat_template = tok.chat_template.replace("{% if tools %}", "{% if false %}")
    with pytest.raises(RecipeError, match=r"r.yaml: env.tools: the chat template .* does not offer tools .*calculate"):
        env.check_template(tok, cfg, "r.yaml")
