"""The doctor on a CUDA FP8 recipe's engine (issue 57 item 3), without an engine: vLLM's own ``Fp8LinearMethod``
layers as CUDA leaves them (block_fp8_layers.py: built, loaded and reloaded by vLLM's code on the CPU; only the
kernel choice stands in for the GPU).

- weight_sync reads such a layer as the FP8 weight the trainer's quantizer gives (not "wrong" against the BF16
  export), and its restore puts back the FP8 values and scales bit for bit through vLLM's reload -- where the float
  restore it replaces leaves the layer's FP8 values the float weights cast unscaled;
- prefix_cache's sync leg sends the block-FP8 form to such an engine, and vLLM's reload then holds the quantized
  changed weights.
"""
from types import SimpleNamespace

import pytest
import torch
from block_fp8_layers import WHERE, BlockFp8Decoder, block_fp8_llama, fake_sm90
from safetensors.torch import load_file

from parity.precision import dequantize_weight_blocks, fake_quant_weight, quantize_weight_blocks
from rollout.fp8_weights import fp8_block_weights
from trainer.doctor.checks.prefix_cache import _changed_weights, sync_update
from trainer.doctor.checks.weight_sync import _shard, linear_states, restore_tensors


@pytest.fixture
def decoder(monkeypatch, tmp_path):
    fake_sm90(monkeypatch)
    src, fp8 = block_fp8_llama(tmp_path)
    return BlockFp8Decoder(src, fp8), src


def _hf_weights(src) -> dict[str, torch.Tensor]:
    return {n.removesuffix(".weight"): t for n, t in load_file(str(src / "model.safetensors")).items()
            if n.removesuffix(".weight") in WHERE}


def _raw(states: dict) -> dict:
    """Each layer's FP8 values (as bytes) and scales."""
    return {e: (s[3][0].view(torch.uint8), s[3][1]) for e, s in states.items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(x, y) for k in a for x, y in zip(a[k], b[k]))


def test_vllm_fp8_layers_read_as_the_trainer_s_quantized_weights(decoder):
    model, src = decoder
    states = linear_states(model, set(model.linears()))
    assert set(states) == {e for e, _ in WHERE.values()}
    for m, w in _hf_weights(src).items():
        e, i = WHERE[m]
        weight, sizes, fp8, block = states[e]
        assert fp8 and block is not None and block[0].dtype == torch.float8_e4m3fn, m
        # bit for bit what weight_sync expects of an FP8 layer: the export through the trainer's quantizer
        assert torch.equal(_shard(weight, sizes, i), fake_quant_weight(w)), m


def test_the_restore_puts_back_fp8_values_and_scales_through_vllm_s_reload(decoder):
    model, src = decoder
    before = linear_states(model, set(model.linears()))
    restore = restore_tensors(before, WHERE)
    assert {n.rpartition(".")[2] for n, _ in restore} == {"weight", "weight_scale_inv"} and len(restore) == 14
    # the check's sync: other weights, in the form the trainer sends them
    moved = [(f"{m}.weight", (w.float() * 1.1).bfloat16()) for m, w in _hf_weights(src).items()]
    model.reload(fp8_block_weights(moved))
    synced = linear_states(model, set(before))
    assert not _equal(_raw(synced), _raw(before))
    model.reload(restore)
    assert _equal(_raw(linear_states(model, set(before))), _raw(before))
    # what the restore pushed before: the float weights read back. vLLM rebuilds each touched layer and casts them
    # into its float8 parameter unscaled; the scale is not loaded at all
    model.reload(fp8_block_weights(moved))
    model.reload([(f"{m}.weight", _shard(before[e][0], before[e][1], i)) for m, (e, i) in WHERE.items()])
    after = _raw(linear_states(model, set(before)))
    assert all(not torch.equal(after[e][0], _raw(before)[e][0]) for e in after)


def test_prefix_cache_s_sync_leg_reaches_vllm_s_fp8_layers_quantized(decoder):
    model, src = decoder
    doc = SimpleNamespace(model_dir=str(src))
    changed = {n: t for n, t in _changed_weights(doc)}
    assert all(t.is_floating_point() and t.dtype != torch.float8_e4m3fn for _, t in sync_update(
        doc, SimpleNamespace(fp8_block_weights=False)))
    update = sync_update(doc, SimpleNamespace(fp8_block_weights=True))
    model.reload(update)
    states = linear_states(model, set(model.linears()))
    for m, (e, i) in WHERE.items():
        weight, sizes, _, _ = states[e]
        want = dequantize_weight_blocks(*quantize_weight_blocks(changed[f"{m}.weight"]))
        assert torch.equal(_shard(weight, sizes, i), want), m
