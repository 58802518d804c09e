"""Folding a LoRA adapter into its base model (`parityrl merge`, trainer/commands/merge.py).

For every adapted linear layer ``W' = W + (alpha / r) * B @ A`` (PEFT's
``merge_and_unload``), computed in float32 from the base's stored weights and
rounded once to the output dtype (default: the base's own dtype) -- the same
rule as the trainer's weight sync (``rollout/weight_export.py``). The result is a
plain Hugging Face model directory that needs neither PEFT nor the base: the
next stage (``parityrl train-rm``, an RL recipe's ``model.path``, vLLM) loads it
like any other model.

Adapters it takes: ``parityrl sft`` with ``output_format: adapter``, and an RL
run's ``checkpoints/step_NNNNNN/adapter``. The tokenizer is copied from the
adapter directory when it has one (``parityrl sft`` saves it there), else from
the base.

Checks, each an error naming the paths: missing directories, a directory that
is not a PEFT LoRA adapter, an adapter whose modules or shapes do not fit the
base (PEFT's own errors), and any adapter weight the base did not take (so a
partly applied adapter is never saved). The base the adapter was trained on is
recorded in its ``adapter_config.json``; a different directory with matching
shapes cannot be told apart by the weights, so that case is a warning.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Optional

import torch
from peft import PeftModel, get_peft_model_state_dict
from peft.utils import load_peft_weights
from transformers import AutoModelForCausalLM

from trainer.io.outputs import atomic_output_dir, refuse_existing_output
from trainer.models.policy import load_tokenizer


class MergeError(ValueError):
    """Bad input to a merge: the message names the path and what was expected."""


SUPPORTED_TASKS = (None, "CAUSAL_LM")


def _adapter_config(adapter: str) -> tuple[Path, dict]:
    d = Path(adapter).expanduser()
    if not d.is_dir():
        raise MergeError(f"adapter = {adapter!r}: no such directory")
    cfg_file = d / "adapter_config.json"
    if not cfg_file.is_file():
        hint = f"; did you mean {str(d / 'adapter')!r} (an RL checkpoint keeps its adapter there)?" \
            if (d / "adapter" / "adapter_config.json").is_file() else \
            " (written by `parityrl sft` with output_format: adapter, or an RL checkpoint's adapter/)"
        raise MergeError(f"adapter = {adapter!r}: no adapter_config.json; expected a PEFT adapter directory{hint}")
    try:
        conf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise MergeError(f"adapter = {adapter!r}: adapter_config.json is not valid JSON: {e}") from None
    if conf.get("peft_type") != "LORA":
        raise MergeError(f"adapter = {adapter!r}: peft_type = {conf.get('peft_type')!r}; expected 'LORA'")
    if conf.get("task_type") not in SUPPORTED_TASKS:
        raise MergeError(f"adapter = {adapter!r}: task_type = {conf.get('task_type')!r}; expected CAUSAL_LM "
                         "(`parityrl train-rm` already writes a merged reward model)")
    return d, conf


def _saved_dtype(base_dir: Path) -> str:
    conf = json.loads((base_dir / "config.json").read_text())
    name = conf.get("dtype") or conf.get("torch_dtype") or "float32"
    return name if name in ("bfloat16", "float16", "float32") else "float32"


def _check_all_loaded(peft_model, adapter_dir: Path, base_dir: Path) -> None:
    """Every tensor of the adapter file landed in the model, with the same values."""
    on_disk = load_peft_weights(str(adapter_dir), device="cpu")
    in_model = get_peft_model_state_dict(peft_model)
    missing = sorted(set(on_disk) - set(in_model))
    if missing:
        raise MergeError(f"adapter {str(adapter_dir)!r} does not fit base {str(base_dir)!r}: {len(missing)} adapter "
                         f"tensor(s) have no place in the base, e.g. {missing[:3]}")
    for key, value in on_disk.items():
        if not torch.equal(in_model[key].cpu().to(value.dtype), value):
            raise MergeError(f"adapter {str(adapter_dir)!r}: tensor {key!r} was not loaded into base "
                             f"{str(base_dir)!r} unchanged")


def load_merged(base_dir: Path, adapter: str, *, dtype: str = "auto"):
    """(merged model in ``dtype``, tokenizer, record) without writing anything; ``base_dir`` a local HF model."""
    adapter_dir, conf = _adapter_config(adapter)
    out_dtype = _saved_dtype(base_dir) if dtype == "auto" else dtype
    if out_dtype not in ("bfloat16", "float16", "float32"):
        raise MergeError(f"--dtype = {dtype!r}: expected auto, bfloat16, float16 or float32")
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
    except (ValueError, RuntimeError, KeyError) as e:
        raise MergeError(f"adapter {str(adapter_dir)!r} does not fit base {str(base_dir)!r}: "
                         f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
    _check_all_loaded(peft_model, adapter_dir, base_dir)
    recorded = conf.get("base_model_name_or_path")
    if recorded and Path(recorded).exists() and Path(recorded).resolve() != base_dir.resolve():
        warnings.warn(f"adapter {str(adapter_dir)!r} records base {recorded!r} but is merged into {str(base_dir)!r}; "
                      "the shapes fit, the weights may not be the ones it was trained on", stacklevel=2)
    merged = peft_model.merge_and_unload().to(getattr(torch, out_dtype))
    tok_dir = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_dir
    record = {"base": str(base_dir), "adapter": str(adapter_dir), "dtype": out_dtype, "tokenizer_from": str(tok_dir),
              "lora_r": conf.get("r"), "lora_alpha": conf.get("lora_alpha"),
              "target_modules": sorted(conf.get("target_modules") or [])}
    return merged, load_tokenizer(str(tok_dir)), record


def merge_adapter(base_dir: Path, adapter: str, out: str, *, dtype: str = "auto") -> Path:
    """Merge ``adapter`` into the model at ``base_dir`` and save a plain HF model + tokenizer to ``out`` (new or empty) atomically."""
    out_path = Path(out).expanduser()
    try:
        refuse_existing_output(out_path, "--out")
    except FileExistsError as e:
        raise MergeError(str(e)) from None
    merged, tokenizer, record = load_merged(base_dir, adapter, dtype=dtype)
    with atomic_output_dir(out_path, "--out") as tmp:
        merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "parityrl_merge.json").write_text(json.dumps(record, indent=2) + "\n")
    return out_path


def describe(out: Path, record: Optional[dict] = None) -> str:
    record = record or json.loads((Path(out) / "parityrl_merge.json").read_text())
    return (f"merged {record['adapter']} (LoRA r={record['lora_r']}) into {record['base']} -> {out} "
            f"({record['dtype']})")
