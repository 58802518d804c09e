"""GRPO on a vision-language model (slow tier): the VL recipe trains with mm/inputs_equal 1 and float32 parity at
the numerics' level every step, and each planted fault of the input identity check stops the run with exit status 3
and one line naming the sample, the image and the quantity, before an update uses the batch
(tests/trainer/vision/vl_runs_worker.py, one engine for the three runs, in a process of its own)."""
from pathlib import Path

import pytest
from worker_results import worker_results

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
# float32 engine vs trainer on the tiny Idefics3: 1.4e-6 per step measured (CPU); the goal is 2e-6, and
# other CPUs' float32 kernels sum in other orders
FLOAT32_MAE = 5e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_runs")
    return worker_results(HERE / "vl_runs_worker.py", root, timeout=1200)


def test_every_step_checks_the_inputs_and_parity_is_the_numerics(runs):
    history = runs["clean"]["history"]
    assert [h["step"] for h in history] == [1, 2, 3]
    for h in history:
        # 8 prompts x 4 samples, one image each: every one checked
        assert h["mm/inputs_equal"] == 1.0 and h["mm/images"] == 32.0, h
        assert h["parity/mae"] < FLOAT32_MAE, h
        # every prompt of the shapes task holds its image: the images' parity is the batch's, no text rows
        assert h["parity/images/mae"] == pytest.approx(h["parity/mae"]) and h["parity/text/num_tokens"] == 0, h
        assert h["train/grad_norm"] > 0, h  # the update reached the language model's adapters
        # and the engine serves it: steps 2 and 3 sample under the adapter of the step before (an engine that
        # wrapped no layer served it as zeros, and read 0.08 here at step 2), and the probe scores after the sync
        if "probe/mae" in h:
            assert h["probe/mae"] < FLOAT32_MAE, h
    # the probe scores its prompts with their images: 4 prompts x 4 image tokens, at every probe (before step 1 and
    # after each sync), not their text alone
    assert runs["clean"]["probe_image_tokens"] == [16] * 4, runs["clean"]["probe_image_tokens"]


@pytest.mark.parametrize("run, line", [
    # the probe's prompts, checked before training: its sequences are fixed with the images
    ("processor_42px", "the parity probe's prompts: the engine's inputs are not the trainer's: sample 0 (prompt 0), "
                       "image 0: pixel tensors differ (engine float32 [1, 3, 56, 56]"),
    ("image_dropped", "step 1: the engine's inputs are not the trainer's: sample 4 (prompt 1): the engine consumed 0 "
                      "image(s), the trainer's prompt holds 1 (3 more sample(s) differ)"),
])
def test_a_planted_fault_stops_the_run_before_an_update_naming_it(runs, run, line):
    r = runs[run]
    assert r.get("exit_status") == 3, r
    assert r["message"].startswith(line), r["message"]
    assert r["steps_logged"] <= 1  # the probe's row before step 1 at most: no step was trained


def test_merged_updates_between_evaluations_of_the_same_images_run_on(runs):
    """A merged update reloads the engine's weights, which clears its cached image features; the scheduler forgets
    them too (``VLLMEngine.reload_weights``), or the second evaluation stopped with 'Encoder cache miss'."""
    r = runs["merged_eval"]
    assert "history" in r, r
    assert [h["step"] for h in r["history"]] == [1, 2]
    for h in r["history"]:
        assert "eval/mean@4" in h and h["parity/mae"] < FLOAT32_MAE and h["mm/inputs_equal"] == 1.0, h


def test_image_processor_settings_reach_both_sides(runs):
    """data.image_processor (other normalisation): the trainer's processor and the engine's (mm_processor_kwargs) both
    apply it, or the pixel fingerprints would differ and the run stop, as the trainer-only fault above does."""
    r = runs["processor_setting"]
    assert "history" in r, r
    assert [h["mm/inputs_equal"] for h in r["history"]] == [1.0] and r["history"][0]["parity/mae"] < FLOAT32_MAE, r


def test_off_policy_images_numerics_stay_numerics_and_a_resume_trains_on_the_same_batches(runs):
    """rollout.max_staleness = 2 on images: every step's inputs checked, parity/* at the float32 level while
    staleness/* grows with the lag; the checkpoint after step 2 holds the pending batches of steps 3 and 4 with their
    images and pixels, and the resumed run equals the uninterrupted one bit for bit."""
    r = runs["stale_resume"]
    full, resumed = r["full"], r["resumed"]
    assert [h["step"] for h in full] == [1, 2, 3, 4] and [h["step"] for h in resumed] == [3, 4]
    for h in full:
        assert h["mm/inputs_equal"] == 1.0 and h["parity/mae"] < FLOAT32_MAE, h
    assert full[0]["staleness/kl_k3"] == 0.0 and all(h["staleness/kl_k3"] > 0 for h in full[1:]), full
    for a, b in zip(full[2:], resumed):
        for key in ("reward/mean", "train/loss", "staleness/mae", "parity/mae", "mm/images"):
            assert a[key] == b[key], (a["step"], key)
    assert r["adapters_equal"]


def test_an_image_split_into_crops_is_one_image_of_five_views_on_both_sides(runs):
    """do_image_splitting: the engine consumes each image as one tensor of its 4 crops and its global view; the
    trainer's pixels hold the same 5 views for it (``PromptPixels.views``), checked bit for bit, and its forward fills
    the 5 x 4 placeholder positions with their features."""
    r = runs["image_splitting"]
    assert "history" in r, r
    h = r["history"][0]
    assert h["mm/inputs_equal"] == 1.0 and h["mm/images"] == 32.0 and h["parity/mae"] < FLOAT32_MAE, h
    assert r["probe_image_tokens"][0] == 4 * 5 * 4, r["probe_image_tokens"]  # 4 prompts x 5 views x 4 tokens
