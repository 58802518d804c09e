"""What parityrl needs to know about a causal LM's structure, read from the model itself."""
from __future__ import annotations

from parity.logprobs import fused_gather_logprobs
from rollout.hf_engine import attention_implementation  # noqa: F401  (the HF engine loads models the same way)
from trainer.config.schema import RecipeError


def split_model(model):
    """(backbone returning last hidden states, lm_head Linear) of a causal LM, PEFT-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(base, base.base_model_prefix, None)
    lm_head = base.get_output_embeddings()
    if backbone is None or lm_head is None:
        raise TypeError(f"{type(base).__name__}: cannot find the backbone ({base.base_model_prefix!r}) and lm_head; "
                        "parityrl needs a *ForCausalLM model")
    return backbone, lm_head


# PEFT's spelling of "every linear layer" (peft.utils.constants.INCLUDE_LINEAR_LAYERS_SHORTHAND).
ALL_LINEAR = "all-linear"
# MoE routers and gates: linear layers whose outputs pick experts (Mixtral's ``gate``, Qwen2-MoE's
# ``shared_expert_gate``, ``router`` elsewhere). A LoRA there changes which experts run, a
# discrete decision the engine recomputes from the merged weight, and their few output
# columns (num_experts, or 1) leave nothing for a rank-r update to learn: never a default target.
ROUTER_LEAVES = ("gate", "router", "shared_expert_gate")
# vLLM's LogitsProcessor gets these from the same config keys (gemma2.py, commandr.py, granite.py).
_SOFTCAP_KEYS = ("final_logit_softcapping",)


def text_config(config):
    """The decoder's config (multimodal configs nest it as ``text_config``)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def logit_transform(config) -> dict:
    """``{"logit_softcap": cap or None, "logit_scale": s}``: the model's own post-processing of lm_head's output.

    Gemma2/3: ``final_logit_softcapping`` (cap * tanh(z / cap)); Cohere/Cohere2:
    ``logit_scale`` (multiply); Granite: ``logits_scaling`` (divide). These are the keys
    vLLM's model classes hand to ``LogitsProcessor`` (soft_cap, scale), and the keys the
    Transformers ``*ForCausalLM.forward`` of those families read. ``parity.logprobs``
    applies them; it does not read configs.
    """
    c = text_config(config)
    cap = None
    for key in _SOFTCAP_KEYS:
        if getattr(c, key, None):
            cap = float(getattr(c, key))
    scale = 1.0
    if getattr(c, "logit_scale", None) not in (None, 1.0) and isinstance(c.logit_scale, (int, float)):
        scale *= float(c.logit_scale)
    if getattr(c, "logits_scaling", None) not in (None, 1.0):
        scale /= float(c.logits_scaling)
    return {"logit_softcap": cap, "logit_scale": scale}


# Where a vision-language model's backbone holds its language model (Idefics3 / SmolVLM: text_model; Qwen-VL, Llava,
# Gemma3 in Transformers 5: language_model): its decoder blocks are the ones LoRA adapts and routing replay reads.
LANGUAGE_MODELS = ("text_model", "language_model")


def decoder_depth(config, default: int | None = None) -> int:
    """The language model's number of decoder layers: a causal LM's ``num_hidden_layers``, a vision-language model's
    text config's (its own config holds none: Idefics3's sits in ``text_config``). ``default`` where neither says."""
    depth = getattr(config.get_text_config(), "num_hidden_layers", None)
    if depth is None:
        if default is None:
            raise AttributeError(f"{type(config).__name__}: no num_hidden_layers in the config or its text config")
        return default
    return int(depth)


def is_vision_language(model) -> bool:
    """Whether ``model`` (PEFT-wrapped or not) holds its decoder under a language model beside a vision tower."""
    prefix, _ = decoder_layers(model)
    return prefix.count(".") > 1


def decoder_layers(model):
    """(name under the HF root, ModuleList of decoder layers) of a causal LM, PEFT-wrapped or not."""
    from torch import nn

    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    prefix = getattr(root, "base_model_prefix", "model")
    backbone = getattr(root, prefix, None)
    for inner in ("", *LANGUAGE_MODELS):  # a causal LM's blocks, or a vision-language model's language model's
        holder = getattr(backbone, inner, None) if inner else backbone
        layers = getattr(holder, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return f"{prefix}.{inner + '.' if inner else ''}layers", layers
    raise TypeError(f"{type(root).__name__}: no decoder layers at .{prefix}.layers; parityrl supports "
                    "*ForCausalLM models whose decoder blocks are <prefix>.layers")


def decoder_linear_leaves(model) -> list[str]:
    """Sorted leaf names of the ``nn.Linear`` layers inside the decoder blocks, MoE routers excluded.

    What ``all-linear`` means here: like PEFT's shorthand (every Linear but the output
    layer), restricted to the decoder blocks (so no lm_head, no vision tower, no MTP head)
    and without routers (``ROUTER_LEAVES``). MoE routed experts are not Linear modules in
    Transformers 5 (fused 3-D parameters) and so are never among them: ``frozen_expert_params``.
    """
    from torch import nn

    _, layers = decoder_layers(model)
    # A PEFT-wrapped model: a LoRA layer holds the base Linear as ``base_layer`` and its
    # adapters' Linears under ``lora_A``/``lora_B``; the targeted name is the LoRA layer's.
    leaves = {name.rsplit(".", 1)[-1] for name, m in layers.named_modules()
              if (isinstance(m, nn.Linear) or hasattr(m, "base_layer")) and ".lora_" not in f".{name}"}
    leaves -= {"base_layer"} | set(ROUTER_LEAVES)
    return sorted(leaves)


def frozen_expert_params(model) -> list[str]:
    """Names of the decoder's parameters with more than 2 dims: MoE experts fused per layer (frozen under LoRA)."""
    prefix, layers = decoder_layers(model)
    return [f"{prefix}.{n}" for n, p in layers.named_parameters() if p.dim() > 2]


def resolve_lora_targets(model, targets) -> list[str]:
    """``model.lora.target_modules`` as the leaf names to wrap; ``["all-linear"]`` is ``decoder_linear_leaves``.

    Refuses (ValueError naming the key) a name the model does not have, and LoRA on the
    input embedding of a model with tied embeddings: PEFT adapts ``embed_tokens`` only,
    so the lm_head (the same tensor W) stays W while the input embedding becomes
    W + sBA, and a merge writes the tied pair as one tensor -- the engine and the
    trainer would run different models.
    """
    targets = list(targets)
    if targets == [ALL_LINEAR]:
        resolved = decoder_linear_leaves(model)
    else:
        if ALL_LINEAR in targets:
            raise RecipeError(f"model.lora.target_modules = {targets!r}: {ALL_LINEAR!r} must be the only entry")
        present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        missing = [m for m in targets if m not in present]
        if missing:
            raise RecipeError(f"model.lora.target_modules: {missing} not found in the model; linear layers of its "
                             f"decoder blocks: {decoder_linear_leaves(model)} (or {ALL_LINEAR!r})")
        resolved = targets
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    embed = root.get_input_embeddings()
    tied = bool(getattr(text_config(root.config), "tie_word_embeddings", False))
    embed_names = {n.rsplit(".", 1)[-1] for n, m in root.named_modules() if m is embed}
    if tied and embed_names & set(resolved):
        raise RecipeError(f"model.lora.target_modules = {targets!r}: LoRA on {sorted(embed_names & set(resolved))} "
                         "of a model with tie_word_embeddings=true is not supported: PEFT adapts the input embedding only, "
                         "the tied lm_head keeps the base weight, and a merge cannot write two values for one tensor")
    return resolved


def logit_parity_error(model, n_tokens: int = 8) -> float:
    """E_p |log_softmax difference| between the fused kernel (with ``logit_transform``) and the model's own forward.

    A probe on ``n_tokens`` fixed token ids, run once at load: an architecture whose
    ``forward`` post-processes the logits in a way ``logit_transform`` does not know shows
    up here as a large error instead of as silently wrong training log-probs.
    """
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    vocab = base.get_output_embeddings().weight.shape[0]
    ids = (torch.arange(n_tokens) * 7919 % vocab).unsqueeze(0).to(base.device)
    backbone, lm_head = split_model(base)
    with torch.no_grad():
        own = torch.log_softmax(base(input_ids=ids, use_cache=False).logits.float(), dim=-1)[0]
        hidden = backbone(input_ids=ids, use_cache=False).last_hidden_state[0]
        every = torch.arange(vocab, device=hidden.device).expand(n_tokens, vocab)
        ours = fused_gather_logprobs(hidden, lm_head.weight, every, bias=lm_head.bias, **logit_transform(base.config))
    # Weighted by the model's own probabilities: a bf16 forward rounds the transformed logits
    # (Gemma2's cap*tanh near the cap: half a bf16 ulp of 30 is 0.06), which moves the unlikely
    # tail most, while a dropped or unknown transform moves the likely tokens.
    return float((own.exp() * (ours - own).abs()).sum(-1).mean())
