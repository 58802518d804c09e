"""Packed rows (trainer/models/packing.py): the layout, and log-probs and LoRA gradients equal to the padded path.

Float32 and random-init models at std 0.2 (the architecture zoo), so that a token attending
across a sequence boundary, or a wrong position, moves the log-probs by O(0.1), far above the
1e-5 tolerance. Not bitwise: packed rows are GEMMs and attention of other shapes, summed in
another order.
"""
from types import SimpleNamespace

import pytest
import torch

from trainer.builtin.zoo import ensure_arch_model
from trainer.config import LoraConfig
from trainer.config.schema import RecipeError
from trainer.models.architecture import split_model
from trainer.models.batch import IGNORE, build_token_batch
from trainer.models.packing import first_fit, pack, packing_error, unpack
from trainer.models.policy import add_lora, check_packing, completion_logprobs, load_base_model


def test_first_fit_fills_rows_longest_first():
    # capacity 9: 9 alone; 5 opens a row, 4 joins it (9), 3 and 2 open the next (5), 1 fits there too
    assert first_fit([3, 9, 5, 2, 4, 1], 9) == [[1], [2, 4], [0, 3, 5]]
    assert first_fit([2, 2], 4) == [[0, 1]]


def test_pack_layout():
    # lengths (prompt + completion): 3 + 1 = 4, 1 + 2 = 3, 2 + 4 = 6, 1 + 1 = 2 -> capacity 6:
    # first fit by decreasing length: [row 2], [row 0, row 3], [row 1] + 3 padding
    b = build_token_batch([[5, 6, 7], [8], [9, 9], [11]], [[1], [2, 3], [4, 4, 4, 4], [12]], pad_id=0)
    p = pack(b)
    assert p.input_ids.tolist() == [[9, 9, 4, 4, 4, 4], [5, 6, 7, 1, 11, 12], [8, 2, 3, 0, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
    # target j of a row is predicted by the position of the token before it: flat index row * 6 + column
    assert b.targets.tolist() == [[1, IGNORE, IGNORE, IGNORE], [2, 3, IGNORE, IGNORE], [4, 4, 4, 4],
                                  [12, IGNORE, IGNORE, IGNORE]]
    assert p.source.tolist() == [[6 + 2, 0, 0, 0], [12 + 0, 12 + 1, 0, 0], [1, 2, 3, 4], [6 + 4, 0, 0, 0]]
    flat = p.input_ids.reshape(-1)
    nxt = torch.where(b.mask > 0, flat[(p.source + 1).clamp(max=flat.numel() - 1)], IGNORE)
    assert nxt.tolist() == b.targets.tolist()  # the token after each source position is its target
    out = unpack(torch.arange(18.0).reshape(3, 6, 1), p)
    assert out.shape == (4, 4, 1) and out[2, :, 0].tolist() == [1, 2, 3, 4]


def _lora_model(arch: str):
    torch.manual_seed(0)
    model = add_lora(load_base_model(str(ensure_arch_model(arch)), "float32", pack_sequences=True),
                     LoraConfig(r=4, alpha=8))
    with torch.no_grad():  # a non-zero adapter, so that gradients reach both LoRA factors
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.2)
    return model


def _varied_batch():
    """Completion lengths 2..14 (7x), prompts 2..6 tokens: several sequences share a packed row."""
    g = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(5, 500, (n,), generator=g).tolist()

    prompts = [ids(2 + i % 5) for i in range(7)]
    completions = [ids(n) for n in (14, 2, 9, 3, 6, 2, 4)]
    return build_token_batch(prompts, completions, pad_id=0)


# qwen2: sdpa, q/k/v biases; gemma2: eager with attention softcap and sliding-window layers;
# llama_tied: tied embeddings; qwen2_moe: token routing (must not see the other sequences).
@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "llama_tied", "qwen2_moe"])
def test_packed_logprobs_and_gradients_equal_padded(arch):
    model = _lora_model(arch)
    batch = _varied_batch()
    assert len(pack(batch).input_ids) < len(batch)  # sequences do share rows
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(2))

    def run(packed: bool):
        model.zero_grad()
        lp, ent = completion_logprobs(model, batch, temperature=0.9, return_entropy=True, pack_sequences=packed)
        ((lp * weights * batch.mask).sum() + (ent * batch.mask).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return lp.detach(), ent.detach(), grads

    lp_ref, ent_ref, g_ref = run(False)
    lp, ent, g = run(True)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-5)
    assert g.keys() == g_ref.keys() and len(g) > 0
    for name in g:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-5 * float(g_ref[name].abs().max()),
                                   msg=name)


class _IgnoresBoundaries(torch.nn.Module):
    """A backbone that numbers every row's positions 0, 1, ...: packed sequences attend to each other."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        pos = torch.arange(input_ids.shape[1]).expand_as(input_ids) if attention_mask is None else position_ids
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                             use_cache=use_cache)


def test_packing_check_catches_a_forward_that_crosses_sequences():
    model = load_base_model(str(ensure_arch_model("qwen2")), "float32")
    backbone, _ = split_model(model)
    assert packing_error(backbone, vocab_size=model.config.vocab_size) < 1e-5
    assert packing_error(_IgnoresBoundaries(backbone), vocab_size=model.config.vocab_size) > 1e-2


def test_packing_is_refused_for_flash_attention():
    fake = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    with pytest.raises(RecipeError, match="train.pack_sequences = true.*flash_attention_2.*sdpa"):
        check_packing(fake, "bfloat16")


class _Engine(torch.nn.Module):
    """What a DeepSpeed engine looks like to completion_hidden: ``.module`` and a forward calling it."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, **kw):
        return self.module(**kw)


def test_packed_through_the_deepspeed_forward_with_a_value_head_equals_padded():
    """Under DeepSpeed the engine's forward runs the packed rows (no attention mask) and PPO's values."""
    from trainer.models.policy import completion_hidden
    from trainer.models.policy_forward import PolicyForward
    from trainer.rl.value_head import ValueHead

    model = _lora_model("qwen2")
    torch.manual_seed(3)
    head = ValueHead(model.config.hidden_size)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    engine = _Engine(PolicyForward(model, head))
    batch = _varied_batch()
    with torch.no_grad():
        h_ref, _, v_ref = completion_hidden(model, batch, head)
        h, _, v = completion_hidden(engine, batch, head, pack_sequences=True)
    m = batch.mask[..., None]
    torch.testing.assert_close(h * m, h_ref * m, rtol=0, atol=1e-5)
    torch.testing.assert_close(v * batch.mask, v_ref * batch.mask, rtol=0, atol=1e-5)
    assert (v_ref * batch.mask).abs().max() > 0.01
