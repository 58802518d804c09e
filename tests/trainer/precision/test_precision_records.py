"""The precision recipes' records: every recipe registered, the names and CLI choices from the registry, each
record's engine options, transform and capabilities, and each refusal with its message."""
from pathlib import Path

import pytest
from transformers import LlamaConfig, MixtralConfig

import trainer.precision.fp8_unified
from rollout.vllm_plugins.names import EMULATED_FP8, EXACT
from trainer.config import PrecisionConfig, RecipeError
from trainer.diagnostics.compare_inputs import CompareError, check_settings
from trainer.lifecycle.preflight import load_recipe
from trainer.precision import DEFAULT_RECIPE, RECIPES, compare_choices, recipe_for
from trainer.precision.checks import check_launch, check_model_config, recipe_rules, server_problem
from trainer.precision.record import FLOAT32_FLOOR, SITUATIONS, MaeFloor, PrecisionRecipe

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "grpo_tiny.yaml"
BUILT_IN = ["bf16", "exact", "fp16", "fp8_rollout", "fp8_unified"]


def broken(*overrides: str) -> list[str]:
    """The problem lines of loading grpo_tiny with ``overrides`` (none: it loads)."""
    try:
        load_recipe(RECIPE, list(overrides), check_paths=False)
    except RecipeError as e:
        return e.problems
    return []


def test_every_recipe_is_registered_once_and_the_schema_default_is_one():
    assert RECIPES.names() == BUILT_IN
    assert all(isinstance(r, PrecisionRecipe) and r.doc for r in RECIPES.values())
    assert PrecisionConfig().recipe == DEFAULT_RECIPE and DEFAULT_RECIPE in RECIPES
    with pytest.raises(ValueError, match="already registered"):
        RECIPES.register("bf16")(recipe_for("bf16"))
    with pytest.raises(ValueError, match="unknown precision recipe 'fp4'; valid names: bf16, exact"):
        recipe_for("fp4")
    with pytest.raises(ValueError, match="unknown situations"):
        PrecisionRecipe(name="x", doc="x", dtypes=("float32",), dtype_reason="x", mae_floor={"float32": FLOAT32_FLOOR},
                        refuses={"tpu": "no"})


def test_each_record_has_a_floor_per_dtype():
    # the figures and their sources: each recipe's module; what they do: parity.guards.MaeRatioLimit
    floors = {r.name: {d: (f.mae, f.any_depth) for d, f in r.mae_floor.items()} for r in RECIPES.values()}
    assert floors == {"bf16": {"bfloat16": (4e-3, False), "float32": (1e-4, True)},
                      "exact": {"float32": (0.0, True), "bfloat16": (0.0, True)},
                      "fp16": {"float16": (5e-4, False)},
                      "fp8_rollout": {"bfloat16": (2e-2, False)}, "fp8_unified": {"bfloat16": (2e-2, False)}}
    with pytest.raises(ValueError, match=r"mae_floor must hold one MaeFloor for each of its dtypes \('float32', "
                                         r"'bfloat16'\)"):
        PrecisionRecipe(name="x", doc="x", dtypes=("float32", "bfloat16"), dtype_reason="x",
                        mae_floor={"float32": FLOAT32_FLOOR})
    with pytest.raises(ValueError, match="finite number >= 0"):
        MaeFloor(-1e-3, any_depth=False)


def test_the_runs_ratio_limit_takes_its_recipes_floor():
    from trainer.measurement.parity_limits import ratio_limit_for

    lim = ratio_limit_for(load_recipe(RECIPE, [], check_paths=False))
    assert (lim.max_ratio, lim.floor, lim.judge_start) == (5.0, 4e-3, False)
    lim = ratio_limit_for(load_recipe(RECIPE, ["model.dtype=float32", "parity.max_mae_ratio=3"], check_paths=False))
    assert (lim.max_ratio, lim.floor, lim.judge_start) == (3.0, 1e-4, True)
    lim = ratio_limit_for(load_recipe(RECIPE, ["precision.recipe=exact"], check_paths=False))
    assert (lim.floor, lim.judge_start) == (0.0, True)
    assert lim.violations({"probe/mae": 0.0}, "probe/", start=True) == []
    assert lim.violations({"probe/mae": 1e-6}, "probe/") == [
        "probe/mae = 1e-06 is more than parity.max_mae_ratio = 5 times the exact recipe's bfloat16 floor 0 (limit 0)"]


def test_the_cli_choices_come_from_the_registry():
    from trainer.cli import build_parser

    parser = build_parser()
    compare = next(a for a in parser._subparsers._group_actions[0].choices["compare"]._actions
                   if a.dest == "precision")
    assert compare.choices == compare_choices() == ["bf16", "fp16", "fp8_rollout", "fp8_unified"]
    assert compare.default == DEFAULT_RECIPE


def test_each_record_composes_its_engine_options():
    assert recipe_for("bf16").engine_options(False) == {} and recipe_for("fp16").engine_options(True) == {}
    for name in ("fp8_rollout", "fp8_unified"):
        assert recipe_for(name).engine_options(False) == {"quantization": EMULATED_FP8}
        # vLLM's block-FP8 layers on the CUTLASS kernel, whose activation quantizer is parity.precision's
        assert recipe_for(name).engine_options(True) == {
            "quantization": "fp8", "kernel_config": {"linear_backend_per_quant": {"fp8_block_w8a8": "cutlass"}}}
    assert recipe_for("exact").engine_options(False) == {"quantization": EXACT}
    with pytest.raises(ValueError, match="CPU only"):
        recipe_for("exact").engine_options(True)


def test_capabilities_the_consumers_ask_for():
    assert [r.name for r in RECIPES.values() if r.block_fp8_on_cuda] == ["fp8_rollout", "fp8_unified"]
    assert [r.name for r in RECIPES.values() if r.engine_logprobs] == ["exact"]
    assert [r.name for r in RECIPES.values() if r.check_model is not None] == ["exact"]
    assert [r.name for r in RECIPES.values() if "float16" in r.dtypes] == ["fp16"]
    assert all(set(r.refuses) <= set(SITUATIONS) for r in RECIPES.values())


def test_only_fp8_unified_transforms_the_trainer_model(monkeypatch):
    converted = []
    monkeypatch.setattr(trainer.precision.fp8_unified, "convert_to_fp8", converted.append)
    model = object()
    for r in RECIPES.values():
        assert r.transform(model) is model
    assert converted == [model]


@pytest.mark.parametrize("overrides, needles", [
    (["precision.recipe=fp4"], ["precision.recipe = 'fp4'", "one of bf16, exact, fp16, fp8_rollout, fp8_unified"]),
    (["precision.recipe=fp16"], ["model.dtype = 'bfloat16'", "float16 with precision.recipe fp16 (both phases run in FP16)"]),
    (["model.dtype=float16"], ["model.dtype = 'float16'", "with precision.recipe bf16",
                               "float16 runs with precision.recipe fp16"]),
    (["precision.recipe=fp8_unified", "model.dtype=float32"], ["model.dtype = 'float32'", "BF16 master weights",
                                                              "float32 runs with precision.recipe bf16 or exact"]),
    (["precision.recipe=fp8_rollout", "rollout.engine=hf"], ["rollout.engine = 'hf'", "no FP8 path"]),
    (["precision.recipe=fp8_unified", "rollout.mode=server"], ["rollout.mode = 'server'",
                                                              "'colocate' with precision.recipe fp8_unified",
                                                              "without the FP8 weights and layers"]),
    (["precision.recipe=exact", "rollout.engine=hf"], ["rollout.engine = 'hf'", "reruns vLLM's kernels"]),
    (["precision.recipe=exact", "rollout.mode=server"], ["rollout.mode = 'server'", "rotary tables"]),
])
def test_each_refusal_at_load_names_key_value_and_reason(overrides, needles):
    (line,) = broken(*overrides)
    for n in needles:
        assert n in line, line


def test_a_records_problems_join_the_recipes_other_problems():
    lines = broken("precision.recipe=fp8_unified", "model.dtype=float32", "rollout.engine=hf", "rollout.temperature=0")
    assert [line.split(": ", 1)[1].split(" =")[0] for line in lines] == ["rollout.temperature", "model.dtype",
                                                                         "rollout.engine"]


def test_cuda_launch_and_model_refusals():
    cfg = load_recipe(RECIPE, ["precision.recipe=exact"], check_paths=False)
    (cuda,) = [rule for rule in recipe_rules(cfg, cuda=True) if not rule[0]]
    assert cuda[1:3] == ("precision.recipe", "exact") and cuda[3].startswith("a CPU run: on CUDA")
    exact, unified = recipe_for("exact"), recipe_for("fp8_unified")
    with pytest.raises(RecipeError, match="launched with 2 processes; expected one process"):
        check_launch(exact, stage=0, world_size=2)
    with pytest.raises(RecipeError, match="ZeRO stage 2; expected no DeepSpeed ZeRO"):
        check_launch(exact, stage=2, world_size=1)
    check_launch(unified, stage=2, world_size=2)
    with pytest.raises(RecipeError, match="ZeRO stage 3; expected DeepSpeed ZeRO stage 2 or no DeepSpeed ZeRO"):
        check_launch(unified, stage=3, world_size=1)
    for r in RECIPES.values():
        check_model_config(r, LlamaConfig())
    with pytest.raises(RecipeError, match="r.yaml: precision.recipe = 'exact' with model.path = 'm': .*'mixtral'"):
        check_model_config(exact, MixtralConfig(), where="r.yaml", model_path="m")
    check_model_config(unified, MixtralConfig())


def test_serve_and_compare_ask_the_record():
    from trainer.commands.serve import serve_command

    assert server_problem(recipe_for("fp16")) is None
    assert server_problem(recipe_for("fp8_rollout")) == (
        "precision.recipe = 'fp8_rollout': expected 'bf16' or 'fp16' in server mode (the server is started without "
        "the FP8 weights and layers)")
    cfg = load_recipe(RECIPE, ["precision.recipe=fp8_unified"], check_paths=False)
    with pytest.raises(RecipeError, match="parityrl serve: precision.recipe = 'fp8_unified': expected 'bf16' or"):
        serve_command(cfg, cuda=False, model_dir="/m")

    settings = dict(engine="vllm", temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, n=1, dtype="bfloat16",
                    batch_size=1, num_prompts=None, max_model_len=None, max_prompt_tokens=None, topk=0)
    for name in compare_choices():
        check_settings(**{**settings, "dtype": recipe_for(name).dtypes[0]}, precision=name)
    for change, message in [
        ({"precision": "exact"}, "precision = 'exact': expected not 'exact' here: compare scores with the trainer's HF"),
        ({"precision": "fp4"}, "precision = 'fp4': expected one of ('bf16', 'fp16', 'fp8_rollout', 'fp8_unified')"),
        ({"precision": "fp16"}, "dtype = 'bfloat16': expected float16 with precision fp16"),
        ({"precision": "fp8_rollout", "engine": "hf"}, "engine = 'hf': expected 'vllm' with precision fp8_rollout "
                                                       "(the HF engine has no FP8 path)"),
    ]:
        with pytest.raises(CompareError) as e:
            check_settings(**{**settings, **change})
        assert str(e.value).startswith(message), str(e.value)
