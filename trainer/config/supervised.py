"""The recipes of the supervised stages, `parityrl sft` and `parityrl train-rm`: schema, loading, and the rules
a recipe can be checked by on its own.

Rules that need the model or a data file (the model's path and context, a single-file data source) are the
commands' (``trainer.commands.sft``, ``trainer.commands.train_rm``), which apply them after these.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from trainer.config.load import build_and_validate, load_recipe_dict
from trainer.config.schema import (
    LR_SCHEDULES,
    ModelConfig,
    RecipeError,
    StageLoggingConfig,
    StageTrainConfig,
)
from trainer.config.validate import check_cpu_threads

# need(ok, key, value, expected): raises a RecipeError naming the key when not ok
Need = Callable[[bool, str, Any, str], None]


def recipe_rule(where: str) -> Need:
    """The ``need`` of a recipe read from ``where``: one line naming the file, key, value and expectation."""

    def need(ok: bool, key: str, value: Any, expected: str) -> None:
        if not ok:
            raise RecipeError(f"{where}: {key} = {value!r}: expected {expected}")

    return need


# --------------------------------------------------------------------------- what both stages share


@dataclass
class SupervisedTrainConfig(StageTrainConfig):
    """The ``train:`` keys both supervised stages run ``transformers.Trainer`` with (trainer.supervised.hf_trainer)."""

    batch_size: int = 32  # rows per optimizer step
    save_every: int = 0  # a Trainer checkpoint every N steps under logging.run_dir/checkpoints (--resume); 0 = none
    keep_last: int = 2


def validate_supervised_train(t: SupervisedTrainConfig, need: Need) -> None:
    """The rules of the ``train:`` keys both stages share."""
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
    need(t.lr_schedule in LR_SCHEDULES, "train.lr_schedule", t.lr_schedule, "one of constant, linear, cosine")
    need(t.max_grad_norm > 0, "train.max_grad_norm", t.max_grad_norm, "a number > 0")
    need(t.save_every >= 0, "train.save_every", t.save_every, "an integer >= 0 (0: no checkpoints)")
    need(t.keep_last >= 1, "train.keep_last", t.keep_last, "an integer >= 1")
    check_cpu_threads(t, need)


# --------------------------------------------------------------------------- parityrl sft


@dataclass
class SFTDataConfig:
    source: str = "builtin:arithmetic"
    split: str = "train"
    prompt_column: str = "prompt"
    # The target completion comes from a column, or from a function
    # f(prompt, **columns) -> str given as "module:function", or the whole conversation comes from a function
    # f(prompt, **columns) -> list of chat messages (messages_fn: multi-turn, tool calls; trained on the
    # assistant turns only). Exactly one is set.
    completion_column: Optional[str] = None
    completion_fn: Optional[str] = "trainer.data.tasks.arithmetic:sft_text"
    messages_fn: Optional[str] = None
    # Tools offered in the rendered conversation (messages_fn only): a tools spec as env.tools takes,
    # e.g. "builtin:arithmetic_calculator"; their JSON schemas go to the chat template.
    tools: Optional[str] = None
    num_examples: Optional[int] = None
    use_chat_template: bool = True
    max_prompt_tokens: int = 64
    max_completion_tokens: int = 48
    builtin_kwargs: dict[str, Any] = field(default_factory=dict)
    packing: bool = False  # true: concatenate documents and cut into block_size blocks (trainer.supervised.sft)
    block_size: int = 128  # tokens per packed block (packing only)
    system_prompt: Optional[str] = None  # as the RL recipe's data.system_prompt (null = the template's default)
    # the column holding each row's images, for a vision-language model (as the RL recipe's; docs/vision-language.md):
    # the prompt is rendered with a placeholder per image and expanded by the model's processor, the completion
    # comes from data.completion_column / data.completion_fn (which gets the row's images as a column)
    image_column: Optional[str] = None
    max_images_per_prompt: int = 1
    # the image processor's settings, as the RL recipe's (schema.DataConfig)
    image_processor: dict[str, Any] = field(default_factory=dict)


@dataclass
class SFTTrainConfig(SupervisedTrainConfig):
    steps: int = 200
    learning_rate: float = 1e-3
    # rows per forward/backward; batch_size / micro_batch_size micro-batches are accumulated (null: one)
    micro_batch_size: Optional[int] = None
    lr_schedule: str = "cosine"
    batch_size: int = 32  # rows per optimizer step: pairs (padded) or blocks (packed)


class StageOutputs:
    """Where a supervised stage writes: its run directory and its output model, both named by the recipe's name."""

    name: str
    output_dir: str
    logging: StageLoggingConfig

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.run_dir.format(name=self.name))

    @property
    def out_path(self) -> Path:
        return Path(self.output_dir.format(name=self.name))


@dataclass
class SFTConfig(StageOutputs):
    name: str = "sft"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    output_dir: str = "runs/{name}/model"
    # merged: a plain HF model (LoRA folded in); adapter: the LoRA adapter only (for `parityrl merge`)
    output_format: Literal["merged", "adapter"] = "merged"
    print_every: int = 20
    logging: StageLoggingConfig = field(default_factory=StageLoggingConfig)



def read_sft_recipe(path, overrides=()) -> SFTConfig:
    """Read, override, type-check and apply the rules an SFT recipe can be checked by on its own."""
    return _read_stage_recipe(SFTConfig, validate_sft, path, overrides)


def validate_sft(cfg: SFTConfig, where: str) -> None:
    need = recipe_rule(where)
    d, t = cfg.data, cfg.train
    sources = [d.completion_column, d.completion_fn, d.messages_fn]
    # named by the key a recipe adds (messages_fn) when it forgot to null the default completion_fn
    key = "data.messages_fn" if d.messages_fn is not None else "data.completion_column"
    need(sum(v is not None for v in sources) == 1, key, getattr(d, key.split(".")[1]),
         "exactly one of data.completion_column / data.completion_fn / data.messages_fn to be set"
         + (" (set data.completion_fn: null)" if d.messages_fn is not None and d.completion_fn is not None else ""))
    for key in ("completion_fn", "messages_fn"):
        v = getattr(d, key)
        need(v is None or (":" in v and all(v.split(":", 1))), f"data.{key}", v, "'module:function'")
    need(d.tools is None or d.messages_fn is not None, "data.tools", d.tools,
         "null unless data.messages_fn is set (only a conversation can call tools)")
    need(d.tools is None or (":" in d.tools and all(d.tools.split(":", 1))), "data.tools", d.tools,
         "a tools spec: 'builtin:<name>', 'module:Name' or 'path/to/file.py:Name'")
    need(d.messages_fn is None or not d.packing, "data.packing", d.packing,
         "false when data.messages_fn is set (a conversation is trained on its assistant turns only, in the padded "
         "layout)")
    need(d.messages_fn is None or d.use_chat_template, "data.use_chat_template", d.use_chat_template,
         "true when data.messages_fn is set (the conversation is rendered by the chat template)")
    need(not d.image_processor or d.image_column is not None, "data.image_processor", d.image_processor,
         "{} without data.image_column (the settings are the images' processor's)")
    if d.image_column is not None:
        need(bool(d.image_column), "data.image_column", d.image_column, "a column name, or null for text prompts")
        need(d.max_images_per_prompt >= 1, "data.max_images_per_prompt", d.max_images_per_prompt, "an integer >= 1")
        need(not d.packing, "data.image_column", d.image_column, "null with data.packing: true (a packed block would "
             "cut a prompt's image placeholders from its pixels; vision-language rows train in the padded layout)")
        need(d.messages_fn is None, "data.image_column", d.image_column, "null with data.messages_fn (conversations "
             "with images are not supported; give data.completion_fn or data.completion_column)")
        need(d.use_chat_template, "data.use_chat_template", d.use_chat_template, "true with data.image_column (the "
             "chat template places the image placeholders)")
    need(d.max_prompt_tokens >= 1, "data.max_prompt_tokens", d.max_prompt_tokens, "an integer >= 1")
    need(d.max_completion_tokens >= 1, "data.max_completion_tokens", d.max_completion_tokens, "an integer >= 1")
    validate_supervised_train(t, need)
    need(cfg.print_every >= 1, "print_every", cfg.print_every, "an integer >= 1")
    need(d.block_size >= 2, "data.block_size", d.block_size, "an integer >= 2 (a block predicts its tokens after the first)")
    need(cfg.output_format == "merged" or cfg.model.lora.enabled, "output_format", cfg.output_format,
         "'merged' when model.lora.enabled is false (there is no adapter to save)")


# --------------------------------------------------------------------------- parityrl train-rm


@dataclass
class RMDataConfig:
    # A dataset with prompt / chosen / rejected columns: "builtin:arithmetic_preferences",
    # a local .json/.jsonl/.parquet file or save_to_disk directory, or a hub id.
    source: str = "builtin:arithmetic_preferences"
    split: str = "train"
    # The held-out split. null: hold out eval_fraction of the training rows instead
    # (required for a single local file, which has only one split).
    eval_split: Optional[str] = "test"
    eval_fraction: float = 0.1
    prompt_column: str = "prompt"
    chosen_column: str = "chosen"
    rejected_column: str = "rejected"
    num_examples: Optional[int] = None
    num_eval_examples: Optional[int] = None
    use_chat_template: bool = True
    max_tokens: int = 96  # prompt + completion + EOS; a longer pair is refused, not truncated
    builtin_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RMTrainConfig(SupervisedTrainConfig):
    steps: int = 100
    learning_rate: float = 1e-3
    # pairs per forward/backward; batch_size / micro_batch_size micro-batches are accumulated (null: one)
    micro_batch_size: Optional[int] = None
    lr_schedule: str = "constant"
    batch_size: int = 16  # preference pairs per optimizer step (2 x batch_size sequences)
    eval_every: int = 25  # steps; the held-out split is also scored before step 1 and after the last
    eval_batch_size: int = 64


@dataclass
class RMConfig(StageOutputs):
    name: str = "rm"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: RMDataConfig = field(default_factory=RMDataConfig)
    train: RMTrainConfig = field(default_factory=RMTrainConfig)
    output_dir: str = "runs/{name}/model"
    print_every: int = 10
    logging: StageLoggingConfig = field(default_factory=StageLoggingConfig)



def read_rm_recipe(path, overrides=()) -> RMConfig:
    """Read, override, type-check and apply the rules a reward-model recipe can be checked by on its own."""
    return _read_stage_recipe(RMConfig, validate_rm, path, overrides)


def _read_stage_recipe(cls, validate, path, overrides):
    data, where = load_recipe_dict(path, overrides)
    # a refused key is reported together with the recipe's other problems (as `parityrl train` does)
    return build_and_validate(cls, data, where, lambda cfg: validate(cfg, where), overrides)


def validate_rm(cfg: RMConfig, where: str) -> None:
    need = recipe_rule(where)
    d, t, lora = cfg.data, cfg.train, cfg.model.lora
    need(len({d.prompt_column, d.chosen_column, d.rejected_column}) == 3, "data.rejected_column", d.rejected_column,
         "three different columns for prompt, chosen and rejected")
    need(d.eval_split is None or d.eval_split != d.split, "data.eval_split", d.eval_split,
         f"a split other than data.split ({d.split!r}), or null to hold out data.eval_fraction of it")
    need(0 < d.eval_fraction < 1, "data.eval_fraction", d.eval_fraction, "a number in (0, 1)")
    for key in ("num_examples", "num_eval_examples"):
        v = getattr(d, key)
        need(v is None or v >= 1, f"data.{key}", v, "null or an integer >= 1")
    need(d.max_tokens >= 2, "data.max_tokens", d.max_tokens, "an integer >= 2")
    validate_supervised_train(t, need)
    need(t.eval_every >= 1, "train.eval_every", t.eval_every, "an integer >= 1")
    need(t.eval_batch_size >= 1, "train.eval_batch_size", t.eval_batch_size, "an integer >= 1")
    need(cfg.print_every >= 1, "print_every", cfg.print_every, "an integer >= 1")
    need(lora.r >= 1, "model.lora.r", lora.r, "an integer >= 1")
    need(0 <= lora.dropout < 1, "model.lora.dropout", lora.dropout, "a number in [0, 1)")
    need("lm_head" not in lora.target_modules, "model.lora.target_modules", lora.target_modules,
         "a list without 'lm_head' (a reward model has no lm_head: it is replaced by the score head)")
    need(cfg.model.attn_implementation is None, "model.attn_implementation", cfg.model.attn_implementation,
         "null: a reward model trains and scores (trainer/rewards/reward_model.py) with Transformers' default "
         "attention, so that both run the same function")
    try:
        str(cfg.out_path)
    except (KeyError, IndexError, ValueError):
        raise RecipeError(f"{where}: output_dir = {cfg.output_dir!r}: expected a path; the only placeholder is {{name}}") from None
