"""builtin:tiny-vl's warm start: `parityrl sft` on prompts with images (data.image_column), and the shapes task's
labels half drawn at random that it trains on.

Fast: the labels (hand-checked share, the same from a PIL image and from the dataset's PNG cell), the SFT recipe's
refusals, the images' round trip through the Trainer's collator. Slow: a short `parityrl sft` on the tiny Idefics3
learns (its loss falls) and writes a model directory the trainer loads with the base's processor class.
"""
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from trainer.builtin.warm_start import WARM_STARTS, BelowFloor
from trainer.builtin.zoo_vl import TINY_VL_NAME, ensure_vl_model
from trainer.config import RecipeError
from trainer.config.supervised import read_sft_recipe
from trainer.data.tasks.shapes import MAX_COUNT, noisy_label, sft_text_half_random, shapes_answer, shapes_dataset
from trainer.models.policy import load_base_model
from trainer.supervised.image_tensors import batch_images, image_tensors
from trainer.supervised.sft import fit_sft
from trainer.vision.batch import VisionBatch

REPO = Path(__file__).resolve().parents[3]
SFT_VL = REPO / "recipes" / "sft_vl_tiny.yaml"


def test_half_the_labels_are_the_count_and_the_rest_uniform_draws():
    rows = shapes_dataset(400).to_list()
    labels = [noisy_label(int(r["answer"]), r["image"]) for r in rows]
    assert all(1 <= x <= MAX_COUNT for x in labels)
    right = sum(x == int(r["answer"]) for x, r in zip(labels, rows)) / len(rows)
    # 1/2 + 1/2 x 1/4 = 0.625 expected; 400 draws: one standard deviation 0.024
    assert 0.55 < right < 0.70, right
    # every count appears as a wrong label: the other half is a draw over 1..4, not a shift
    wrong = [x for x, r in zip(labels, rows) if x != int(r["answer"])]
    assert set(wrong) == set(range(1, MAX_COUNT + 1))


def test_a_label_depends_on_the_pixels_only():
    row = shapes_dataset(3).to_list()[2]
    image = Image.open(io.BytesIO(row["image"]["bytes"]))
    assert noisy_label(int(row["answer"]), row["image"]) == noisy_label(int(row["answer"]), image)
    assert sft_text_half_random(row["prompt"], row["answer"], image) == shapes_answer(
        noisy_label(int(row["answer"]), image))


@pytest.mark.parametrize("sets, says", [
    (["data.packing=true"], "data.image_column = 'image': expected null with data.packing: true"),
    (["data.messages_fn=a:b", "data.completion_fn=null"], "expected null with data.messages_fn"),
    (["data.use_chat_template=false"], "data.use_chat_template = False: expected true with data.image_column"),
    (["data.max_images_per_prompt=0"], "data.max_images_per_prompt = 0: expected an integer >= 1"),
])
def test_what_an_sft_on_images_does_not_do_is_refused_by_key(sets, says):
    with pytest.raises(RecipeError) as e:
        read_sft_recipe(SFT_VL, sets)
    assert says in str(e.value)


@pytest.mark.parametrize("with_mask", [False, True])
def test_a_batch_s_images_come_back_from_the_collator_s_tensors(with_mask):
    values = torch.arange(3 * 3 * 2 * 2, dtype=torch.float32).reshape(3, 3, 2, 2)
    mask = torch.tensor([[[1, 0], [1, 1]]] * 3, dtype=torch.bool) if with_mask else None
    vision = VisionBatch(values, mask, [2, 0, 1], image_token_id=7)
    tensors = image_tensors(vision)
    assert sorted(tensors) == sorted(["pixel_values", "images_per_row"] + (["pixel_attention_mask"] if with_mask else []))
    back = batch_images(tensors, 7)
    assert back.per_row == [2, 0, 1] and back.image_token_id == 7 and torch.equal(back.pixel_values, values)
    assert (back.pixel_attention_mask is None) if not with_mask else torch.equal(back.pixel_attention_mask, mask)
    assert image_tensors(None) == {}


@pytest.mark.slow
def test_sft_on_images_learns_and_keeps_the_base_processor(tmp_path, monkeypatch):
    base = ensure_vl_model()
    out = tmp_path / "model"
    cfg = read_sft_recipe(SFT_VL, ["train.steps=40", "data.num_examples=256", "train.warmup_steps=2",
                                   f"output_dir={out}", f"logging.run_dir={tmp_path / 'run'}",
                                   "logging.wandb.mode=disabled"])
    fit_sft(cfg, str(base))
    meta = json.loads((out / "parityrl_sft.json").read_text())
    # from a random model's ~ln(vocab) per token to the answer's format: the fixed words are learnt first
    assert meta["sft_loss_first"] > 4.0 and meta["sft_loss_last"] < 0.5, meta
    saved = json.loads((out / "processor_config.json").read_text())["image_processor"]["image_processor_type"]
    assert saved == json.loads((base / "processor_config.json").read_text())["image_processor"]["image_processor_type"]
    assert type(AutoProcessor.from_pretrained(out).image_processor).__name__ == saved
    trained, start = load_base_model(str(out), "float32"), load_base_model(str(base), "float32")
    moved = {n for (n, p), (_, q) in zip(trained.named_parameters(), start.named_parameters()) if not torch.equal(p, q)}
    # full fine-tuning: the vision tower learns too (it is random at the start)
    assert any("vision" in n for n in moved) and any("text_model" in n for n in moved), sorted(moved)[:5]


@pytest.mark.slow
def test_the_floor_judges_a_vision_language_build_on_vllm_and_refuses_the_untrained_model():
    """The judge's own process (a second vLLM engine beside the session's): the untrained tiny Idefics3 counts no
    shapes in the format, so it reads below builtin:tiny-vl's floor and is refused with one line."""
    ws = WARM_STARTS[TINY_VL_NAME]
    proc = subprocess.run([sys.executable, "-m", "trainer.measurement.warm_start_floor", ws.name, str(ensure_vl_model()),
                           str(ws.floor_recipe), str(ws.floor_greedy)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == BelowFloor.exit_status, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "builtin:tiny-vl: the warm start came out at held-out greedy accuracy 0.0"), proc.stderr[-3000:]
