"""Reward models: pairwise training (`parityrl train-rm`) and scoring as an RL reward source.

**Model.** A causal-LM directory (e.g. ``builtin:tiny`` or the merged SFT model) is
loaded as ``AutoModelForSequenceClassification`` with ``num_labels=1``: the
backbone is kept, the lm_head is dropped, and a new linear ``score`` head
(hidden -> 1, no bias) is added. With LoRA (``model.lora.enabled``, the default)
the adapter is PEFT ``task_type="SEQ_CLS"``, which keeps the new head fully
trainable through ``modules_to_save``; the head is trained in float32 whatever the
backbone's dtype, so its small updates are not rounded away.

**Reward of a sequence.** ``r(x, y) = w . h_T``, the score head applied to the last
hidden state of the LAST REAL token T of ``prompt + completion + EOS``. T is found
from the attention mask (the rightmost position with mask 1), so left and right
padding give the same T, and position ids restart at 0 on the first real token, so
left padding does not shift RoPE positions either (tested). HF's own
``*ForSequenceClassification.forward`` finds T as the rightmost token that is not
``config.pad_token_id``: identical for right padding when pad != EOS, which the
saved model's config records (``pad_token_id``), so the output directory also
works with plain ``transformers``. Pooling by the mask instead of the pad id keeps
it right for tokenizers whose pad token is their EOS.

**Rendering** (``render_ids``; the same function in training and scoring, so the
reward model sees at scoring time exactly the layout it was trained on): the
prompt is encoded exactly as the RL trainer encodes it (``trainer.data.datasets.encode_prompts``:
one user turn of the chat template plus the generation prompt), the completion text
follows without special tokens, then EOS -- the token sequence of a finished
assistant turn, as the policy produces it. The scorer uses the reward model's own
tokenizer (its ids must be in its vocabulary); in the SFT -> reward model -> RL
pipeline that tokenizer is a copy of the policy's, so the rendering is the policy's.
The scorer runs the score head in float32 on the (e.g. bf16) last hidden state: a
bf16 score keeps 2-3 significant digits and close completions would tie.
The RL loop hands rewards decoded text (``skip_special_tokens=True``), so a
completion cut at ``max_new_tokens`` is scored as if it had ended there.

**Loss** (pairwise, Bradley-Terry): for a prompt x with a preferred completion
y_c and a rejected one y_r, ``L = -log sigmoid(r(x, y_c) - r(x, y_r))``, averaged
over the batch -- Ouyang et al. 2022, "Training language models to follow
instructions with human feedback" (InstructGPT), eq. 1, and the reward-modelling
step of the StackLLaMA write-up (https://huggingface.co/blog/stackllama). Held-out
metrics: accuracy = share of pairs with r_c > r_r (a tie counts as wrong), mean
margin = mean(r_c - r_r), and the same loss.

**Output** (``output_dir``, atomic): a plain merged HF sequence-classification
model (LoRA folded in), its tokenizer, ``metrics.jsonl`` (one row per evaluation,
step 0 = before training) and ``parityrl_rm.json`` (how to render inputs,
final metrics, the base model).
"""
from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from trainer.config import ModelConfig, RecipeError, build_config, check_model_path, load_recipe_dict
from trainer.sft.recipe import SupervisedLoggingConfig, validate_supervised_train

RM_INFO_FILE = "parityrl_rm.json"


# --------------------------------------------------------------------------- recipe


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
class RMTrainConfig:
    steps: int = 100
    batch_size: int = 16  # preference pairs per optimizer step (2 x batch_size sequences)
    # pairs per forward/backward; batch_size / micro_batch_size micro-batches are accumulated (null: one)
    micro_batch_size: Optional[int] = None
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    warmup_ratio: float = 0.0  # instead of warmup_steps: ceil(ratio x steps)
    lr_schedule: str = "constant"  # transformers.get_scheduler: constant(_with_warmup), linear, cosine
    max_grad_norm: float = 1.0
    seed: int = 0
    save_every: int = 0  # a Trainer checkpoint every N steps under logging.run_dir/checkpoints (--resume); 0 = none
    keep_last: int = 2
    eval_every: int = 25  # steps; the held-out split is also scored before step 1 and after the last
    eval_batch_size: int = 64


@dataclass
class RMConfig:
    name: str = "rm"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: RMDataConfig = field(default_factory=RMDataConfig)
    train: RMTrainConfig = field(default_factory=RMTrainConfig)
    output_dir: str = "runs/{name}/model"
    print_every: int = 10
    logging: SupervisedLoggingConfig = field(default_factory=SupervisedLoggingConfig)

    @property
    def out_path(self) -> Path:
        return Path(self.output_dir.format(name=self.name))

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.run_dir.format(name=self.name))


def load_rm_recipe(path, overrides=(), *, check_paths: bool = True) -> RMConfig:
    data, where = load_recipe_dict(path, overrides)
    cfg = build_config(RMConfig, data, where)
    validate_rm(cfg, where, check_paths=check_paths)
    return cfg


def single_split_source(source: str) -> bool:
    """A local file, or a save_to_disk directory of one Dataset: sources with no named splits."""
    p = Path(source).expanduser()
    if source.startswith("builtin:") or not p.exists():
        return False
    return p.is_file() or not (p / "dataset_dict.json").is_file()


def validate_rm(cfg: RMConfig, where: str, *, check_paths: bool = True) -> None:
    def need(ok: bool, key: str, value: Any, expected: str) -> None:
        if not ok:
            raise RecipeError(f"{where}: {key} = {value!r}: expected {expected}")

    d, t, lora = cfg.data, cfg.train, cfg.model.lora
    need(len({d.prompt_column, d.chosen_column, d.rejected_column}) == 3, "data.rejected_column", d.rejected_column,
         "three different columns for prompt, chosen and rejected")
    need(d.eval_split is None or d.eval_split != d.split, "data.eval_split", d.eval_split,
         f"a split other than data.split ({d.split!r}), or null to hold out data.eval_fraction of it")
    need(d.eval_split is None or not single_split_source(d.source), "data.eval_split", d.eval_split,
         f"null for {d.source!r}: a single file has one split, so the held-out rows must come from "
         "data.eval_fraction")
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
    try:
        str(cfg.out_path)
    except (KeyError, IndexError, ValueError):
        raise RecipeError(f"{where}: output_dir = {cfg.output_dir!r}: expected a path; the only placeholder is {{name}}") from None
    if check_paths:
        check_model_path(cfg.model.path, where)
        from trainer.config import model_max_positions

        max_pos = model_max_positions(cfg.model.path)
        need(max_pos is None or d.max_tokens <= max_pos, "data.max_tokens", d.max_tokens,
             f"at most the model's context of {max_pos} tokens")


# --------------------------------------------------------------------------- rendering and scoring


def render_ids(tokenizer, prompts: Sequence[str], completions: Sequence[str], *, use_chat_template: bool,
               max_tokens: Optional[int], where: str = "reward model") -> list[list[int]]:
    """Token ids of ``prompt + completion + EOS`` per sample (see the module docstring).

    Raises ValueError naming ``where`` and the sample when a sequence has more
    than ``max_tokens`` tokens: truncating would cut the end, where the score is read.
    """
    from trainer.data.datasets import encode_prompts

    if len(prompts) != len(completions):
        raise ValueError(f"{where}: {len(completions)} completions for {len(prompts)} prompts")
    prompt_ids = encode_prompts(tokenizer, list(prompts), use_chat_template=use_chat_template)
    eos = tokenizer.eos_token_id
    out = []
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        if not isinstance(c, str):
            raise TypeError(f"{where}: completion {i} is {type(c).__name__}, expected str")
        ids = p + tokenizer.encode(c, add_special_tokens=False) + [eos]
        if max_tokens is not None and len(ids) > max_tokens:
            raise ValueError(f"{where}: sample {i}: prompt + completion + EOS is {len(ids)} tokens, more than "
                             f"max_tokens = {max_tokens} (prompt starts {prompts[i][:50]!r})")
        out.append(ids)
    return out


def pad_sequences(seqs: Sequence[Sequence[int]], pad_id: int, *, side: str = "right",
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids), each [B, max_len]; positions restart at 0 per sequence."""
    if side not in ("left", "right"):
        raise ValueError(f"side={side!r}; expected 'left' or 'right'")
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("pad_sequences: every sequence needs at least one token")
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(0, len(s)) if side == "right" else slice(n - len(s), n)
        ids[i, cols] = torch.tensor(list(s), dtype=torch.long)
        mask[i, cols] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] index of the rightmost position with mask 1 (left or right padding alike)."""
    if not bool((attention_mask.sum(1) > 0).all()):
        raise ValueError("last_token_index: a row of the attention mask has no real token")
    cols = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (cols * (attention_mask > 0)).argmax(1)


def _parts(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(backbone returning hidden states, score head) of a *ForSequenceClassification, PEFT-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(base, base.base_model_prefix, None)
    head = getattr(base, "score", None)
    if backbone is None or head is None:
        raise TypeError(f"{type(base).__name__}: expected a *ForSequenceClassification with a `score` head "
                        f"(backbone {base.base_model_prefix!r})")
    return backbone, head


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor) -> torch.Tensor:
    """[B] float32 rewards: the score head on the hidden state of each row's last real token."""
    backbone, head = _parts(model)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False).last_hidden_state
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    pooled = hidden[rows, last_token_index(attention_mask)]
    head_dtype = next(head.parameters()).dtype
    return head(pooled.to(head_dtype)).squeeze(-1).float()


def pairwise_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """mean(-log sigmoid(r_c - r_r)) (Ouyang et al. 2022, eq. 1); logsigmoid is stable for large margins."""
    return -torch.nn.functional.logsigmoid(r_chosen - r_rejected).mean()


def pair_metrics(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> dict[str, float]:
    """accuracy (r_c > r_r; ties are wrong), mean margin r_c - r_r, and the pairwise loss."""
    margin = (r_chosen - r_rejected).float()
    return {"accuracy": float((margin > 0).float().mean()), "margin": float(margin.mean()),
            "loss": float(pairwise_loss(r_chosen.float(), r_rejected.float()))}


@contextlib.contextmanager
def _quiet_transformers():
    # Loading a causal LM as a classifier reports the dropped lm_head and the new score
    # head as a warning table; both are intended here, so it is silenced for that call.
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


class RewardModelScorer:
    """A trained reward model as a reward function: ``f(prompts, completions, **columns) -> list[float]``.

    reward_i = r(prompt_i, completion_i) - baseline (see the module docstring for r
    and the rendering), in batches of ``batch_size``, eval mode, no gradient, on
    ``device``. A baseline (e.g. the mean score of the SFT policy's completions)
    centres the rewards: group-normalised advantages (GRPO, RLOO) do not change,
    algorithms that see the reward's level (PPO's value targets, a KL-penalised
    return) do. NaN / inf scores are reported by
    ``trainer.data.rewards.compute_rewards``, which validates every reward source by name.
    """

    def __init__(self, path: str | Path, *, name: str = "reward_model", device: torch.device | str = "cpu",
                 batch_size: int = 32, baseline: float = 0.0, max_tokens: Optional[int] = None):
        from transformers import AutoModelForSequenceClassification

        from trainer.models.policy import load_tokenizer

        d = Path(path).expanduser()
        where = f"reward model {name!r} ({d})"
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"{where}: not a Hugging Face model directory (no config.json)")
        if batch_size < 1:
            raise ValueError(f"{where}: batch_size = {batch_size!r}: expected an integer >= 1")
        if not math.isfinite(baseline):
            raise ValueError(f"{where}: baseline = {baseline!r}: expected a finite number")
        self.name, self.where, self.device = name, where, torch.device(device)
        self.batch_size, self.baseline = batch_size, float(baseline)
        self.tokenizer = load_tokenizer(str(d))
        with _quiet_transformers():
            model = AutoModelForSequenceClassification.from_pretrained(str(d), dtype="auto")
        if model.config.num_labels != 1:
            raise ValueError(f"{where}: the model has num_labels = {model.config.num_labels}; expected a reward "
                             "model with one output (num_labels = 1, as `parityrl train-rm` writes)")
        info_file = d / RM_INFO_FILE
        info = json.loads(info_file.read_text()) if info_file.is_file() else {}
        # Render as at training time; a reward model from elsewhere gets the chat template if it has one.
        self.use_chat_template = bool(info.get("use_chat_template", bool(getattr(self.tokenizer, "chat_template", None))))
        context = getattr(model.config, "max_position_embeddings", None)
        self.max_tokens = max_tokens if max_tokens is not None else context
        if context is not None and self.max_tokens > context:
            raise ValueError(f"{where}: max_tokens = {max_tokens}: expected at most the model's context of {context}")
        # The head in float32 (hidden -> 1: negligible cost): a bf16 score has ~2-3 significant
        # digits, so close pairs would round to ties and small reward differences vanish.
        _parts(model)[1].float()
        self.model = model.to(self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        """Raw rewards r(prompt, completion), without the baseline."""
        seqs = render_ids(self.tokenizer, prompts, completions, use_chat_template=self.use_chat_template,
                          max_tokens=self.max_tokens, where=self.where)
        out: list[float] = []
        for i in range(0, len(seqs), self.batch_size):
            batch = pad_sequences(seqs[i:i + self.batch_size], self.tokenizer.pad_token_id, device=self.device)
            out += sequence_scores(self.model, *batch).tolist()
        return out

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float]:
        return [r - self.baseline for r in self.score(prompts, completions)]


def build_reward_sources(reward, device: torch.device | str) -> tuple[dict[str, Callable], dict[str, float]]:
    """All reward sources of a recipe's ``reward`` section: (name -> callable, name -> weight).

    Rule functions (``reward.functions``, resolved by ``trainer.data.rewards.resolve_reward``)
    and reward models (``reward.models``, each a ``RewardModelScorer`` on ``device``)
    share one namespace: their names become ``reward/<name>`` metrics, so a name used
    by both is refused. Weights default to 1.0; the step's reward is
    ``sum_k weight_k * reward_k`` (``trainer.data.rewards.compute_rewards``).
    """
    from trainer.data.rewards import resolve_reward

    both = sorted(set(reward.functions) & set(reward.models))
    if both:
        raise ValueError(f"reward source name(s) {both} are used by both reward.functions and reward.models; "
                         "each name is one reward/<name> metric, so it must be unique")
    fns: dict[str, Callable] = {name: resolve_reward(spec) for name, spec in reward.functions.items()}
    for name, entry in reward.models.items():
        fns[name] = RewardModelScorer(entry.path, name=name, device=device, batch_size=entry.batch_size,
                                      baseline=entry.baseline, max_tokens=entry.max_tokens)
    unknown = sorted(set(reward.weights) - set(fns))
    if unknown:
        raise ValueError(f"reward.weights names {unknown}, which are neither reward.functions nor reward.models "
                         f"({', '.join(fns)})")
    return fns, {name: float(reward.weights.get(name, 1.0)) for name in fns}


# --------------------------------------------------------------------------- training


def load_preference_pairs(cfg: RMConfig) -> tuple[dict[str, list], dict[str, list]]:
    """(train, held-out): each {"prompt": [...], "chosen": [...], "rejected": [...]} of strings."""
    from trainer.data.datasets import load_prompt_dataset

    d = cfg.data

    def load(split: str, n: Optional[int]):
        ds = load_prompt_dataset(d.source, split=split, prompt_column=d.prompt_column, answer_column=None,
                                 num_examples=n, seed=cfg.train.seed, builtin_kwargs=d.builtin_kwargs)
        for key, col in (("chosen_column", d.chosen_column), ("rejected_column", d.rejected_column)):
            if col not in ds.column_names:
                raise RecipeError(f"data.{key} = {col!r}: no such column in {d.source} (split {split!r}); "
                                  f"columns: {ds.column_names}")
        return {"prompt": ds["prompt"], "chosen": [str(x) for x in ds[d.chosen_column]],
                "rejected": [str(x) for x in ds[d.rejected_column]]}

    train = load(d.split, d.num_examples)
    if d.eval_split is not None:
        return train, load(d.eval_split, d.num_eval_examples)
    n = len(train["prompt"])
    order = list(range(n))
    random.Random(cfg.train.seed).shuffle(order)
    k = d.num_eval_examples or max(1, math.ceil(n * d.eval_fraction))
    if k >= n:
        raise RecipeError(f"data.eval_fraction = {d.eval_fraction}: holding out {k} of {n} rows leaves none to train on")
    held, kept = order[:k], order[k:]
    pick = lambda rows: {key: [col[i] for i in rows] for key, col in train.items()}
    return pick(kept), pick(held)


def _encode_pairs(cfg: RMConfig, tokenizer, pairs: dict[str, list], which: str) -> tuple[list, list]:
    kw = dict(use_chat_template=cfg.data.use_chat_template, max_tokens=cfg.data.max_tokens)
    where = f"{cfg.data.source} ({which})"
    return (render_ids(tokenizer, pairs["prompt"], pairs["chosen"], where=f"{where} chosen", **kw),
            render_ids(tokenizer, pairs["prompt"], pairs["rejected"], where=f"{where} rejected", **kw))


def load_model_for_rm_training(model_dir: str, cfg: RMConfig, tokenizer, device):
    """The causal LM as a 1-output classifier, with LoRA (SEQ_CLS) or all parameters trainable."""
    from transformers import AutoModelForSequenceClassification

    from trainer.models.policy import DTYPES

    with _quiet_transformers():
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=DTYPES[cfg.model.dtype])
    model.config.pad_token_id = tokenizer.pad_token_id  # HF's own pooling reads it (module docstring)
    model.score.float()  # before PEFT copies it into modules_to_save: the head trains in float32
    lora = cfg.model.lora
    if lora.enabled:
        from peft import LoraConfig as PeftLoraConfig, get_peft_model

        from trainer.models.architecture import resolve_lora_targets

        try:
            targets = resolve_lora_targets(model, lora.target_modules)
        except ValueError as err:
            raise RecipeError(f"{model_dir}: {err}") from None
        model = get_peft_model(model, PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                     target_modules=targets, task_type="SEQ_CLS"))
    elif cfg.model.dtype == "bfloat16":
        model = model.float()  # full fine-tuning: float32 master weights (as `parityrl sft` does)
    return model.to(device)


@torch.no_grad()
def evaluate_pairs(model, chosen: list, rejected: list, pad_id: int, batch_size: int, device) -> dict[str, float]:
    """Held-out accuracy, margin and loss over all pairs, in eval mode (dropout off)."""
    was_training = model.training
    model.eval()
    rc, rr = [], []
    for i in range(0, len(chosen), batch_size):
        rc.append(sequence_scores(model, *pad_sequences(chosen[i:i + batch_size], pad_id, device=device)))
        rr.append(sequence_scores(model, *pad_sequences(rejected[i:i + batch_size], pad_id, device=device)))
    model.train(was_training)
    return pair_metrics(torch.cat(rc), torch.cat(rr))


def run_train_rm(cfg: RMConfig, *, resume: bool = False) -> Path:
    """Train a reward model per ``cfg`` and write it to ``cfg.out_path`` (atomically); returns that path.

    The loop is ``transformers.Trainer``'s (trainer.sft.hf_trainer): accumulation over
    ``train.micro_batch_size``, checkpoints every ``train.save_every`` steps under the run
    directory and ``resume`` from the newest, per-step metrics to the run's metrics.jsonl
    and wandb. The held-out evaluation (before step 1, every ``eval_every`` steps, after
    the last) is appended to the run directory's ``eval.jsonl`` as it happens (a resumed
    run keeps the earlier rows) and copied into the output as ``metrics.jsonl``.
    """
    from trainer.io.outputs import refuse_existing_output
    from trainer.sft.hf_trainer import run_stage

    refuse_existing_output(cfg.out_path, "output_dir")  # before any loading: fail in seconds, not after training
    return run_stage(cfg.run_dir, resume=resume, body=lambda checkpoint: _train_rm(cfg, checkpoint, resume))


def _train_rm(cfg: RMConfig, checkpoint: Optional[str], resume: bool) -> Path:
    from transformers import TrainerCallback

    from trainer.io.outputs import atomic_output_dir
    from trainer.models.builtin import resolve_model_path
    from trainer.models.policy import load_tokenizer
    from trainer.sft.hf_trainer import StageLogger, is_main_process, make_trainer, open_run_logger, training_arguments

    out, run_dir = cfg.out_path, cfg.run_dir
    torch.manual_seed(cfg.train.seed)
    args = training_arguments(cfg.train, run_dir)
    model_dir = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(model_dir)
    try:  # bad data is bad input (exit status 2 in the CLI), found before any training
        train_pairs, eval_pairs = load_preference_pairs(cfg)
        train_c, train_r = _encode_pairs(cfg, tokenizer, train_pairs, "train")
        eval_c, eval_r = _encode_pairs(cfg, tokenizer, eval_pairs, "held-out")
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
