"""The trained policy: loading (HF + PEFT LoRA) and its log-probs of completion tokens.

The log-probs come from the backbone's last hidden states through
``parity.fused_logprobs`` (chunked lm_head + log-softmax): the full
[tokens x vocab] logits are never materialised, and the same pass feeds both
the loss and the parity metrics.
"""
from __future__ import annotations

from typing import Optional

import torch

from parity.logprobs import fused_gather_logprobs, fused_logprobs
from trainer.models.batch import TokenBatch
from trainer.config import LoraConfig
from trainer.models.architecture import split_model

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token_id is None:
        # Padding never reaches the loss (masked) nor attention (attention_mask), so any
        # id works; EOS is the conventional choice.
        tok.pad_token = tok.eos_token
    return tok


def load_base_model(model_dir: str, dtype: str, device: torch.device | str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
    return model.to(device)


def add_lora(model, lora: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in lora.target_modules if m not in present]
    if missing:
        raise ValueError(f"model.lora.target_modules: {missing} not found in the model; "
                         f"linear layers it has: {sorted(n for n in present if 'proj' in n or 'fc' in n)}")
    cfg = PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules),
                         task_type="CAUSAL_LM")
    # PEFT keeps the adapter weights in float32 (autocast_adapter_dtype) while the base
    # stays in the model dtype: small updates are not rounded away in bf16.
    return get_peft_model(model, cfg)


def completion_hidden(model, batch: TokenBatch, value_head=None):
    """(hidden [S, C, H] of the positions that predict the completion tokens, lm_head Linear, values [S, C] or None).

    ``model``: a (PEFT) causal LM, or a DeepSpeed engine around
    ``trainer.distributed.deepspeed.PolicyForward``, then called as a whole (the engine's forward
    does bookkeeping its backward needs: see ``PolicyForward``). Under ZeRO-3 the
    lm_head returned holds gathered copies of its weights (``full_lm_head``): it is read
    directly, never called, so ZeRO-3's per-module hooks would leave it partitioned.
    ``value_head``: PPO's critic, read at the same positions; inside a DeepSpeed engine it
    must be the one ``PolicyForward`` holds (the engine's forward computes the values).
    """
    from trainer.distributed.deepspeed import full_lm_head, wrapped_policy_forward

    wrapped = wrapped_policy_forward(model)
    if wrapped is not None:
        if value_head is not None and value_head is not wrapped.value_head:
            raise ValueError("completion_hidden: this value head is not the one inside the DeepSpeed engine "
                             "(pass it to trainer.distributed.deepspeed.wrap_for_prepare)")
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
        hidden, values = out if wrapped.value_head is not None else (out, None)
        _, lm_head = split_model(wrapped.policy)
    else:
        backbone, lm_head = split_model(model)
        hidden = backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                          position_ids=batch.position_ids, use_cache=False).last_hidden_state
        # On every position, as the engine's forward does: the same GEMM shape, so both give the same bits.
        values = None if value_head is None else value_head(hidden)
    p, c = batch.prompt_len, batch.targets.shape[1]
    values = None if value_head is None else values[:, p - 1:p - 1 + c]
    return hidden[:, p - 1:p - 1 + c], full_lm_head(lm_head), values


def completion_logprobs(model, batch: TokenBatch, *, temperature: float, chunk_size: Optional[int] = None,
                        return_entropy: bool = False, topk_ids: Optional[torch.Tensor] = None):
    """Log-probs [S, C] (float32) of the batch's completion tokens under softmax(logits / temperature).

    Gradients flow to the trainable parameters when grad is enabled. Returns
    (logprobs, entropy or None); with ``topk_ids`` [S, C, k] also, third, the
    (gradient-free) log-probs of those ids from the same forward pass.
    """
    hidden, lm_head, _ = completion_hidden(model, batch)
    return logprobs_from_hidden(hidden, lm_head, batch, temperature=temperature, chunk_size=chunk_size,
                                return_entropy=return_entropy, topk_ids=topk_ids)


def logprobs_from_hidden(hidden, lm_head, batch: TokenBatch, *, temperature: float, chunk_size: Optional[int] = None,
                         return_entropy: bool = False, topk_ids: Optional[torch.Tensor] = None):
    """``completion_logprobs`` from already computed ``completion_hidden`` (same returns)."""
    lp, ent = fused_logprobs(hidden, lm_head.weight, batch.targets, bias=lm_head.bias, temperature=temperature,
                             return_entropy=return_entropy, chunk_size=chunk_size)
    if topk_ids is None:
        return lp, ent
    top = fused_gather_logprobs(hidden.detach(), lm_head.weight.detach(), topk_ids, temperature=temperature,
                                bias=None if lm_head.bias is None else lm_head.bias.detach(), chunk_size=chunk_size)
    return lp, ent, top
