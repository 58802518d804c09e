"""The supervised stages (`parityrl sft`, `parityrl train-rm`) on ``transformers.Trainer``.

Both stages hand their loop to ``transformers.Trainer``, which brings what users of
HF expect: ``accelerate launch`` / DDP / DeepSpeed, gradient accumulation, checkpoints
that resume exactly (optimizer, schedule, every rank's RNG, the data order), and the
learning-rate schedules of ``transformers.get_scheduler``. What stays ours: the recipe
format, the losses (SFT through the same fused log-prob kernel as RL; the pairwise RM
loss), and the run directory's ``metrics.jsonl`` + wandb run (``trainer.io.run_logger``:
the same logger, resume-safe wandb id and offline fallback as ``parityrl train``).

**Loss normalisation with accumulation.** A stage's loss is a mean over *items* (target
tokens for SFT, preference pairs for the RM). With ``train.micro_batch_size`` smaller
than ``train.batch_size`` the Trainer runs ``batch_size / (micro_batch_size x processes)``
micro-batches per optimizer step; each micro-batch's loss is its item sum divided by the
item count of the *whole* step (the Trainer's ``num_items_in_batch``, summed over the
accumulation window and, with ``average_tokens_across_devices``, over processes), so an
accumulated step has the gradient of one big batch (tested), not the mean of per-micro-batch
means -- the gradient-accumulation bug fixed in transformers 4.46
(https://huggingface.co/blog/gradient_accumulation). The collators put the per-item mask
in ``shift_labels`` (-100 = not an item), which is what the Trainer counts.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback
from transformers.trainer_utils import get_last_checkpoint

from trainer.config import RecipeError, to_dict
from trainer.distributed.cpu_threads import apply_cpu_threads
from trainer.distributed.teardown import leave_process_group
from trainer.io import third_party_output
from trainer.io.run_lock import claim
from trainer.io.run_logger import RunLogger
from trainer.models.checkpointing import CHECKPOINT_KWARGS, enable_gradient_checkpointing
from trainer.models.optim import HF_SCHEDULES, warmup_steps

CHECKPOINTS = "checkpoints"


def accumulation(t, world: int) -> tuple[int, int]:
    """(per-device micro-batch, gradient accumulation steps) for ``train.batch_size`` rows per optimizer step."""
    micro = t.micro_batch_size or t.batch_size
    per_step = t.batch_size // micro
    if per_step % world:  # bad input: exit 2 from the CLI, before any model loads
        raise RecipeError(f"train.batch_size = {t.batch_size}: {per_step} micro-batches of {micro} per step do not "
                         f"split over {world} processes; choose train.micro_batch_size so that they do")
    return micro, per_step // world


def training_arguments(t, run_dir: Path):
    """``TrainingArguments`` from a supervised ``train:`` section (checkpoints under ``run_dir/checkpoints``)."""
    micro, accum = accumulation(t, int(os.environ.get("WORLD_SIZE", "1")))
    apply_cpu_threads(t.cpu_threads)
    return TrainingArguments(
        output_dir=str(run_dir / CHECKPOINTS),
        max_steps=t.steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        lr_scheduler_type=HF_SCHEDULES[t.lr_schedule],
        warmup_steps=warmup_steps(t.warmup_steps, t.warmup_ratio, t.steps),
        optim="adamw_torch",  # torch's AdamW, as the RL loop uses
        seed=t.seed,
        logging_steps=1,  # every step to metrics.jsonl / wandb; the console gets every print_every-th
        save_strategy="steps" if t.save_every else "no",
        save_steps=t.save_every or 1,
        save_total_limit=t.keep_last,
        report_to="none",  # metrics go through parityrl's RunLogger (StageLogger below)
        disable_tqdm=True,
        remove_unused_columns=False,  # the collators build their own tensors
        dataloader_drop_last=True,  # every step sees train.batch_size rows
        use_cpu=not torch.cuda.is_available(),
        ddp_find_unused_parameters=False,  # every trainable parameter is in the loss (LoRA, or all of them)
        log_level="warning",
        # the Trainer calls LossModule.gradient_checkpointing_enable (below) before training
        gradient_checkpointing=t.gradient_checkpointing,
        gradient_checkpointing_kwargs=dict(CHECKPOINT_KWARGS),
    )


class IndexDataset(torch.utils.data.Dataset):
    """Row indices 0..n-1: the Trainer's sampler shuffles them, a collator turns them into a batch."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def item_labels(mask: torch.Tensor) -> torch.Tensor:
    """The Trainer's item counter: 0 where ``mask`` counts an item, -100 elsewhere (``num_items_in_batch``)."""
    return torch.where(mask > 0, 0, -100).long()


# (model, inputs) -> (sum of the per-item losses, counters to add up for logging)
LossFn = Callable[[Any, dict], tuple[torch.Tensor, dict[str, float]]]


class LossModule(torch.nn.Module):
    """The stage's model behind a ``forward`` that returns the loss terms, so that what the Trainer wraps
    (DDP, DeepSpeed) is the module that runs the loss: our losses call the backbone and the lm_head (or
    score head) separately (the fused log-prob kernel never builds full logits), which a DDP wrapper
    around the HF model itself would not see -- no gradient sync. Checkpoints hold the trainable
    parameters only (the LoRA adapter, or every weight in full fine-tuning), under the model's own names.
    """

    def __init__(self, model, loss_fn: "LossFn"):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        # what the Trainer's DeepSpeed integration reads (hidden_size for bucket sizes "auto")
        self.config = getattr(model, "config", None)

    def forward(self, **inputs):
        return self.loss_fn(self.model, inputs)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
        """What the Trainer calls with ``TrainingArguments.gradient_checkpointing``: the HF model's decoder layers
        (trainer.models.checkpointing; ``training_arguments`` passes the same non-reentrant kwargs)."""
        enable_gradient_checkpointing(self.model)

    def _trainable(self) -> set[str]:
        return {n for n, p in self.model.named_parameters() if p.requires_grad}

    def state_dict(self, *args, **kwargs):
        keep = self._trainable()
        return {k: v for k, v in self.model.state_dict(*args, **kwargs).items() if k in keep}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        result = self.model.load_state_dict(state_dict, strict=False, assign=assign)
        missing = sorted(self._trainable() - set(state_dict))
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"checkpoint: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")
        return torch.nn.modules.module._IncompatibleKeys(missing, result.unexpected_keys)


def make_trainer(model, args, *, num_rows: int, collate, loss_fn: LossFn, callbacks=()):
    """A ``transformers.Trainer`` whose loss is ``loss_fn``'s item sum / the step's item count (module docstring).

    The Trainer trains ``LossModule(model)``; ``trainer.model.model`` is ``model`` (trained in place).
    """

    class SupervisedTrainer(Trainer):
        loss_is_scaled_for_ga = True  # divided by the whole step's item count below

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            total, counters = model(**inputs)  # through DDP / DeepSpeed when they wrap it
            for k, v in counters.items():
                self.counters[k] = self.counters.get(k, 0.0) + v
            n = num_items_in_batch if num_items_in_batch is not None else (inputs["shift_labels"] != -100).sum()
            loss = total / n
            if num_items_in_batch is not None and self.args.average_tokens_across_devices:
                # n counts every process's items; DDP averages gradients over processes
                loss = loss * self.accelerator.num_processes
            return (loss, None) if return_outputs else loss

    trainer = SupervisedTrainer(model=LossModule(model, loss_fn), args=args, train_dataset=IndexDataset(num_rows),
                                data_collator=collate, callbacks=list(callbacks))
    trainer.counters = {}
    # num_items_in_batch is computed for models whose forward takes **kwargs; ours never sees the
    # batch's labels, and the loss above is normalised by it, so it is always wanted.
    trainer.model_accepts_loss_kwargs = True
    trainer.remove_callback(PrinterCallback)  # StageLogger prints
    return trainer


class StageLogger(TrainerCallback):
    """Sends the Trainer's per-step logs to a ``RunLogger`` (metrics.jsonl, wandb) and prints a progress line."""

    def __init__(self, logger, stage: str, print_every: int, line: Callable[[dict], str] = lambda row: ""):
        self.logger, self.stage, self.print_every, self.line = logger, stage, print_every, line
        self.t0 = time.time()
        self.history: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kw):
        logs = logs or {}
        if "loss" not in logs or not state.is_world_process_zero:  # the end-of-training summary; other ranks
            return
        row = {f"train/{k}": float(v) for k, v in logs.items() if isinstance(v, (int, float))}
        row["perf/elapsed_s"] = round(time.time() - self.t0, 3)
        self.history.append({"step": state.global_step, **row})
        self.logger.log(state.global_step, row, echo=False)
        # The first step at once (print_every steps of a real model on CPU are minutes of silence), then every
        # print_every-th and the last.
        first = len(self.history) == 1
        if first or state.global_step % self.print_every == 0 or state.global_step == state.max_steps:
            print(f"{self.stage} step {state.global_step:>4}/{state.max_steps}  loss {row['train/loss']:.4f}  "
                  f"lr {row.get('train/learning_rate', 0.0):.2e}  {self.line(row)}({row['perf/elapsed_s']:.0f}s)",
                  flush=True)


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def open_run_logger(cfg, stage: str, *, resume: bool):
    """The stage's ``RunLogger`` (metrics.jsonl + wandb, the id kept for ``--resume``; rank 0 writes), wandb from
    ``cfg.logging``, tagged with the stage, model, dtype and LoRA or full fine-tuning."""
    tags = (stage, f"model:{cfg.model.path}", f"dtype:{cfg.model.dtype}", "lora" if cfg.model.lora.enabled else "full")
    enabled, run_dir = is_main_process(), cfg.run_dir
    w = cfg.logging.wandb
    return RunLogger(run_dir, config=json.loads(json.dumps(to_dict(cfg), default=str)), wandb_mode=w.mode,
                     project=w.project, entity=w.entity, name=cfg.name, total_steps=cfg.train.steps,
                     enabled=enabled, resume=resume, tags=tags)


LIBRARIES_LOG = "libraries"  # <run_dir>/libraries.log: the expected output of torch, transformers, DeepSpeed


def run_stage(run_dir: Path, *, resume: bool, body: Callable[[Optional[str]], Path], console_log: bool = False) -> Path:
    """``body(checkpoint)`` under the run directory's lock (``claim_stage_run_dir``), then, on success on every
    rank, ``leave_process_group``: what `parityrl sft` and `train-rm` share around their training.
    ``console_log``: the console filter's expected lines go to the run directory's ``libraries.log`` (for the
    command's own run; never for a stage run inside another command, as the warm start inside `parityrl train`)."""
    lock, checkpoint = claim_stage_run_dir(run_dir, resume=resume)  # before anything loads
    if console_log:
        third_party_output.attach(run_dir, rank=int(os.environ.get("RANK", "0")), name=LIBRARIES_LOG)
    try:
        out = body(checkpoint)
    finally:
        lock.release()
    leave_process_group()
    return out


def claim_stage_run_dir(run_dir: Path, *, resume: bool):
    """(the run directory's lock, the checkpoint to resume from or None), before anything loads.

    One writer per run directory (trainer/io/run_lock.py, as `parityrl train`); ``--resume``
    needs a checkpoint; a fresh run over a run's checkpoints is refused (nothing is overwritten).
    """
    ckpt_dir = run_dir / CHECKPOINTS
    last = get_last_checkpoint(str(ckpt_dir)) if ckpt_dir.is_dir() else None
    if resume and last is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_dir} (checkpoints are written every "
                                "train.save_every steps; 0 writes none)")
    if not resume and last is not None:
        raise FileExistsError(f"logging.run_dir = {str(run_dir)!r} holds checkpoints ({Path(last).name}); pass "
                              "--resume to continue that run, or choose a new name (nothing was overwritten)")
    return claim(run_dir), last
