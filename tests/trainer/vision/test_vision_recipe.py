"""A vision-language recipe's input refused before anything heavy starts, one line each: the recipe's own rules, the
image column against the data (missing column, unreadable files) and against the model (a text-only one); and the
prompts of a batch: placeholders and images that disagree in number, too many images, an expanded prompt over the
budget."""
import io
from pathlib import Path

import pytest

from trainer.builtin.zoo_vl import build_vl_model
from trainer.config import RecipeError
from trainer.data.tasks.shapes import shapes_example
from trainer.lifecycle.preflight import check_before_loading, check_images_and_model, load_recipe
from trainer.vision.images import row_images
from trainer.vision.prompts import VisionPrompts

REPO = Path(__file__).resolve().parents[3]
VL_RECIPE = REPO / "recipes" / "grpo_vl_tiny.yaml"


@pytest.mark.parametrize("sets, says", [
    (["rollout.mode=server", "rollout.max_staleness=1", "rollout.in_flight=recompute"],
     "rollout.in_flight = 'recompute': expected 'off' with data.image_column"),
    (["rollout.engine=hf"], "rollout.engine 'hf'"),
    (["train.pack_sequences=true"], "expected null with train.pack_sequences"),
    (["data.max_images_per_prompt=0"], "data.max_images_per_prompt = 0: expected an integer >= 1"),
])
def test_what_a_vision_language_run_does_not_do_yet_is_refused_by_key(sets, says):
    with pytest.raises(RecipeError, match=None) as e:
        load_recipe(VL_RECIPE, sets, check_paths=False)
    assert says in str(e.value)


def _jsonl(tmp_path, rows):
    import json

    p = tmp_path / "data.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_an_image_column_that_is_missing_or_unreadable_names_the_row_before_the_model_loads(tmp_path):
    good = tmp_path / "a.png"
    shapes_example(0)["image"].save(good)
    (tmp_path / "b.png").write_text("not a png")
    rows = [{"prompt": "How many?", "answer": "1", "image": str(good)}] * 7 + \
           [{"prompt": "How many?", "answer": "1", "image": str(tmp_path / "b.png")},
            {"prompt": "How many?", "answer": "1", "image": str(tmp_path / "gone.png")}]
    data = _jsonl(tmp_path, rows)
    sets = [f"data.source={data}", "data.num_examples=null", f"logging.run_dir={tmp_path / 'run'}"]
    with pytest.raises(RecipeError) as e:
        check_before_loading(VL_RECIPE, sets, model=False)
    text = str(e.value)
    assert f"data.image_column 'image', row 7: {str(tmp_path / 'b.png')!r} is not an image Pillow reads" in text
    assert f"data.image_column 'image', row 8: image file {str(tmp_path / 'gone.png')!r} does not exist" in text
    with pytest.raises(RecipeError, match="data.image_column = 'picture': no such column in .* "
                                          r"\(its columns: prompt, answer, image\)"):
        check_before_loading(VL_RECIPE, sets + ["data.image_column=picture"], model=False)


def test_an_image_column_for_a_text_only_model_is_refused_by_name(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    cfg = load_recipe(VL_RECIPE, [f"model.path={tmp_path}"], check_paths=False)
    with pytest.raises(RecipeError, match=r"r.yaml: data.image_column = 'image': model.path .* is a text-only model "
                                          r"\(model_type 'llama'\); images need a vision-language model"):
        check_images_and_model(cfg, "r.yaml")
    assert check_images_and_model(load_recipe(VL_RECIPE, check_paths=False), "r.yaml") is None


@pytest.fixture(scope="module")
def prompts():
    return VisionPrompts(build_vl_model()[1], "image", max_prompt_tokens=64, max_images=1)


def test_a_row_renders_one_placeholder_per_image_and_the_trainer_side_is_expanded(prompts):
    image = shapes_example(0)["image"]
    out = prompts.encode([{"prompt": "How many?", "image": image}, {"prompt": "Hi?", "image": None}])
    assert out.ids[0].count(prompts.image_token_id) == 1 and out.ids[1].count(prompts.image_token_id) == 0
    assert out.expected[0].ids.count(prompts.image_token_id) == 4 and len(out.expected[0].ids) == len(out.ids[0]) + 6
    assert out.expected[0].pixels.count == 1 and out.expected[1].pixels.count == 0 and out.images[1] == []


@pytest.mark.parametrize("row, says", [
    ({"prompt": "<image> and <image>?", "image": "IMG"}, "row 5: its prompt holds 2 image placeholder(s) ('<image>') "
                                                         "for 1 image(s) in data.image_column 'image'"),
    ({"prompt": "Two?", "image": ["IMG", "IMG"]}, "row 5: 2 images, more than data.max_images_per_prompt = 1"),
    ({"prompt": "x" * 80, "image": "IMG"}, "row 5: its prompt is"),
    ({"prompt": "No column"}, "row 5: no column 'image' (data.image_column); the rows hold ['prompt']"),
])
def test_a_rows_images_and_placeholders_that_disagree_are_named(prompts, row, says):
    image = shapes_example(0)["image"]
    row = {k: ([image] * len(v) if isinstance(v, list) else image if v == "IMG" else v) for k, v in row.items()}
    with pytest.raises(ValueError) as e:
        prompts.encode([row], first_row=5)
    assert says in str(e.value)


def test_images_come_from_pil_paths_bytes_and_dataset_values_as_rgb(tmp_path):
    image = shapes_example(1)["image"]
    buf = io.BytesIO()
    image.convert("RGBA").save(buf, format="PNG")
    path = tmp_path / "x.png"
    image.save(path)
    got = row_images([image, str(path), buf.getvalue(), {"bytes": buf.getvalue(), "path": None}], "image", 0)
    assert [g.mode for g in got] == ["RGB"] * 4 and all(g.tobytes() == image.tobytes() for g in got)
    with pytest.raises(ValueError, match="data.image_column 'image', row 3: int is not an image"):
        row_images(7, "image", 3)


def test_a_prompt_is_its_text_and_its_images_for_the_held_out_check():
    from trainer.vision.images import prompt_identity

    a, b = shapes_example(0)["image"], shapes_example(1)["image"]
    q = "How many shapes are in the image?"
    assert prompt_identity({"prompt": q, "image": a}, "image") == prompt_identity({"prompt": q, "image": a.copy()},
                                                                                 "image")
    assert prompt_identity({"prompt": q, "image": a}, "image") != prompt_identity({"prompt": q, "image": b}, "image")
    assert prompt_identity({"prompt": q, "image": a}, None) == (q,)


def test_every_row_is_checked_before_the_engine_starts_naming_the_first_bad_one(prompts):
    from trainer.vision.prompts import check_prompt_rows

    image = shapes_example(0)["image"]
    rows = [{"prompt": "How many?", "image": image}] * 3 + [{"prompt": "x" * 80, "image": image}]
    check_prompt_rows(prompts, rows[:3], "data.source = 'd.jsonl'")
    with pytest.raises(RecipeError, match=r"^data.source = 'd.jsonl': row 3: its prompt is \d+ tokens with its 1 "
                                          r"image\(s\) expanded, more than data.max_prompt_tokens = 64$"):
        check_prompt_rows(prompts, rows, "data.source = 'd.jsonl'")


def test_the_image_processor_settings_reach_the_trainers_processor_and_an_unknown_one_is_refused_by_name(prompts):
    """data.image_processor: given to every processor call of the trainer (vLLM gets them as mm_processor_kwargs;
    tests/trainer/vision/test_vl_train.py runs both sides with them), each name checked against the model's image
    processor before the model loads."""
    from trainer.builtin.resolve import resolve_model_path
    from trainer.vision.prompts import vision_prompts

    row = {"prompt": "How many?", "image": shapes_example(0)["image"]}
    settings = {"image_mean": [0.4, 0.4, 0.4], "image_std": [0.3, 0.3, 0.3]}
    other = VisionPrompts(prompts.processor, "image", max_prompt_tokens=64, max_images=1, settings=settings)
    default, changed = prompts.encode([row]).expected[0], other.encode([row]).expected[0]
    assert changed.ids == default.ids  # normalisation moves the pixels, not the expansion
    # (x - 0.4) / 0.3 against (x - 0.5) / 0.5: the same pixels, normalised by the settings
    assert changed.pixels.values.allclose((default.pixels.values * 0.5 + 0.5 - 0.4) / 0.3, atol=1e-5)
    cfg = load_recipe(VL_RECIPE, ["model.path=builtin:zoo-idefics3", "data.image_processor={no_such_setting: 1}"],
                      check_paths=False)
    with pytest.raises(RecipeError, match=r"data.image_processor.no_such_setting: not a setting of .* image processor "
                                          r"\(Idefics3ImageProcessor.*\); its settings: .*image_mean"):
        vision_prompts(cfg, resolve_model_path(cfg.model.path))
    with pytest.raises(RecipeError, match=r"data.image_processor = \{'size': 1\}: expected \{\} without "
                                          r"data.image_column"):
        load_recipe(REPO / "recipes" / "grpo_tiny.yaml", ["data.image_processor={size: 1}"], check_paths=False)
