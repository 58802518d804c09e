"""The update forward differentiates the entropy only when the loss uses it (trainer.measurement.scoring.forward).

A logged entropy is computed in the same kernel pass without a gradient, so the backward keeps
the frozen-lm_head shortcut (parity.fused_logprobs); the log-probs and their gradients are the
same either way.
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.config.schema import LoraConfig
from trainer.measurement.scoring import forward
from trainer.models.batch import build_token_batch
from trainer.models.policy import add_lora


def _policy():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # std 0.2: outputs far from uniform, so entropy and its gradient are not trivial
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model = add_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.2)
    return model


def _grads(model, entropy_grad):
    model.zero_grad()
    batch = build_token_batch([[5, 6, 7], [8, 9]], [[1, 2, 3], [4, 10]], pad_id=0)
    lp, ent, _, _, _, _ = forward(model, batch, temperature=0.7, entropy_grad=entropy_grad)
    (lp * batch.mask).sum().backward()
    return lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_logged_entropy_has_no_gradient_and_changes_nothing_else():
    model = _policy()
    lp_log, ent_log, g_log = _grads(model, entropy_grad=False)
    lp_diff, ent_diff, g_diff = _grads(model, entropy_grad=True)
    assert not ent_log.requires_grad and ent_diff.requires_grad
    assert torch.equal(lp_log, lp_diff) and torch.allclose(ent_log, ent_diff.detach(), rtol=0, atol=1e-6)
    assert ent_log.abs().sum() > 0
    for n in g_log:
        assert torch.allclose(g_log[n], g_diff[n], rtol=1e-5, atol=1e-7), n
    # with entropy_grad the entropy's own gradient reaches the adapter
    model.zero_grad()
    batch = build_token_batch([[5, 6, 7]], [[1, 2, 3]], pad_id=0)
    _, ent, _, _, _, _ = forward(model, batch, temperature=0.7, entropy_grad=True)
    (ent * batch.mask).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)
