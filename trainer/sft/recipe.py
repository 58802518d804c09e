"""The `parityrl sft` recipe: schema, loading and validation (the stage itself: trainer.sft.fit)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from trainer.config import ModelConfig, RecipeError, WandbConfig, build_config, check_model_path, load_recipe_dict
from trainer.models.optim import HF_SCHEDULES


@dataclass
class SupervisedLoggingConfig:
    """``logging:`` of `parityrl sft` and `train-rm`: the run directory and its wandb run."""

    # metrics.jsonl, the wandb run (its id kept for --resume) and checkpoints/ live here
    run_dir: str = "runs/{name}"
    wandb: WandbConfig = field(default_factory=WandbConfig)


def validate_supervised_train(t, need) -> None:
    """The ``train:`` keys SFT and the RM share (trainer.sft.hf_trainer); ``need(ok, key, value, expected)`` raises."""
    need(t.steps >= 1, "train.steps", t.steps, "an integer >= 1")
    need(t.batch_size >= 1, "train.batch_size", t.batch_size, "an integer >= 1")
    need(t.micro_batch_size is None or (t.micro_batch_size >= 1 and t.batch_size % t.micro_batch_size == 0),
         "train.micro_batch_size", t.micro_batch_size,
         f"null or an integer >= 1 that divides train.batch_size ({t.batch_size})")
    need(t.learning_rate > 0, "train.learning_rate", t.learning_rate, "a number > 0")
    need(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "a number >= 0")
    need(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "an integer >= 0")
    need(0 <= t.warmup_ratio < 1, "train.warmup_ratio", t.warmup_ratio, "a number in [0, 1)")
    need(not (t.warmup_steps and t.warmup_ratio), "train.warmup_ratio", t.warmup_ratio,
         f"0 when train.warmup_steps is set ({t.warmup_steps}): one of the two")
    need(t.lr_schedule in HF_SCHEDULES, "train.lr_schedule", t.lr_schedule, "one of constant, linear, cosine")
    need(t.max_grad_norm > 0, "train.max_grad_norm", t.max_grad_norm, "a number > 0")
    need(t.save_every >= 0, "train.save_every", t.save_every, "an integer >= 0 (0: no checkpoints)")
    need(t.keep_last >= 1, "train.keep_last", t.keep_last, "an integer >= 1")


@dataclass
class SFTDataConfig:
    source: str = "builtin:arithmetic"
    split: str = "train"
    prompt_column: str = "prompt"
    # The target completion comes from a column, or from a function
    # f(prompt, **columns) -> str given as "module:function". Exactly one is set.
    completion_column: Optional[str] = None
    completion_fn: Optional[str] = "trainer.data.tasks.arithmetic:sft_text"
    num_examples: Optional[int] = None
    use_chat_template: bool = True
    max_prompt_tokens: int = 64
    max_completion_tokens: int = 48
    builtin_kwargs: dict[str, Any] = field(default_factory=dict)
    packing: bool = False  # true: concatenate documents and cut into block_size blocks (module docstring)
    block_size: int = 128  # tokens per packed block (packing only)
    system_prompt: Optional[str] = None  # as the RL recipe's data.system_prompt (null = the template's default)


@dataclass
class SFTTrainConfig:
    steps: int = 200
    batch_size: int = 32  # rows per optimizer step: pairs (padded) or blocks (packed)
    # rows per forward/backward; batch_size / micro_batch_size micro-batches are accumulated (null: one)
    micro_batch_size: Optional[int] = None
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    warmup_ratio: float = 0.0  # instead of warmup_steps: ceil(ratio x steps)
    lr_schedule: str = "cosine"  # transformers.get_scheduler: constant(_with_warmup), linear, cosine
    max_grad_norm: float = 1.0
    seed: int = 0
    save_every: int = 0  # a Trainer checkpoint every N steps under logging.run_dir/checkpoints (--resume); 0 = none
    keep_last: int = 2


@dataclass
class SFTConfig:
    name: str = "sft"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    output_dir: str = "runs/{name}/model"
    # merged: a plain HF model (LoRA folded in); adapter: the LoRA adapter only (for `parityrl merge`)
    output_format: Literal["merged", "adapter"] = "merged"
    print_every: int = 20
    logging: SupervisedLoggingConfig = field(default_factory=SupervisedLoggingConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.run_dir.format(name=self.name))

    @property
    def out_path(self) -> Path:
        return Path(self.output_dir.format(name=self.name))


def load_sft_recipe(path, overrides=(), *, check_paths: bool = True) -> SFTConfig:
    data, where = load_recipe_dict(path, overrides)
    cfg = build_config(SFTConfig, data, where)
    validate_sft(cfg, where, check_paths=check_paths)
    return cfg


def validate_sft(cfg: SFTConfig, where: str, *, check_paths: bool = True) -> None:
    def need(ok: bool, key: str, value: Any, expected: str) -> None:
        if not ok:
            raise RecipeError(f"{where}: {key} = {value!r}: expected {expected}")

    d, t = cfg.data, cfg.train
    need((d.completion_column is None) != (d.completion_fn is None), "data.completion_column", d.completion_column,
         "exactly one of data.completion_column / data.completion_fn to be set")
    need(d.completion_fn is None or (":" in d.completion_fn and all(d.completion_fn.split(":", 1))), "data.completion_fn",
         d.completion_fn, "'module:function'")
    need(d.max_prompt_tokens >= 1, "data.max_prompt_tokens", d.max_prompt_tokens, "an integer >= 1")
    need(d.max_completion_tokens >= 1, "data.max_completion_tokens", d.max_completion_tokens, "an integer >= 1")
    validate_supervised_train(t, need)
    need(cfg.print_every >= 1, "print_every", cfg.print_every, "an integer >= 1")
    need(d.block_size >= 2, "data.block_size", d.block_size, "an integer >= 2 (a block predicts its tokens after the first)")
    need(cfg.output_format == "merged" or cfg.model.lora.enabled, "output_format", cfg.output_format,
         "'merged' when model.lora.enabled is false (there is no adapter to save)")
    if check_paths:
        check_model_path(cfg.model.path, where)
        from trainer.config import model_max_positions

        max_pos = model_max_positions(cfg.model.path)
        need(not d.packing or max_pos is None or d.block_size <= max_pos, "data.block_size", d.block_size,
             f"at most the model's context of {max_pos} tokens")
