"""trainer.models.precision: the decoder's linear layers run parity.precision.fp8_linear (fp8_unified, trainer side).

A small random Llama (hidden 192: one full and one partial 128-block per row; 3 KV heads x 32 = 96
rows for k/v) built in memory, BF16 like the trainer.
"""
import copy

import pytest
import torch
from torch import nn

from parity.precision import fake_quant_act, fake_quant_weight
from trainer.models.precision import FP8_TARGETS, Fp8Linear, convert_to_fp8, is_fp8_module, lora_merged_weight


def small_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=192, intermediate_size=320, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=3, head_dim=32, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def with_lora(model, targets=("q_proj", "v_proj", "down_proj"), dropout=0.0, seed=1):
    import peft

    policy = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                        target_modules=list(targets)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:  # PEFT starts B at 0; a trained adapter is not
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return policy


def ids(seed=0, shape=(2, 11)):
    return torch.randint(0, 300, shape, generator=torch.Generator().manual_seed(seed))


class _ManualFakeQuant(nn.Module):
    """Reference: F.linear(fake_quant_act(x), fake_quant_weight(W)) spelled out with a plain Linear."""

    def __init__(self, lin):
        super().__init__()
        self.lin = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, dtype=lin.weight.dtype)
        with torch.no_grad():
            self.lin.weight.copy_(fake_quant_weight(lin.weight))
            if lin.bias is not None:
                self.lin.bias.copy_(lin.bias)

    def forward(self, x):
        return self.lin(fake_quant_act(x))


def test_converted_model_is_the_manual_fake_quant_model():
    model = small_llama()
    ref = copy.deepcopy(model)
    names = convert_to_fp8(model)
    assert len(names) == 2 * 7 and names[0] == "model.layers.0.self_attn.q_proj"
    for n in names:
        parent, leaf = n.rsplit(".", 1)
        setattr(ref.get_submodule(parent), leaf, _ManualFakeQuant(ref.get_submodule(n)))
    x = ids()
    with torch.no_grad():
        got, want = model(x).logits, ref(x).logits
        plain = small_llama()(x).logits
    assert torch.equal(got, want)
    assert (got.float() - plain.float()).abs().max() > 1e-3  # the quantization is visible in the logits
    # lm_head, embeddings and norms are untouched
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert not any(is_fp8_module(m) for n, m in model.named_modules() if "norm" in n or n == "lm_head")
    # same parameters and state dict as before
    assert model.state_dict().keys() == small_llama().state_dict().keys()


def test_lora_forward_equals_the_merged_weights_the_engine_receives():
    from rollout.weight_export import merged_lora_weights

    policy = with_lora(small_llama())
    convert_to_fp8(policy)
    merged = dict(merged_lora_weights(policy, dtype=torch.bfloat16))
    # The trainer's merged weight is bitwise the exported one.
    for name, module in policy.get_base_model().named_modules():
        if is_fp8_module(module) and hasattr(module, "lora_A"):
            assert torch.equal(lora_merged_weight(module).detach().to(torch.bfloat16), merged[f"{name}.weight"])
    # An unwrapped model holding the merged weights, converted, gives the same logits as the LoRA model.
    engine_like = small_llama()
    engine_like.load_state_dict(merged, strict=False)
    convert_to_fp8(engine_like)
    x = ids(1)
    with torch.no_grad():
        lora_logits, merged_logits = policy(x).logits, engine_like(x).logits
    assert torch.equal(lora_logits, merged_logits)
    assert policy.get_base_model().lm_head.__class__ is nn.Linear


def test_gradients_reach_lora_through_the_straight_through_quantizers():
    policy = with_lora(small_llama())
    convert_to_fp8(policy)
    policy.train()
    out = policy(ids(2), labels=ids(2)).loss
    out.backward()
    lora = {n: p for n, p in policy.named_parameters() if "lora_" in n}
    assert lora and all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
                        for p in lora.values())
    assert all(p.grad is None for n, p in policy.named_parameters() if "lora_" not in n)  # frozen base


def test_lora_gradient_is_the_chain_rule_through_the_merged_weight():
    """dL/dW' = g^T Q(x) (STE), dL/dA = s B^T dL/dW', dL/dB = s dL/dW' A^T: checked on one layer."""
    policy = with_lora(small_llama(), targets=("q_proj",))
    convert_to_fp8(policy)
    layer = policy.get_base_model().model.layers[0].self_attn.q_proj
    a, b, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 192, generator=g).bfloat16()
    up = torch.randn(5, 192, generator=g).bfloat16()
    (layer(x) * up).sum().backward()
    # dL/dW' with the quantizers as identity; a BF16 GEMM like the layer's backward, then float32 like A and B.
    gw = (up.t() @ fake_quant_act(x)).float()
    for got, want in ((a.grad, s * b.detach().t() @ gw), (b.grad, s * gw @ a.detach().t())):
        assert ((got - want).norm() / want.norm()).item() < 1e-3
    # Without the STE through the activation quantizer (raw x instead of Q(x)) the gradient is measurably off.
    gw_raw = (up.t() @ x).float()
    assert ((a.grad - s * b.detach().t() @ gw_raw).norm() / a.grad.norm()).item() > 1e-2


def test_convert_refuses_what_it_cannot_run_and_is_idempotent():
    with pytest.raises(ValueError, match="dropout"):
        convert_to_fp8(with_lora(small_llama(), dropout=0.1))
    with pytest.raises(ValueError, match=r"\['w1'\] not found"):
        convert_to_fp8(small_llama(), targets=("q_proj", "w1"))
    with pytest.raises(ValueError, match="backend"):
        convert_to_fp8(small_llama(), backend="int8")
    with pytest.raises(TypeError, match="decoder layers"):
        convert_to_fp8(nn.Sequential(nn.Linear(2, 2)))
    model = small_llama()
    first = convert_to_fp8(model)
    assert convert_to_fp8(model) == first
    assert all(type(model.get_submodule(n)) is Fp8Linear for n in first)
    # Converting a plain model, then wrapping it with LoRA, then converting again: the LoRA layer is
    # converted as a whole (merged weight), not "quantized base + BF16 side branch".
    policy = with_lora(model)
    convert_to_fp8(policy)
    q = policy.get_base_model().model.layers[0].self_attn.q_proj
    assert is_fp8_module(q) and hasattr(q, "lora_A")
    assert set(FP8_TARGETS) == {n.rsplit(".", 1)[-1] for n in first}


# ---- the FP8-GEMM backend ("scaled_mm") on CPU: its GEMM swapped for an emulation of it ------------
def _emulated_gemm(xq, sa, fw, m, dtype, bias):
    """What cuBLAS's block-scaled GEMM computes, in the emulation's order: deq(codes) @ deq(W codes)^T."""
    import torch.nn.functional as F

    from parity.precision import dequantize_act_groups

    x = dequantize_act_groups(xq[:m, : fw.k], sa[:m, : -(-fw.k // 128)], dtype)
    return F.linear(x, fw.dequantize(dtype), None if bias is None else bias.to(dtype))


def _to_gemm_backend(model):
    for m in model.modules():
        if is_fp8_module(m):
            m.fp8_backend = "scaled_mm"


def _caches(model):
    return {n: m.__dict__["_fp8_cache"] for n, m in model.named_modules() if "_fp8_cache" in m.__dict__}


def test_gemm_backend_forward_and_backward_equal_the_emulated_path(monkeypatch):
    import parity.fp8_gemm as fg

    monkeypatch.setattr(fg, "_GEMM", _emulated_gemm)
    ref = with_lora(small_llama())
    convert_to_fp8(ref)
    got = copy.deepcopy(ref)
    _to_gemm_backend(got)
    ref.train(), got.train()
    x = ids(4)
    out_ref, out_got = ref(x, labels=x), got(x, labels=x)
    assert torch.equal(out_ref.logits, out_got.logits)  # same FP8 codes and scales: bitwise
    out_ref.loss.backward()
    out_got.loss.backward()
    grads_ref = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    grads_got = {n: p.grad for n, p in got.named_parameters() if p.requires_grad}
    assert grads_ref.keys() == grads_got.keys() and grads_ref
    for n in grads_ref:
        if "lora_" in n:
            # The GEMM backend takes the adapters' STE gradients through the rank, the emulated one
            # through the [N, K] weight gradient: the same quantity, rounded differently in BF16
            # (tests/parity/test_fp8_gemm.py pins both against float64). Everything else: bitwise.
            err = ((grads_got[n] - grads_ref[n]).norm() / grads_ref[n].norm()).item()
            assert err < 1e-2, (n, err)
        else:
            assert torch.equal(grads_ref[n], grads_got[n]), n


def test_weights_are_quantized_once_per_optimizer_step(monkeypatch):
    import parity.fp8_gemm as fg

    monkeypatch.setattr(fg, "_GEMM", _emulated_gemm)
    policy = with_lora(small_llama())
    convert_to_fp8(policy)
    _to_gemm_backend(policy)
    policy.train()
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
    for _ in range(3):  # three micro-batches of one step: each weight quantized once
        policy(ids(5), labels=ids(5)).loss.backward()
    caches = _caches(policy)
    assert len(caches) == 2 * 7 and all(c.quantizations == 1 for c in caches.values())
    opt.step()  # LoRA A/B change in place -> the LoRA layers' caches are stale, the others not
    with torch.no_grad():
        policy(ids(6))
    lora_layers = {n for n, m in policy.named_modules() if n in caches and hasattr(m, "lora_A")}
    assert lora_layers and all(c.quantizations == (2 if n in lora_layers else 1) for n, c in caches.items())
    for name, module in policy.named_modules():  # the cached weights equal a fresh quantization
        if name in lora_layers:
            fresh = fg.quantize_weight_for_gemm(lora_merged_weight(module).detach().to(torch.bfloat16))
            cached = caches[name].value
            assert torch.equal(cached.codes.view(torch.uint8), fresh.codes.view(torch.uint8))
            assert torch.equal(cached.scale, fresh.scale)
    # The forward after the step equals the emulated path on the updated weights.
    ref = copy.deepcopy(policy)
    for m in ref.modules():
        if is_fp8_module(m):
            m.fp8_backend = "emulated"
    with torch.no_grad():
        assert torch.equal(policy(ids(7)).logits, ref(ids(7)).logits)


def test_policy_and_reference_forwards_quantize_once_per_adapter_state(monkeypatch):
    """A micro-batch's policy forward (adapter on) and reference forward (adapter off) keep one cache entry
    each: per step, each LoRA layer quantizes twice (once per adapter state), each other layer once, however
    many micro-batches; after an optimizer step only the policy's merged weights are quantized again."""
    import parity.fp8_gemm as fg
    from trainer.models.precision import fp8_weight_quantizations

    monkeypatch.setattr(fg, "_GEMM", _emulated_gemm)
    policy = with_lora(small_llama())
    convert_to_fp8(policy)
    _to_gemm_backend(policy)
    policy.train()
    opt = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
    for step in range(2):
        for mb in range(3):
            policy(ids(mb), labels=ids(mb)).loss.backward()
            with torch.no_grad(), policy.disable_adapter():
                policy(ids(mb))
        caches = _caches(policy)
        lora_layers = {n for n, m in policy.named_modules() if n in caches and hasattr(m, "lora_A")}
        per_layer = {n: c.quantizations for n, c in caches.items()}
        # step 0: LoRA layers 2 (adapter on, adapter off), others 1; step 1: the reference entries are kept
        want_lora, want_other = (2, 1) if step == 0 else (1, 0)
        assert lora_layers and all(q == (want_lora if n in lora_layers else want_other) for n, q in per_layer.items())
        assert all(len(c) == (2 if n in lora_layers else 1) for n, c in caches.items())
        assert fp8_weight_quantizations(policy, reset=True) == sum(per_layer.values())
        assert fp8_weight_quantizations(policy) == 0
        opt.step()
        opt.zero_grad()


def test_writes_through_data_need_the_explicit_invalidation(monkeypatch):
    import parity.fp8_gemm as fg
    from trainer.models.precision import invalidate_fp8_caches

    monkeypatch.setattr(fg, "_GEMM", _emulated_gemm)
    model = small_llama()
    convert_to_fp8(model)
    _to_gemm_backend(model)
    q = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        model(ids(8))
        q.weight.data.mul_(2.0)  # .data: a fresh version counter, invisible to the cache key
        model(ids(8))
    assert _caches(model)["model.layers.0.self_attn.q_proj"].quantizations == 1
    assert invalidate_fp8_caches(model) == 2 * 7
    with torch.no_grad():
        model(ids(8))
    assert _caches(model)["model.layers.0.self_attn.q_proj"].quantizations == 2
    assert torch.equal(_caches(model)["model.layers.0.self_attn.q_proj"].value.dequantize(torch.bfloat16),
                       fake_quant_weight(q.weight))


def test_default_backend_is_emulated_on_cpu():
    model = small_llama()
    convert_to_fp8(model)
    assert all(m.fp8_backend == "emulated" for m in model.modules() if is_fp8_module(m))
