"""The trained policy: loading (HF + PEFT LoRA) and its log-probs of completion tokens.

The log-probs come from the backbone's last hidden states through
``parity.fused_logprobs`` (chunked lm_head + log-softmax): the full
[tokens x vocab] logits are never materialised, and the same pass feeds both
the loss and the parity metrics.
"""
from __future__ import annotations

import math
import os
import re
from typing import Optional

import torch

from parity.logprobs import fused_gather_logprobs, fused_logprobs
from trainer.config import LoraConfig
from trainer.config.schema import RecipeError
from trainer.distributed.deepspeed import full_lm_head
from trainer.models.architecture import (
    decoder_layers,
    frozen_expert_params,
    is_vision_language,
    logit_parity_error,
    logit_transform,
    resolve_lora_targets,
    split_model,
)
from trainer.models.attention import attn_kwargs
from trainer.models.batch import TokenBatch
from trainer.models.packing import pack, packing_error, unpack
from trainer.models.policy_forward import wrapped_policy_forward
from trainer.models.routing_replay import attached_replay
from trainer.vision.embeddings import merged_embeddings
from trainer.vision.support import auto_model_class

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token_id is None:
        # Padding never reaches the loss (masked) nor attention (attention_mask), so any
        # id works; EOS is the conventional choice.
        tok.pad_token = tok.eos_token
    return tok


# Largest error of the load-time probe (``logit_parity_error``, E_p|d log-prob|) per dtype.
# float32: both sides compute the same function (measured <= 4e-7 on the architecture matrix);
# bf16/fp16: the model's forward rounds its logit transform in that dtype, the kernel does it in
# float32 (Gemma2 matrix model: 0.009). Its softcap dropped: 0.066 in both dtypes.
LOGIT_PROBE_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.03, "float16": 0.03}

# The attention implementations whose mask transformers builds from packed position ids for a batch of
# several rows (trainer/models/packing.py); flash attention detects packing in a one-row batch only.
PACKING_ATTENTION = ("sdpa", "eager")
# Largest |hidden difference| packed vs padded (``packing_error``), measured on CPU: float32 <= 2.1e-6
# on the architecture matrix, bf16 and fp16 0 (tiny, qwen2, gemma2, qwen2_moe); other kernels may round
# other shapes differently by a few ulps of these O(1) values. Sequences that attend across: ~4.
PACKING_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1, "float16": 0.05}


def load_base_model(model_dir: str, dtype: str, device: torch.device | str = "cpu",
                    attn_implementation: Optional[str] = None, *, train_device: torch.device | str | None = None,
                    pack_sequences: bool = False):
    """The causal LM, with the attention implementation that computes what the model defines.

    ``attn_implementation``: the recipe's ``model.attn_implementation`` (trainer.models.attention: null =
    what the architecture needs, else Transformers' default), checked for ``train_device`` (where the
    model trains, when it loads elsewhere first; default ``device``) before the weights load.
    Refuses (ValueError) a model whose own forward's log-probs the fused kernel does not
    reproduce (an unknown logit post-processing): training it would optimise another function.
    ``pack_sequences`` (``train.pack_sequences``): also refuses a model whose forward does not keep
    packed sequences apart (``check_packing``).
    """
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    kwargs = attn_kwargs(config, attn_implementation, dtype=dtype,
                         device=device if train_device is None else train_device)
    auto = auto_model_class(config.model_type)  # a vision-language model's own class (trainer.vision.support)
    model = auto.from_pretrained(model_dir, dtype=DTYPES[dtype], **kwargs).to(device)
    err = logit_parity_error(model)
    if not err <= LOGIT_PROBE_TOLERANCE[dtype]:
        raise RecipeError(f"model.path = {model_dir!r}: {type(model).__name__}'s own forward gives log-probs "
                         f"{err:.3g} (probability-weighted mean abs) away from lm_head + log-softmax with the "
                         f"logit transform parityrl knows ({logit_transform(model.config)}); expected <= "
                         f"{LOGIT_PROBE_TOLERANCE[dtype]}: "
                         "its logit post-processing is not supported")
    if pack_sequences:
        if auto is AutoModelForImageTextToText:
            raise RecipeError(f"train.pack_sequences = true: {type(model).__name__} is a vision-language model, whose "
                              "images are placed by prompt; set train.pack_sequences = false")
        check_packing(model, dtype)
    return model


def check_packing(model, dtype: str) -> None:
    """Raise RecipeError unless packed rows give this model the hidden states of padded rows."""
    attn = getattr(model.config, "_attn_implementation", None)
    name = type(model).__name__
    if attn not in PACKING_ATTENTION:
        raise RecipeError(f"train.pack_sequences = true: {name} runs attention implementation {attn!r}; packing "
                          f"needs one of {PACKING_ATTENTION} (transformers' flash-attention path detects packed "
                          "sequences only in a batch of one row); set train.pack_sequences = false")
    backbone, _ = split_model(model)
    err = packing_error(backbone, vocab_size=model.config.vocab_size)
    if not err <= PACKING_TOLERANCE[dtype]:
        raise RecipeError(f"train.pack_sequences = true: {name} ({attn}) gives packed sequences hidden states "
                          f"{err:.3g} away from the same sequences padded (expected <= {PACKING_TOLERANCE[dtype]}): "
                          "its forward lets packed sequences attend to each other; set train.pack_sequences = false")


def add_lora(model, lora: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    targets = resolve_lora_targets(model, lora.target_modules)
    experts = frozen_expert_params(model)
    if os.environ.get("RANK", "0") == "0":  # a run-wide line: every rank adapts the same layers, the main one says so
        print(f"LoRA targets ({type(model).__name__}): {', '.join(targets)}"
              + (f"; {len(experts)} fused MoE expert tensors stay frozen (e.g. {experts[0]})" if experts else ""),
              flush=True)
    modules = targets
    if is_vision_language(model):
        # the language model's blocks only: the leaf names alone would also match the vision tower's projections
        # (SigLIP's q_proj / k_proj / v_proj), which stay frozen; PEFT full-matches a string against module names
        prefix, _ = decoder_layers(model)
        modules = rf"{re.escape(prefix)}\.\d+\.(.*\.)?({'|'.join(map(re.escape, targets))})"
    cfg = PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=modules,
                         task_type="CAUSAL_LM")
    # PEFT keeps the adapter weights in float32 (autocast_adapter_dtype) while the base
    # stays in the model dtype: small updates are not rounded away in bf16.
    return get_peft_model(model, cfg)


def completion_hidden(model, batch: TokenBatch, value_head=None, *, pack_sequences: bool = False):
    """(hidden [S, C, H] of the positions that predict the completion tokens, lm_head Linear, values [S, C] or None).

    ``pack_sequences``: the backbone runs on the batch's sequences packed into fewer rows
    (``trainer.models.packing``; the model was checked at load, ``check_packing``); the
    outputs are the same [S, C] tensors as without it.

    ``model``: a (PEFT) causal LM, or a DeepSpeed engine around
    ``trainer.models.policy_forward.PolicyForward``, then called as a whole (the engine's forward
    does bookkeeping its backward needs: see ``PolicyForward``). Under ZeRO-3 the
    lm_head returned holds gathered copies of its weights (``full_lm_head``): it is read
    directly, never called, so ZeRO-3's per-module hooks would leave it partitioned.
    ``value_head``: PPO's critic, read at the same positions; inside a DeepSpeed engine it
    must be the one ``PolicyForward`` holds (the engine's forward computes the values).
    """
    wrapped = wrapped_policy_forward(model)
    packed = pack(batch) if pack_sequences else None
    # The engine's routes, laid out as the inputs, where the run replays or measures them (a RoutingReplay is
    # installed: trainer.rl.loop checks that the engine returned them); a batch without routes: the routers' own.
    replay = attached_replay(model)
    if replay is not None:
        replay.set_routes(None if batch.routes is None else batch.routes if packed is None else packed.routes)
    # Packed rows carry no attention mask: transformers reads the sequence boundaries from the position ids.
    inputs = (dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
              if packed is None else
              dict(input_ids=packed.input_ids, attention_mask=None, position_ids=packed.position_ids))
    if wrapped is not None:
        if batch.vision is not None:
            raise ValueError("completion_hidden: a vision-language batch under DeepSpeed is not supported")
        if value_head is not None and value_head is not wrapped.value_head:
            raise ValueError("completion_hidden: this value head is not the one inside the DeepSpeed engine "
                             "(pass it to trainer.models.policy_forward.wrap_for_prepare)")
        out = model(**inputs)
        hidden, values = out if wrapped.value_head is not None else (out, None)
        _, lm_head = split_model(wrapped.policy)
    else:
        backbone, lm_head = split_model(model)
        if batch.vision is not None:  # the images' features at the prompt's placeholders (trainer.vision.embeddings)
            if packed is not None:
                raise ValueError("completion_hidden: packing a vision-language batch is not supported")
            inputs["inputs_embeds"] = merged_embeddings(backbone, inputs.pop("input_ids"), batch.prompt_len,
                                                        batch.vision)
        hidden = backbone(**inputs, use_cache=False).last_hidden_state
        # On every position, as the engine's forward does: the same GEMM shape, so both give the same bits.
        values = None if value_head is None else value_head(hidden)
    config = (wrapped.policy if wrapped is not None else model).config
    head = LogitHead(full_lm_head(lm_head), config)
    if packed is not None:
        return unpack(hidden, packed), head, None if values is None else unpack(values, packed)
    p, c = batch.prompt_len, batch.targets.shape[1]
    values = None if value_head is None else values[:, p - 1:p - 1 + c]
    return hidden[:, p - 1:p - 1 + c], head, values


class LogitHead:
    """What the fused kernel reads of the output layer: lm_head's weight and bias, and the model's logit transform."""

    def __init__(self, lm_head, config) -> None:
        self.weight, self.bias = lm_head.weight, lm_head.bias
        self.transform = logit_transform(config)


def in_sets(ids: torch.Tensor, support: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """bool like ``ids`` [S, C, k]: whether each id is in its position's kept set (``support``: offsets over the
    [S, C] grid, each position's ids ascending, as every engine reports them)."""
    offsets, kept = support
    positions = ids.shape[0] * ids.shape[1]
    sizes = offsets[1:] - offsets[:-1]
    vocab = int(max(int(ids.max()) if ids.numel() else 0, int(kept.max()) if kept.numel() else 0)) + 1
    pos = torch.repeat_interleave(torch.arange(positions, device=kept.device), sizes)
    keys = pos * vocab + kept.long()  # ascending: positions in order, ids ascending within one
    query = torch.arange(positions, device=ids.device).repeat_interleave(ids.shape[2]) * vocab + ids.reshape(-1)
    at = torch.searchsorted(keys, query).clamp(max=max(keys.numel() - 1, 0))
    hit = keys[at] == query if keys.numel() else torch.zeros_like(query, dtype=torch.bool)
    return hit.reshape(ids.shape)


def completion_logprobs(model, batch: TokenBatch, *, temperature: float, chunk_size: Optional[int] = None,
                        return_entropy: bool = False, entropy_grad: bool = True,
                        topk_ids: Optional[torch.Tensor] = None, pack_sequences: bool = False):
    """Log-probs [S, C] (float32) of the batch's completion tokens under softmax(logits / temperature).

    Gradients flow to the trainable parameters when grad is enabled. Returns
    (logprobs, entropy or None); ``entropy_grad`` False: the entropy carries no gradient (only
    logged), so the backward stays the cheap one (``parity.fused_logprobs``). With ``topk_ids`` [S, C, k] also, third, the
    (gradient-free) log-probs of those ids from the same forward pass.
    """
    hidden, lm_head, _ = completion_hidden(model, batch, pack_sequences=pack_sequences)
    return logprobs_from_hidden(hidden, lm_head, batch, temperature=temperature, chunk_size=chunk_size,
                                return_entropy=return_entropy, entropy_grad=entropy_grad, topk_ids=topk_ids)


def logprobs_from_hidden(hidden, lm_head, batch: TokenBatch, *, temperature: float, chunk_size: Optional[int] = None,
                         return_entropy: bool = False, entropy_grad: bool = True,
                         topk_ids: Optional[torch.Tensor] = None, return_kept: bool = False):
    """``completion_logprobs`` from already computed ``completion_hidden`` (same returns; with ``return_kept`` also,
    last, the log of the full softmax's mass inside each position's kept set, 0 without truncation).

    With a truncated sampler's kept sets on the batch (``TokenBatch.support``) every log-prob is normalised over the
    set the engine sampled from (``parity.fused_logprobs``'s ``support``), the entropy is the truncated
    distribution's, and the top-k ids' log-probs are too (-inf for an id outside the set, as the engine reports it).
    """
    xf = getattr(lm_head, "transform", {})  # a bare Linear: no transform
    support = batch.kernel_support()
    lp, ent, kept = fused_logprobs(hidden, lm_head.weight, batch.targets, bias=lm_head.bias, temperature=temperature,
                                   return_entropy=return_entropy, entropy_grad=entropy_grad, chunk_size=chunk_size,
                                   support=support, return_kept_logmass=True, **xf)
    out = (lp, ent)
    if topk_ids is not None:
        top = fused_gather_logprobs(hidden.detach(), lm_head.weight.detach(), topk_ids, temperature=temperature,
                                    bias=None if lm_head.bias is None else lm_head.bias.detach(), chunk_size=chunk_size,
                                    **xf)
        if support is not None:
            top = (top - kept.unsqueeze(-1)).masked_fill(~in_sets(topk_ids, support), -math.inf)
        out += (top,)
    return out + (kept,) if return_kept else out
