"""What parityrl needs to know about a causal LM's structure, read from the model itself."""
from __future__ import annotations


def split_model(model):
    """(backbone returning last hidden states, lm_head Linear) of a causal LM, PEFT-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(base, base.base_model_prefix, None)
    lm_head = base.get_output_embeddings()
    if backbone is None or lm_head is None:
        raise TypeError(f"{type(base).__name__}: cannot find the backbone ({base.base_model_prefix!r}) and lm_head; "
                        "parityrl needs a *ForCausalLM model")
    return backbone, lm_head
