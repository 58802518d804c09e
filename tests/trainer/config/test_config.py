"""Recipe validation: one test per class of bad input; each error names key, value and expectation."""
from pathlib import Path

import pytest

from trainer.config import RecipeError, RunConfig, parse_override
from trainer.lifecycle.preflight import load_recipe

REPO = Path(__file__).resolve().parents[3]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_every_shipped_rl_recipe_validates():
    rl = [p for p in sorted((REPO / "recipes").glob("*.yaml")) if not p.name.startswith(("sft", "rm"))]
    assert len(rl) >= 9
    for p in rl:
        cfg = load_recipe(p, check_paths=False)
        assert isinstance(cfg, RunConfig) and cfg.name == p.stem


def test_defaults_and_overrides(tmp_path):
    p = write(tmp_path, "name: x\ntrain: {steps: 3}\n")
    cfg = load_recipe(p, ["train.learning_rate=1e-4", "algorithm.group_size=4", "rollout.engine=hf"])
    assert cfg.train.steps == 3 and cfg.train.learning_rate == pytest.approx(1e-4)
    assert cfg.algorithm.group_size == 4 and cfg.rollout.engine == "hf"
    assert cfg.run_dir == Path("runs/x")
    assert isinstance(cfg.train.learning_rate, float)


@pytest.mark.parametrize("text, needles", [
    ("trian: {steps: 3}\n", ["unknown key 'trian'", "train"]),
    ("train: {stpes: 3}\n", ["unknown key 'train.stpes'", "steps"]),
    ("train: {steps: three}\n", ["train.steps = 'three'", "an integer"]),
    ("train: {steps: 2.5}\n", ["train.steps = 2.5", "an integer"]),
    ("rollout: {sync_weights: 'yes'}\n", ["rollout.sync_weights", "true or false"]),
    ("rollout: {sync_chunk_bytes: 0}\n", ["rollout.sync_chunk_bytes = 0", ">= 1"]),
    ("algorithm: {loss_agg: mean}\n", ["algorithm.loss_agg = 'mean'", "token_mean"]),
    ("algorithm: {group_size: 1}\n", ["algorithm.group_size = 1", ">= 2"]),
    ("train: {learning_rate: -0.001}\n", ["train.learning_rate = -0.001", "> 0"]),
    ("rollout: {temperature: 0}\n", ["rollout.temperature = 0", "> 0"]),
    ("rollout: {top_p: 0.0}\n", ["rollout.top_p = 0.0", "(0, 1]"]),
    ("algorithm: {name: ppo2}\n", ["algorithm.name = 'ppo2'", "grpo"]),
    ("algorithm: {name: pmd_mean, kl_coef: 0.01}\n", ["algorithm.kl_coef = 0.01", "PMD has no KL"]),
    ("algorithm: {name: pmd_part, tau: 0}\n", ["algorithm.tau = 0.0", "> 0"]),
    ("algorithm: {mini_batches: 5}\n", ["algorithm.mini_batches = 5", "divisor of the 128 samples"]),
    ("algorithm: {epochs: 0}\n", ["algorithm.epochs = 0", ">= 1"]),
    ("algorithm: {name: ppo, dynamic_sampling: true}\n", ["algorithm.dynamic_sampling = True", "false for ppo"]),
    ("algorithm: {dynamic_sampling: true, max_sampling_rounds: 0}\n", ["algorithm.max_sampling_rounds = 0", ">= 1"]),
    ("reward: {functions: {acc: not_a_spec}}\n", ["reward.functions.acc = 'not_a_spec'", "module:function"]),
    ("reward: {weights: {nope: 1.0}}\n", ["reward.weights.nope", "exact_answer"]),
    ("model: {lora: {target_modules: [q_proj, lm_head]}}\n", ["model.lora.target_modules", "lm_head"]),
    ("[1, 2]\n", ["expected a mapping"]),
    ("parity: {correction: {rule: token_tis, token_tis: {cap: -1}}}\n",
     ["parity.correction.token_tis.cap = -1.0", ">= 1"]),
    ("parity: {max_mae: 0}\n", ["parity.max_mae = 0.0", "> 0"]),
    ("parity: {on_violation: abort}\n", ["parity.on_violation = 'abort'", "'stop'"]),
    ("parity: {correction: {rule: icepop}}\n", ["parity.correction.rule = 'icepop'", "token_mis, token_tis"]),
    ("rollout: {top_k: 1}\n", ["rollout.top_k = 1", "greedy decoding"]),
    # Sampling options the trainer cannot reproduce: refused with the reason, not as unknown keys.
    ("rollout: {repetition_penalty: 1.1}\n", ["rollout.repetition_penalty = 1.1", "not supported",
                                              "sequence so far", "parity metrics"]),
    ("rollout: {min_tokens: 5}\n", ["rollout.min_tokens = 5", "suppresses EOS"]),
    ("rollout: {logit_bias: {7: 2.0}}\n", ["rollout.logit_bias", "not supported"]),
    ("model: {lora: {dropout: 0.05}}\n", ["model.lora.dropout = 0.05", "dropout noise"]),
    ("parity: {topk: -1}\n", ["parity.topk = -1", "[0, 256]"]),
    ("parity: {topk: 1000}\n", ["parity.topk = 1000", "[0, 256]"]),
    ("parity: {probe_prompts: -2}\n", ["parity.probe_prompts = -2", ">= 0"]),
    ("precision: {recipe: fp16}\n", ["model.dtype = 'bfloat16'", "float16 with precision.recipe fp16"]),
    ("model: {dtype: float16}\n", ["model.dtype = 'float16'", "float16 runs with precision.recipe fp16"]),
    ("precision: {recipe: fp8_unified}\nmodel: {dtype: float32}\n", ["model.dtype = 'float32'", "BF16 master"]),
    ("precision: {recipe: fp8_rollout}\nrollout: {engine: hf}\n", ["rollout.engine = 'hf'", "no FP8 path"]),
    ("precision: {recipe: fp4}\n", ["precision.recipe = 'fp4'", "fp8_unified"]),
    ("rollout: {mode: server, server_url: '127.0.0.1:8000'}\n", ["rollout.server_url = '127.0.0.1:8000'", "http://HOST:PORT"]),
    ("rollout: {server_timeout_s: 0}\n", ["rollout.server_timeout_s = 0.0", "> 0"]),
    ("rollout: {mode: remote}\n", ["rollout.mode = 'remote'", "server"]),
])
def test_bad_values_are_named(tmp_path, text, needles):
    p = write(tmp_path, text)
    with pytest.raises(RecipeError) as e:
        load_recipe(p, check_paths=False)
    msg = str(e.value)
    assert str(p) in msg
    for n in needles:
        assert n in msg, msg


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_invalid_yaml(tmp_path):
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(write(tmp_path, "train: {steps: [\n"))


def test_missing_model_directory(tmp_path):
    p = write(tmp_path, f"model: {{path: {tmp_path / 'no_model'}}}\n")
    with pytest.raises(RecipeError, match=r"model.path = .*no_model.*no such directory"):
        load_recipe(p)


def test_model_directory_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    p = write(tmp_path, f"model: {{path: {tmp_path / 'm'}}}\n")
    with pytest.raises(RecipeError, match="no config.json"):
        load_recipe(p)


def test_missing_dataset_file(tmp_path):
    p = write(tmp_path, f"data: {{source: {tmp_path / 'prompts.jsonl'}}}\n")
    with pytest.raises(RecipeError, match=r"data.source = .*prompts.jsonl.*no such file"):
        load_recipe(p)


def test_unknown_builtin_model(tmp_path):
    with pytest.raises(RecipeError, match="unknown built-in model"):
        load_recipe(write(tmp_path, "model: {path: 'builtin:huge'}\n"))


def test_max_new_tokens_above_context(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text('{"max_position_embeddings": 128}')
    p = write(tmp_path, f"model: {{path: {m}}}\ndata: {{max_prompt_tokens: 64}}\nrollout: {{max_new_tokens: 100}}\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert "rollout.max_new_tokens = 100" in str(e.value) and "164" in str(e.value) and "128" in str(e.value)


def test_a_vllm_teacher_needs_one_position_more_than_the_student(tmp_path):
    # the student's episodes fill the tiny model's 256 positions; vLLM samples a token after the scored sequence
    sets = ["env.max_tokens=256"]
    with pytest.raises(RecipeError) as e:
        load_recipe(REPO / "recipes" / "opd_tiny.yaml", sets)
    assert ("env.max_tokens = 256: the student's sequences of up to 256 tokens need 257 positions in the teacher's "
            "engine") in str(e.value) and "context of 256" in str(e.value) and "at most 255 tokens" in str(e.value)
    assert load_recipe(REPO / "recipes" / "opd_tiny.yaml", [*sets, "teacher.engine=hf"]).env.max_tokens == 256


def test_builtin_context_is_checked_without_building(tmp_path):
    p = write(tmp_path, "rollout: {max_new_tokens: 100000}\n")
    with pytest.raises(RecipeError, match="exceeds the model's context"):
        load_recipe(p)


def test_override_parsing():
    assert parse_override("train.steps=5") == ("train.steps", 5)
    assert parse_override("model.path=/x/y") == ("model.path", "/x/y")
    assert parse_override("rollout.sync_weights=false") == ("rollout.sync_weights", False)
    with pytest.raises(RecipeError, match="key=value"):
        parse_override("train.steps")


def test_override_into_a_scalar_is_refused(tmp_path):
    p = write(tmp_path, "name: x\n")
    with pytest.raises(RecipeError, match="holds a value"):
        load_recipe(p, ["name.sub=3"])


def test_every_problem_of_a_recipe_at_once(tmp_path, capsys):
    """Type errors of every key (nested sections and the algorithm's options too) in one report, with the rules'
    problems of the other keys; the rules, each section's first problem; the CLI prints one line per problem and
    exits 2."""
    from trainer.cli import main

    p = tmp_path / "r.yaml"
    p.write_text("train: {steps: many, learning_rate: -1, seed: 0.5}\nrollout: {temperature: hot}\n"
                 "algorithm: {name: gspo, clip_eps_low: x, tau: 0.1}\nlogging: {wandb: {mode: loud}}\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p, check_paths=False)
    expected = [f"{p}: train.steps = 'many': expected an integer", f"{p}: train.seed = 0.5: expected an integer",
                f"{p}: rollout.temperature = 'hot': expected a number",
                f"{p}: algorithm.tau = 0.1: not an option of gspo; it belongs to pmd_mean",
                f"{p}: algorithm.clip_eps_low = 'x': expected a number",
                f"{p}: logging.wandb.mode = 'loud': expected one of 'auto', 'online', 'offline', 'disabled'",
                # and the rules, on the keys whose types are sound (trainer.config.load.build_and_validate)
                f"{p}: train.learning_rate = -1.0: expected a number > 0"]
    assert len(e.value.problems) == len(expected)
    for line, needle in zip(e.value.problems, expected):
        assert line.startswith(needle), (line, needle)
    # types sound, rules broken in two sections: both reported (each section's first)
    p.write_text("train: {steps: 0, learning_rate: -1}\nrollout: {temperature: 0}\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p, check_paths=False)
    assert [line.split(": ", 1)[1].split(" =")[0] for line in e.value.problems] == ["rollout.temperature",
                                                                                     "train.steps"]
    assert main(["train", str(p)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith(f"parityrl: invalid recipe: {p}: ") for line in err)


def test_rules_shared_with_compare_take_the_callers_key_names():
    """The rules `parityrl compare` shares with a recipe's validation name the caller's own keys."""
    from trainer.config.validate import sampling_rules, topk_range
    from trainer.precision import recipe_for
    from trainer.precision.checks import dtype_rule, hf_engine_rule

    assert [key for ok, key, *_ in sampling_rules(0.0, 1, 1.0, prefix="") if not ok] == ["top_p", "top_k", "min_p"]
    assert all(ok for ok, *_ in sampling_rules(1.0, 0)) and all(ok for ok, *_ in sampling_rules(0.9, 20, 0.05))
    assert topk_range(257, key="topk")[:3] == (False, "topk", 257) and topk_range(0)[0]
    broken = [(key, expected) for ok, key, _, expected in [dtype_rule(recipe_for("fp8_unified"), "float32",
                                                                      recipe_key="precision", dtype_key="dtype")] if not ok]
    assert broken == [("dtype", "bfloat16 with precision fp8_unified (BF16 master weights; the FP8 layers dequantize "
                                "to BF16); float32 runs with precision bf16 or exact")]
    assert hf_engine_rule(recipe_for("fp8_rollout"), "hf", engine_key="engine")[:3] == (False, "engine", "hf")
    assert hf_engine_rule(recipe_for("bf16"), "hf")[0]


def test_truncated_sampling_is_accepted_and_its_bad_values_refused():
    from trainer.config import RecipeError
    from trainer.lifecycle.preflight import load_recipe

    cfg = load_recipe("recipes/grpo_tiny.yaml", ["rollout.top_p=0.9", "rollout.top_k=20", "rollout.min_p=0.05"],
                      check_paths=False)
    assert (cfg.rollout.top_p, cfg.rollout.top_k, cfg.rollout.min_p) == (0.9, 20, 0.05)
    for sets, key in ((["rollout.top_k=1"], "rollout.top_k = 1: expected 0 (off) or an integer >= 2"),
                      (["rollout.min_p=1.0"], "rollout.min_p = 1.0")):
        with pytest.raises(RecipeError, match=key.replace("(", r"\(").replace(")", r"\)")):
            load_recipe("recipes/grpo_tiny.yaml", sets, check_paths=False)
    with pytest.raises(RecipeError, match="rollout.repetition_penalty = 1.1: not supported"):
        load_recipe("recipes/grpo_tiny.yaml", ["rollout.repetition_penalty=1.1"], check_paths=False)


def test_env_tools_written_as_a_mapping_is_told_the_form_it_wants():
    from trainer.config import RecipeError
    from trainer.lifecycle.preflight import load_recipe

    with pytest.raises(RecipeError, match=r"env.tools = \{'calc': 'mymod:calc'\}: expected a string 'module:NAME' .* "
                                          r"naming a mapping name -> function .* the mapping itself goes in the module"):
        load_recipe("recipes/grpo_tiny.yaml", ["env.tools={calc: mymod:calc}"], check_paths=False)
