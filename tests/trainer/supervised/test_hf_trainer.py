"""The supervised stages on transformers.Trainer (trainer/supervised/hf_trainer.py): accumulation, resume, wandb, schedule."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.commands.sft import load_sft_recipe, run_sft
from trainer.config import RecipeError
from trainer.models.optim import make_scheduler, warmup_steps
from trainer.supervised.hf_trainer import accumulation

REPO = Path(__file__).resolve().parents[3]


def _sets(tmp_path: Path, name: str, *extra: str) -> list[str]:
    """LoRA SFT of the tiny base in float32 on 64 padded examples (cheap, and rounding does not hide differences)."""
    return ["model.path=builtin:tiny-base", "model.dtype=float32", f"output_dir={tmp_path / name / 'adapter'}",
            f"logging.run_dir={tmp_path / name / 'run'}", "data.num_examples=64", "train.batch_size=8",
            "train.learning_rate=1e-2", "train.warmup_steps=0", *extra]


def _cfg(tmp_path: Path, name: str, *extra: str):
    return load_sft_recipe(REPO / "recipes" / "sft_lora_tiny.yaml", _sets(tmp_path, name, *extra))


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter_model.safetensors"))


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows]


def test_schedules_are_transformers_get_scheduler_with_its_warmup():
    """Hand-computed factors: HF's warm-up is step / warmup (0 at the first step), then constant / linear / cosine."""
    def factors(schedule: str, warmup: int, total: int) -> list[float]:
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=1.0)
        s = make_scheduler(opt, schedule, warmup, total)
        out = []
        for _ in range(total):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            s.step()
        return out

    assert factors("constant", 2, 5) == [0.0, 0.5, 1.0, 1.0, 1.0]
    assert factors("linear", 2, 6) == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25])
    cos = [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]  # progress (step - 2) / (6 - 2)
    assert factors("cosine", 2, 6) == pytest.approx([0.0, 0.5, *cos])
    assert factors("constant", 0, 3) == [1.0, 1.0, 1.0]
    assert warmup_steps(0, 0.1, 25) == 3 and warmup_steps(4, 0.0, 25) == 4  # ceil(ratio x steps), as TrainingArguments


def test_accumulation_split(tmp_path):
    t = _cfg(tmp_path, "a", "train.micro_batch_size=2").train
    assert accumulation(t, 1) == (2, 4) and accumulation(t, 2) == (2, 2)
    with pytest.raises(ValueError, match="do not split over 3 processes"):
        accumulation(t, 3)
    for extra, needle in (("train.micro_batch_size=3", "train.micro_batch_size = 3: expected null or an integer >= 1 "
                                                       "that divides train.batch_size (8)"),
                          ("train.warmup_ratio=0.1", None),
                          ("train.warmup_ratio=1.5", "train.warmup_ratio = 1.5: expected a number in [0, 1)")):
        if needle is None:
            assert _cfg(tmp_path, "b", extra).train.warmup_ratio == 0.1
            continue
        with pytest.raises(RecipeError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            _cfg(tmp_path, "b", extra)
    with pytest.raises(RecipeError, match="train.warmup_ratio = 0.1: expected 0 when train.warmup_steps is set"):
        _cfg(tmp_path, "b", "train.warmup_ratio=0.1", "train.warmup_steps=2")


@pytest.mark.slow
def test_accumulated_micro_batches_train_as_one_batch(tmp_path):
    """8 rows at once vs 4 micro-batches of 2: the same losses and adapter (the loss is normalised by the
    whole step's target tokens, not averaged over micro-batch means; micro-batches differ in token counts)."""
    run_sft(_cfg(tmp_path, "one", "train.steps=3"))
    run_sft(_cfg(tmp_path, "acc", "train.steps=3", "train.micro_batch_size=2"))
    one, acc = _losses(tmp_path / "one" / "run"), _losses(tmp_path / "acc" / "run")
    assert len(one) == 3 and one == pytest.approx(acc, rel=1e-5, abs=1e-6)
    a, b = _adapter(tmp_path / "one" / "adapter"), _adapter(tmp_path / "acc" / "adapter")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=2e-5)  # Adam: summation-order noise


@pytest.mark.slow
def test_resume_continues_exactly_and_keeps_the_wandb_run(tmp_path):
    """4 steps straight vs 2 steps, a checkpoint, then --resume: the same adapter and losses; one wandb run id."""
    common = ("train.steps=4", "train.save_every=2", "train.lr_schedule=cosine", "train.warmup_steps=1")
    run_sft(_cfg(tmp_path, "straight", *common))
    cut = tmp_path / "cut" / "run"
    (cut / "checkpoints").mkdir(parents=True)
    # the interrupted run: its first half (the straight run's step-2 checkpoint, logs and wandb id)
    straight = tmp_path / "straight" / "run"
    shutil.copytree(straight / "checkpoints" / "checkpoint-2", cut / "checkpoints" / "checkpoint-2")
    shutil.copy(straight / "wandb_run_id", cut / "wandb_run_id")
    (cut / "metrics.jsonl").write_text("".join(line + "\n" for line in
                                               (straight / "metrics.jsonl").read_text().splitlines()[:2]))
    with pytest.raises(FileExistsError, match="holds checkpoints .checkpoint-2.; pass --resume"):
        run_sft(_cfg(tmp_path, "cut", *common))
    run_sft(_cfg(tmp_path, "cut", *common), resume=True)
    assert _losses(cut) == pytest.approx(_losses(straight), rel=1e-6)
    a, b = _adapter(tmp_path / "straight" / "adapter"), _adapter(tmp_path / "cut" / "adapter")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-7)
    info = json.loads((tmp_path / "cut" / "adapter" / "parityrl_sft.json").read_text())
    assert info["resumed_from"].endswith("checkpoint-2")
    run_id = (straight / "wandb_run_id").read_text().strip()
    assert (cut / "wandb_run_id").read_text().strip() == run_id
    assert [p.name.rsplit("-", 1)[-1] for p in (cut / "wandb").glob("offline-run-*")] == [run_id]
    # --resume without a checkpoint is refused by name
    with pytest.raises(FileNotFoundError, match="--resume: no checkpoint in"):
        run_sft(_cfg(tmp_path, "fresh", *common), resume=True)


ZERO2 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false",
         "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(REPO / "recipes" / "accelerate" / "supervised" / "zero2.json")}


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["ddp", "zero2"])
def test_two_processes_train_as_one(tmp_path, launch):
    """torchrun, 2 processes (gloo on CPU), 4 rows each per step vs one process with the 8 rows: the same losses
    and adapter -- the Trainer shards the same shuffled order, the loss is divided by both ranks' tokens, and
    the module DDP / DeepSpeed wrap is the one that runs the loss (trainer.supervised.hf_trainer.LossModule)."""
    sets = _sets(tmp_path, "two", "train.steps=2", "train.micro_batch_size=4", "logging.wandb.mode=disabled")
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", **(ZERO2 if launch == "zero2" else {})}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "trainer.cli", "sft", str(REPO / "recipes" / "sft_lora_tiny.yaml"),
                           *[x for s in sets for x in ("--set", s)]],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("sft step    2/2") == 1 and proc.stdout.count("written to") == 1  # rank 0 prints
    run_sft(_cfg(tmp_path, "one", "train.steps=2"))
    assert _losses(tmp_path / "two" / "run") == pytest.approx(_losses(tmp_path / "one" / "run"), rel=1e-5)
    a, b = _adapter(tmp_path / "one" / "adapter"), _adapter(tmp_path / "two" / "adapter")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=2e-5)
