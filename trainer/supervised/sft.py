"""The SFT stage (`parityrl sft`): supervised fine-tuning on prompt -> completion pairs.

The first stage of the SFT -> RL pipeline (as in TRL's StackLLaMA example): it
teaches the output format so that RL starts from a policy with non-zero
reward. The built-in default model's warm start is exactly
``parityrl sft recipes/sft_tiny.yaml``.

The target is a completion (``data.completion_column`` or ``data.completion_fn``) after the prompt, or a whole
conversation (``data.messages_fn``: ``f(prompt, **columns) -> list of chat messages``, with ``data.tools``
offered to the template): multi-turn episodes with tool calls and tool results. A conversation's prompt is its
rendering up to the first assistant turn's generation prompt, its completion the rest, and its targets only the
tokens the assistant writes (the template's ``{% generation %}`` mask); tool results, later user turns and role
tags stay in the input as context (``build_token_batch(completion_mask=...)``), as in an RL episode. Padded
layout only.

Two batch layouts (``data.packing``), one loss: the mean negative log-likelihood
of the target tokens, computed through the same fused log-prob kernel as RL.

* **padded** (``packing: false``, the default): one prompt/completion pair per
  row, prompts left-padded, completions right-padded; the targets are the
  completion tokens (EOS included) -- prompt tokens are context only.
* **packed** (``packing: true``), as in the StackLLaMA write-up
  (https://huggingface.co/blog/stackllama, "Supervised fine-tuning"; TRL's
  ``ConstantLengthDataset``): every example becomes one document, prompt ids
  (encoded exactly as in padded mode) + completion ids + EOS; the documents, in a
  seeded shuffled order, are concatenated and cut into blocks of exactly
  ``data.block_size`` tokens. No padding, so no compute is spent on pad tokens.
  The targets are EVERY token of a block except its first (which has nothing
  before it in the block to be predicted from): prompt tokens included, as in
  the write-up, so the model also learns to model the prompts. Attention inside
  a block is plain causal attention over the concatenated documents, with
  positions 0..block_size-1 counted from the block start: a token can attend to
  the end of the previous document across the EOS separator, as in the write-up
  (no per-document mask); a document may be split across two blocks. The tail
  of the concatenation shorter than one block is dropped (at most
  ``block_size - 1`` tokens per run).

The output directory (``output_format``) holds either a plain HF model (a LoRA,
if used, merged into it: ``merged``) or the LoRA adapter alone (``adapter``, to be
folded in later with ``parityrl merge <base> <adapter> --out <dir>``), plus the
tokenizer, written atomically.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
from transformers.utils import logging as hf_logging

from trainer.config.schema import RecipeError
from trainer.config.supervised import SFTConfig
from trainer.data.datasets import encode_prompts, load_prompt_dataset
from trainer.distributed.launch_info import current_backend, describe_launch, device_text
from trainer.environments.loading import resolve_tools
from trainer.models.batch import TokenBatch, build_token_batch
from trainer.models.policy import add_lora, completion_logprobs, load_base_model, load_tokenizer
from trainer.rewards.functions import resolve_reward
from trainer.supervised.hf_trainer import (
    StageLogger,
    is_main_process,
    item_labels,
    make_trainer,
    open_run_logger,
    run_stage,
    training_arguments,
)
from trainer.supervised.image_tensors import batch_images, image_tensors
from trainer.vision.pixels import PromptPixels, vision_batch
from trainer.vision.prompts import VisionPrompts, vision_prompts


def _pairs(cfg: SFTConfig, tokenizer, vision: Optional[VisionPrompts] = None
           ) -> tuple[list[list[int]], list[list[int]], Optional[list[list[int]]], Optional[list[PromptPixels]]]:
    """Prompt ids, completion ids, for ``data.messages_fn`` the 0/1 mask of the completion ids to train on, and for
    ``data.image_column`` (``vision``) each prompt's pixels: its prompt ids are then the processor's expanded ids,
    as the RL trainer scores them (``trainer.vision.prompts``)."""
    d = cfg.data
    ds = load_prompt_dataset(d.source, split=d.split, prompt_column=d.prompt_column, answer_column=None,
                             num_examples=d.num_examples, seed=cfg.train.seed, builtin_kwargs=d.builtin_kwargs)
    rows = ds.to_list()
    if d.messages_fn is not None:
        return (*_conversation_pairs(cfg, tokenizer, rows), None)
    if d.completion_column is not None:
        if d.completion_column not in ds.column_names:
            raise RecipeError(f"data.completion_column = {d.completion_column!r}: no such column in {d.source}; "
                              f"columns: {ds.column_names}")
        completions = [str(r[d.completion_column]) for r in rows]
    else:
        fn = resolve_reward(d.completion_fn)  # same "module:function" resolution
        completions = [fn(r["prompt"], **{k: v for k, v in r.items() if k != "prompt"}) for r in rows]
    pixels = None
    if vision is not None:
        try:
            encoded = vision.encode(rows).expected
        except ValueError as e:
            raise RecipeError(f"{d.source}: {e}") from None
        prompt_ids, pixels = [e.ids for e in encoded], [e.pixels for e in encoded]
    else:
        prompt_ids = encode_prompts(tokenizer, [r["prompt"] for r in rows], use_chat_template=d.use_chat_template,
                                    max_prompt_tokens=d.max_prompt_tokens, system_prompt=d.system_prompt)
    completion_ids = []
    for i, text in enumerate(completions):
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        if len(ids) > d.max_completion_tokens:
            raise RecipeError(f"data.max_completion_tokens = {d.max_completion_tokens}: {d.source} example {i}'s "
                              f"completion has {len(ids)} tokens with EOS ({text!r}); expected a budget that holds it")
        completion_ids.append(ids)
    return prompt_ids, completion_ids, None, pixels


def conversation_example(tokenizer, messages: list[dict], tools: Optional[list[dict]] = None,
                         ) -> tuple[list[int], list[int], list[int]]:
    """``(prompt_ids, completion_ids, completion_mask)`` of one conversation.

    The prompt is the rendering up to and including the first assistant turn's generation prompt (what a rollout
    starts from); the completion is the rest of the conversation's ids, and the mask marks the tokens inside the
    template's ``{% generation %}`` blocks (the assistant's own text and end-of-turn token) with 1, everything the
    model reads but does not write (tool results, user turns, the next ``<|assistant|>`` tag) with 0.
    """
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None or first == 0:
        raise ValueError("the conversation needs a message before its first assistant message and at least one "
                         f"assistant message; roles: {[m.get('role') for m in messages]}")
    prompt_text = tokenizer.apply_chat_template(messages[:first], tools=tools, tokenize=False,
                                                add_generation_prompt=True)
    # As rollouts encode prompts (trainer.data.datasets.encode_prompts): the template writes any BOS itself.
    prompt_ids = list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    full = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
    ids, mask = list(full["input_ids"]), list(full["assistant_masks"])
    if ids[:len(prompt_ids)] != prompt_ids:
        raise ValueError("the chat template is not append-only here: the conversation's ids do not start with the "
                         "ids of its prompt (rendered up to the first assistant turn's generation prompt)")
    if not any(mask[len(prompt_ids):]):
        raise ValueError("the chat template marks no assistant tokens (return_assistant_tokens_mask): it needs "
                         "{% generation %} ... {% endgeneration %} around the assistant's text")
    return prompt_ids, ids[len(prompt_ids):], [int(m) for m in mask[len(prompt_ids):]]


def _conversation_pairs(cfg: SFTConfig, tokenizer, rows: list[dict]):
    d = cfg.data
    fn = resolve_reward(d.messages_fn)  # same "module:function" resolution
    try:
        tools = resolve_tools(d.tools).schemas if d.tools is not None else None
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        raise RecipeError(f"data.tools = {d.tools!r}: {e}") from None
    prompts, completions, masks = [], [], []
    for i, r in enumerate(rows):
        messages = fn(r["prompt"], **{k: v for k, v in r.items() if k != "prompt"})
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise RecipeError(f"data.messages_fn = {d.messages_fn!r}: example {i}: returned a "
                              f"{type(messages).__name__}; expected a list of chat messages (dicts)")
        if d.system_prompt is not None and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": d.system_prompt}, *messages]
        try:
            p, c, m = conversation_example(tokenizer, messages, tools)
        except ValueError as e:
            raise RecipeError(f"data.messages_fn = {d.messages_fn!r}: example {i}: {e}") from None
        if len(p) > d.max_prompt_tokens:
            raise ValueError(f"{d.source}: example {i}: prompt has {len(p)} tokens, more than "
                             f"data.max_prompt_tokens = {d.max_prompt_tokens}")
        if len(c) > d.max_completion_tokens:
            raise ValueError(f"{d.source}: example {i}: completion has {len(c)} tokens, more than "
                             f"data.max_completion_tokens = {d.max_completion_tokens}")
        prompts.append(p)
        completions.append(c)
        masks.append(m)
    return prompts, completions, masks


def pack_documents(docs: list[list[int]], block_size: int, eos_id: int) -> list[list[int]]:
    """Documents joined with EOS, concatenated, cut into ``block_size`` blocks; the short tail is dropped.

    A document that does not already end in ``eos_id`` gets one appended, so
    consecutive documents are always separated by exactly one EOS.
    """
    if block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be >= 1")
    stream: list[int] = []
    for doc in docs:
        stream += doc if doc and doc[-1] == eos_id else [*doc, eos_id]
    return [stream[i:i + block_size] for i in range(0, len(stream) - block_size + 1, block_size)]


def packed_batch(blocks: list[list[int]], device: torch.device | str = "cpu"):
    """Blocks -> a TokenBatch whose targets are every token after the first (prompt_len 1, no padding)."""
    ids = torch.tensor(blocks, dtype=torch.long)
    s, n = ids.shape
    targets = ids[:, 1:]
    return TokenBatch(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                      position_ids=torch.arange(n).expand(s, n).contiguous().to(device), targets=targets.to(device),
                      mask=torch.ones(targets.shape, dtype=torch.float32, device=device),
                      rollout_logprobs=torch.zeros(targets.shape, dtype=torch.float32, device=device), prompt_len=1)


def _packed_blocks(cfg: SFTConfig, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                   eos_id: int) -> list[list[int]]:
    docs = [p + c for p, c in zip(prompt_ids, completion_ids)]
    # The dataset's own order may be sorted (by length, by source); packing neighbours
    # from one group into every block would bias the batches. A separate stream, so the
    # batch-order RNG is the same as in padded mode.
    random.Random(f"pack:{cfg.train.seed}").shuffle(docs)
    blocks = pack_documents(docs, cfg.data.block_size, eos_id)
    if not blocks:
        total = sum(len(d) + (d[-1] != eos_id) for d in docs)
        raise RecipeError(f"data.block_size = {cfg.data.block_size}: the {len(docs)} examples make only {total} "
                          "tokens, less than one block; use more examples or a smaller block")
    return blocks


def fit_sft(cfg: SFTConfig, model_dir: str, *, resume: bool = False, console_log: bool = False) -> Path:
    """Train the model in ``model_dir`` (already resolved: a local HF directory) and write it to ``cfg.out_path``.

    The loop is ``transformers.Trainer``'s (trainer.supervised.hf_trainer): accumulation over
    ``train.micro_batch_size``, checkpoints every ``train.save_every`` steps under the run
    directory, ``resume`` from the newest of them, metrics to the run's metrics.jsonl and wandb.
    ``console_log``: as ``run_stage``.
    """
    return run_stage(cfg.run_dir, resume=resume, body=lambda checkpoint: _fit(cfg, model_dir, checkpoint, resume),
                     console_log=console_log)


def _fit(cfg: SFTConfig, model_dir: str, checkpoint: Optional[str], resume: bool) -> Path:
    run_dir = cfg.run_dir
    torch.manual_seed(cfg.train.seed)
    args = training_arguments(cfg.train, run_dir)
    if is_main_process():  # what this launch runs on (args.device sets up the process group)
        print(describe_launch(world=args.world_size, backend=current_backend(), device=device_text(args.device),
                              dtype=cfg.model.dtype), flush=True)
    tokenizer = load_tokenizer(model_dir)
    model = load_base_model(model_dir, cfg.model.dtype, "cpu", cfg.model.attn_implementation, train_device=args.device)
    if cfg.model.lora.enabled:
        model = add_lora(model, cfg.model.lora)
    vision = vision_prompts(cfg, model_dir)  # None: text prompts
    prompt_ids, completion_ids, completion_masks, pixels = _pairs(cfg, tokenizer, vision)
    if cfg.data.packing:
        blocks = _packed_blocks(cfg, prompt_ids, completion_ids, tokenizer.eos_token_id)
        num_rows = len(blocks)
        make_batch = lambda idx: packed_batch([blocks[i] for i in idx])
        print(f"sft packing: {len(prompt_ids)} examples -> {len(blocks)} blocks of {cfg.data.block_size} tokens",
              flush=True)
    else:
        num_rows = len(prompt_ids)
        def make_batch(idx: list[int]) -> TokenBatch:
            b = build_token_batch(
                [prompt_ids[i] for i in idx], [completion_ids[i] for i in idx], tokenizer.pad_token_id,
                completion_mask=None if completion_masks is None else [completion_masks[i] for i in idx])
            if pixels is None:
                return b
            return replace(b, vision=vision_batch([pixels[i] for i in idx], vision.image_token_id))
    if num_rows < args.per_device_train_batch_size:
        raise RecipeError(f"train.batch_size = {cfg.train.batch_size}: the data has only {num_rows} rows; "
                          "use more examples or a smaller batch")
    # Full fine-tuning keeps master weights in the model dtype; for bf16 that means
    # small updates round away, so the warm start trains a float32 copy when lora is off.
    if not cfg.model.lora.enabled and cfg.model.dtype == "bfloat16":
        model = model.float()

    tensors = ("input_ids", "attention_mask", "position_ids", "targets", "mask", "rollout_logprobs")

    def collate(idx: list[int]) -> dict:
        # the Trainer moves a dict of tensors to the device; the batch is rebuilt from it in loss_fn
        b = make_batch(idx)
        labels = item_labels(b.mask)
        return {**{k: getattr(b, k) for k in tensors}, "prompt_len": torch.tensor(b.prompt_len), "labels": labels,
                "shift_labels": labels, **image_tensors(b.vision)}

    def loss_fn(model, x: dict):
        batch = TokenBatch(**{k: x[k] for k in tensors}, prompt_len=int(x["prompt_len"]),
                           vision=None if vision is None else batch_images(x, vision.image_token_id))
        lp, _ = completion_logprobs(model, batch, temperature=1.0)
        # throughput: tokens attended to (not padding) and tokens with a loss
        return -(lp * batch.mask).sum(), {"tokens": float(batch.attention_mask.sum()),
                                          "target_tokens": float(batch.mask.sum())}

    logger = open_run_logger(cfg, "sft", resume=resume)
    trainer = None

    def throughput(row: dict) -> str:
        return f"{trainer.counters.get('tokens', 0.0) / max(row['perf/elapsed_s'], 1e-9):,.0f} tokens/s  "

    stage = StageLogger(logger, "sft", cfg.print_every, throughput)
    trainer = make_trainer(model, args, num_rows=num_rows, collate=collate, loss_fn=loss_fn, callbacks=[stage])
    t0 = time.time()
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
    finally:
        logger.close()
    elapsed = max(time.time() - t0, 1e-9)
    history = [r["train/loss"] for r in stage.history]
    model = trainer.model.model  # LossModule(model): the trained model itself
    out = cfg.out_path
    if is_main_process():
        if cfg.output_format == "merged":
            if cfg.model.lora.enabled:
                model = model.merge_and_unload()
            model = model.to(dtype=getattr(torch, cfg.model.dtype))
        # (output_format adapter: PEFT's save_pretrained writes the adapter and its config,
        # which records the base directory; the adapter weights stay float32.)
        # a processor's config is the base's own: saving names the image processor by its default class
        # (trainer.builtin.zoo_vl), which would differ from the one both sides ran
        copied = tuple(p for p in [Path(model_dir) / "processor_config.json"] if vision is not None and p.is_file())
        save_model_dir(model, tokenizer if vision is None else vision.processor, out, copied=copied, extra={
            "sft_loss_first": history[0] if history else None, "sft_loss_last": history[-1] if history else None,
            "sft_steps": cfg.train.steps, "base_model": model_dir, "packing": cfg.data.packing,
            "output_format": cfg.output_format, "resumed_from": checkpoint,
            "tokens_per_s": trainer.counters.get("tokens", 0.0) / elapsed,
            "target_tokens_per_s": trainer.counters.get("target_tokens", 0.0) / elapsed, "train_seconds": elapsed})
    return out


def save_model_dir(model, tokenizer, out: Path, extra: Optional[dict] = None, copied: tuple[Path, ...] = ()) -> None:
    """Save an HF model + tokenizer (or processor) to ``out`` atomically (temp dir, then rename); ``copied``: files
    written as they are over what the save wrote."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp_{out.name}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    # Transformers draws a bar per weight shard ("Writing model shards"): the command's own line says where
    # the model went, and in a first `parityrl train` (the warm start is built by this function) the bar is
    # third-party noise on the console.
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    for f in copied:
        shutil.copyfile(f, tmp / Path(f).name)
    if extra:
        (tmp / "parityrl_sft.json").write_text(json.dumps(extra, indent=2))
    if out.exists():
        backup = out.parent / f".old_{out.name}_{os.getpid()}"
        os.replace(out, backup)
        os.replace(tmp, out)
        shutil.rmtree(backup, ignore_errors=True)
    else:
        os.replace(tmp, out)
