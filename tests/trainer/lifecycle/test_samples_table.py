"""trainer.lifecycle.samples_table: which samples the table shows and what each row holds (hand-checked)."""
import json

import torch

from rollout.types import Rollouts
from trainer.lifecycle.samples_table import append_samples, console_text, sample_indices, sample_rows
from trainer.models.batch import batch_from_rollouts
from trainer.sampling.drawn import Drawn


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i}" for i in ids)


def test_sample_indices_take_two_per_group():
    assert sample_indices(12, 4, 5) == [0, 1, 4, 5, 8]
    assert sample_indices(6, 1, 8) == [0, 1, 2, 3, 4, 5]


def test_rows_hold_text_rewards_and_the_samples_parity(tmp_path):
    r = Rollouts(prompt_ids=[[1, 2]] * 2 + [[3]] * 2, completion_ids=[[5, 6], [7], [8, 9, 10], [11]],
                 rollout_logprobs=[[-1.0, -2.0], [-0.5], [-1.0, -1.0, -1.0], [-3.0]],
                 finish_reasons=["stop", "length", "stop", "stop"], group_size=2)
    drawn = Drawn(rows=[{"prompt": "p0"}, {"prompt": "p1"}], rollouts=r, rewards=[1.0, 0.0, 0.5, 0.25],
                  per_fn={"exact": [1.0, 0.0, 1.0, 0.5]})
    batch = batch_from_rollouts(r, 0, "cpu")
    train = batch.rollout_logprobs.clone()
    train[0, :2] += torch.tensor([0.1, -0.3])  # |d| = 0.1, 0.3 -> mean 0.2, max 0.3
    rows = sample_rows(drawn, batch, train, Tok(), k=3)
    assert [row["prompt"] for row in rows] == ["p0", "p0", "p1"]
    assert rows[0]["completion"] == "t5 t6" and rows[1]["finish_reason"] == "length" and rows[2]["length"] == 3
    assert rows[0]["reward"] == 1.0 and rows[2]["reward/exact"] == 1.0
    assert abs(rows[0]["parity_mean_abs"] - 0.2) < 1e-6 and abs(rows[0]["parity_max_abs"] - 0.3) < 1e-6
    assert rows[1]["parity_mean_abs"] == 0.0
    path = append_samples(tmp_path, 7, rows)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 3 and lines[0]["step"] == 7 and lines[2]["prompt"] == "p1"
    text = console_text(rows)
    assert "t5 t6" in text and "exact 1" in text and text.count("prompt") == 2


def test_an_episode_row_shows_its_turns_and_which_tokens_were_trained():
    from trainer.lifecycle.samples_table import transcript

    class Letters:  # id -> its letter; 0 is a special token
        def decode(self, ids, skip_special_tokens=False):
            return "".join("<s>" if i == 0 and not skip_special_tokens else "" if i == 0 else chr(96 + i)
                           for i in ids)

    ids, mask = [1, 2, 0, 3, 0, 4], [1, 1, 1, 0, 0, 1]
    assert transcript(ids, mask, Letters()) == "[turn 1] ab [context] c<s> [turn 2] d"


def test_a_sample_spanning_an_in_flight_update_shows_its_versions_as_runs():
    from trainer.lifecycle.samples_table import version_runs

    assert version_runs([3, 3, 3, 4, 4]) == "3x3 4x2"
    assert version_runs([7]) == "7x1" and version_runs([]) == ""


def test_a_vision_language_row_names_its_images_and_the_wandb_table_shows_them(tmp_path):
    import wandb

    from rollout.types import ImageInput
    from trainer.data.tasks.shapes import shapes_example
    from trainer.lifecycle.samples_table import row_image_lists, wandb_table

    a, b = shapes_example(0)["image"], shapes_example(1)["image"]
    seen = [ImageInput("a" * 64, (1, 3, 56, 56), "float32", 2, 7), ImageInput("b" * 64, (1, 3, 56, 56), "float32", 2, 7)]
    r = Rollouts(prompt_ids=[[1, 2]] * 4, completion_ids=[[5], [6], [7], [8]], rollout_logprobs=[[-1.0]] * 4,
                 finish_reasons=["stop"] * 4, group_size=2, images=[[seen[0]], [seen[0]], [seen[1]], [seen[1]]])
    drawn = Drawn(rows=[{"prompt": "p0", "image": a}, {"prompt": "p1", "image": b}], rollouts=r,
                  rewards=[0.0] * 4, per_fn={})
    rows = sample_rows(drawn, batch_from_rollouts(r, 0, "cpu"), torch.tensor([[-1.0]] * 4), Tok(), k=3)
    assert [row["images"] for row in rows] == [["a" * 12], ["a" * 12], ["b" * 12]]
    json.dumps(rows)  # samples.jsonl holds the fingerprints, not the pixels
    images = row_image_lists(drawn, "image", 3)
    assert [im[0].tobytes() for im in images] == [a.tobytes(), a.tobytes(), b.tobytes()]
    table = wandb_table(rows, images)
    assert table.columns[0] == "image" and isinstance(table.data[2][0], wandb.Image)
