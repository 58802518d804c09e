"""Training a reward model (`parityrl train-rm`) on ``transformers.Trainer`` (trainer.supervised.hf_trainer).

**Model.** A causal-LM directory (e.g. ``builtin:tiny`` or the merged SFT model) is
loaded as ``AutoModelForSequenceClassification`` with ``num_labels=1``: the
backbone is kept, the lm_head is dropped, and a new linear ``score`` head
(hidden -> 1, no bias) is added. With LoRA (``model.lora.enabled``, the default)
the adapter is PEFT ``task_type="SEQ_CLS"``, which keeps the new head fully
trainable through ``modules_to_save``; the head is trained in float32 whatever the
backbone's dtype, so its small updates are not rounded away. The reward of a sequence
and its rendering: trainer.rewards.reward_model; the loss: trainer.supervised.pairs.

**Output** (``output_dir``, atomic): a plain merged HF sequence-classification
model (LoRA folded in), its tokenizer, ``metrics.jsonl`` (one row per evaluation,
step 0 = before training) and ``parityrl_rm.json`` (how to render inputs,
final metrics, the base model).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import torch
from peft import LoraConfig as PeftLoraConfig, get_peft_model
from transformers import AutoModelForSequenceClassification, TrainerCallback

from trainer.config.schema import RecipeError
from trainer.config.supervised import RMConfig
from trainer.distributed.launch_info import current_backend, describe_launch, device_text
from trainer.io.outputs import atomic_output_dir
from trainer.models.architecture import resolve_lora_targets
from trainer.models.policy import DTYPES, load_tokenizer
from trainer.rewards.reward_model import RM_INFO_FILE, pad_sequences, quiet_transformers, sequence_scores
from trainer.supervised.hf_trainer import (
    StageLogger,
    is_main_process,
    make_trainer,
    open_run_logger,
    run_stage,
    training_arguments,
)
from trainer.supervised.pairs import encode_pairs, evaluate_pairs, load_preference_pairs, pair_metrics, pairwise_loss


def load_model_for_rm_training(model_dir: str, cfg: RMConfig, tokenizer, device):
    """The causal LM as a 1-output classifier, with LoRA (SEQ_CLS) or all parameters trainable."""
    with quiet_transformers():
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=DTYPES[cfg.model.dtype])
    model.config.pad_token_id = tokenizer.pad_token_id  # HF's own pooling reads it (module docstring)
    model.score.float()  # before PEFT copies it into modules_to_save: the head trains in float32
    lora = cfg.model.lora
    if lora.enabled:
        try:
            targets = resolve_lora_targets(model, lora.target_modules)
        except ValueError as err:
            raise RecipeError(f"{model_dir}: {err}") from None
        model = get_peft_model(model, PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                     target_modules=targets, task_type="SEQ_CLS"))
    elif cfg.model.dtype == "bfloat16":
        model = model.float()  # full fine-tuning: float32 master weights (as `parityrl sft` does)
    return model.to(device)


def train_reward_model(cfg: RMConfig, model_dir: str, *, resume: bool = False, console_log: bool = False) -> Path:
    """Train a reward model from ``model_dir`` (already resolved: a local HF directory) per ``cfg`` and write it
    to ``cfg.out_path`` (atomically); returns that path.

    The loop is ``transformers.Trainer``'s (trainer.supervised.hf_trainer): accumulation over
    ``train.micro_batch_size``, checkpoints every ``train.save_every`` steps under the run
    directory and ``resume`` from the newest, per-step metrics to the run's metrics.jsonl
    and wandb. The held-out evaluation (before step 1, every ``eval_every`` steps, after
    the last) is appended to the run directory's ``eval.jsonl`` as it happens (a resumed
    run keeps the earlier rows) and copied into the output as ``metrics.jsonl``. ``console_log``: as ``run_stage``.
    """
    return run_stage(cfg.run_dir, resume=resume, body=lambda checkpoint: _train(cfg, model_dir, checkpoint, resume),
                     console_log=console_log)


def _train(cfg: RMConfig, model_dir: str, checkpoint: Optional[str], resume: bool) -> Path:
    out, run_dir = cfg.out_path, cfg.run_dir
    torch.manual_seed(cfg.train.seed)
    args = training_arguments(cfg.train, run_dir)
    if is_main_process():  # what this launch runs on (args.device sets up the process group)
        print(describe_launch(world=args.world_size, backend=current_backend(), device=device_text(args.device),
                              dtype=cfg.model.dtype), flush=True)
    tokenizer = load_tokenizer(model_dir)
    try:  # bad data is bad input (exit status 2 in the CLI), found before any training
        train_pairs, eval_pairs = load_preference_pairs(cfg)
        train_c, train_r = encode_pairs(cfg, tokenizer, train_pairs, "train")
        eval_c, eval_r = encode_pairs(cfg, tokenizer, eval_pairs, "held-out")
    except RecipeError:
        raise
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise RecipeError(f"data.source = {cfg.data.source!r}: {e}") from None
    if len(train_c) < args.per_device_train_batch_size:
        raise RecipeError(f"train.batch_size = {cfg.train.batch_size}: the data has only {len(train_c)} training "
                          "pairs; use more examples or a smaller batch")
    model = load_model_for_rm_training(model_dir, cfg, tokenizer, "cpu")  # the Trainer places it
    t = cfg.train
    pad = tokenizer.pad_token_id
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"train-rm: {len(train_c)} training pairs, {len(eval_c)} held-out pairs, "
          f"{trainable:,} trainable parameters ({'LoRA' if cfg.model.lora.enabled else 'full'})", flush=True)

    def collate(idx: list[int]) -> dict:
        # chosen and rejected in one forward: same weights, one padded batch
        ids, mask, pos = pad_sequences([train_c[i] for i in idx] + [train_r[i] for i in idx], pad)
        items = torch.zeros(len(idx), dtype=torch.long)  # one item per pair (the loss is a mean over pairs)
        return {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "labels": items,
                "shift_labels": items}

    def loss_fn(model, x: dict):
        r = sequence_scores(model, x["input_ids"], x["attention_mask"], x["position_ids"])
        n = r.shape[0] // 2
        rc, rr = r[:n], r[n:]
        m = pair_metrics(rc.detach(), rr.detach())
        return pairwise_loss(rc, rr) * n, {
            "pairs": float(n), "accuracy_sum": m["accuracy"] * n, "margin_sum": m["margin"] * n,
            "loss_sum": m["loss"] * n}

    is_main = is_main_process()
    logger = open_run_logger(cfg, "train-rm", resume=resume)
    eval_log = run_dir / "eval.jsonl"
    t0 = time.time()

    class HeldOut(TrainerCallback):
        """Held-out accuracy / margin / loss every eval_every steps and after the last (main process only)."""

        def __init__(self):
            self.last: dict = {}
            self.seen = {"pairs": 0.0, "accuracy_sum": 0.0, "margin_sum": 0.0, "loss_sum": 0.0}

        def evaluate(self, step: int, trained) -> dict:
            row = {"step": step, **{f"eval/{k}": v for k, v in
                                    evaluate_pairs(trained, eval_c, eval_r, pad, t.eval_batch_size,
                                                   next(trained.parameters()).device).items()},
                   "eval/num_pairs": len(eval_c), "elapsed_s": round(time.time() - t0, 3)}
            c = trainer.counters
            n = c.get("pairs", 0.0) - self.seen["pairs"]
            if n > 0:  # this process's training pairs since the previous evaluation
                for k in ("accuracy", "margin", "loss"):
                    row[f"train/{k}"] = (c[f"{k}_sum"] - self.seen[f"{k}_sum"]) / n
            self.seen = {k: c.get(k, 0.0) for k in self.seen}
            with eval_log.open("a") as f:
                f.write(json.dumps(row) + "\n")
            logger.log(step, {k: v for k, v in row.items() if k.startswith(("eval/", "train/"))}, echo=False)
            print(f"train-rm eval  step {step:>4}  held-out accuracy {row['eval/accuracy']:.3f}  "
                  f"margin {row['eval/margin']:+.3f}  loss {row['eval/loss']:.4f}", flush=True)
            self.last = row
            return row

        def on_train_begin(self, args, state, control, model=None, **kw):
            if is_main and state.global_step == 0:
                self.evaluate(0, model.model)  # LossModule(the reward model)

        def on_step_end(self, args, state, control, model=None, **kw):
            if is_main and (state.global_step % t.eval_every == 0 or state.global_step == state.max_steps):
                self.evaluate(state.global_step, model.model)

    held_out = HeldOut()
    stage = StageLogger(logger, "train-rm", cfg.print_every)
    trainer = make_trainer(model, args, num_rows=len(train_c), collate=collate, loss_fn=loss_fn,
                           callbacks=[stage, held_out])
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    finally:
        logger.close()
    if not is_main:
        return out
    with atomic_output_dir(out, "output_dir") as tmp:
        rows = [json.loads(line) for line in eval_log.read_text().splitlines() if line.strip()]
        (tmp / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        final = trainer.model.model.merge_and_unload() if cfg.model.lora.enabled else trainer.model.model
        final = final.to(dtype=getattr(torch, cfg.model.dtype))
        final.config.pad_token_id = pad
        final.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {"base_model": model_dir, "use_chat_template": cfg.data.use_chat_template,
                "max_tokens": cfg.data.max_tokens, "steps": t.steps, "lora": cfg.model.lora.enabled,
                "train_pairs": len(train_c), "eval_pairs": len(eval_c), "eval_before": rows[0] if rows else None,
                "eval_after": held_out.last, "resumed_from": checkpoint}
        (tmp / RM_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return out
