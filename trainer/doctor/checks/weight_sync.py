"""The sync delivers the weights: one sync done as training does it (``trainer.sampling.policy_sync``: the LoRA
adapter, or the merged weights, as ``rollout.lora_sync`` resolves for this recipe and engine), of a policy whose
weights moved, then the engine's weights read back inside its process and compared, module by module, with what the
trainer exported.

The policy is built as training builds it (the recipe's LoRA on the base model, the recipe's precision transform),
its LoRA B matrices set to seeded values (std ``B_STD``) so that the update is visible in every module, even
merged and rounded to BF16.

Reading back (``engine.llm.apply_model``, in the engine's own process):

- merged: each linear layer's weight, per Hugging Face shard (vLLM fuses q/k/v into ``qkv_proj`` and gate/up into
  ``gate_up_proj``, ``packed_modules_mapping``). vLLM's CPU build repacks a linear's weight for oneDNN and drops
  ``weight`` (``vllm/model_executor/layers/utils.py`` ``dispatch_cpu_unquantized_gemm``), so the weight is read
  through the layer's own GEMM: the identity matrix times W^T is W exactly (one non-zero product per output, in any
  dtype). Expected: the export cast to the engine dtype, bit for bit (an FP8 engine's layers hold the quantized
  weight: the export through ``parity.precision.fake_quant_weight``, the same function). An FP8 layer is either the
  CPU emulation's (``fp8_shard_rows``: its BF16 weight holds the fake-quantized values) or, on CUDA, vLLM's own
  ``Fp8LinearMethod``, whose FP8 values and ``weight_scale_inv`` are read as they are and dequantized
  (``rollout.fp8_weights.block_fp8_tensors``; vLLM 0.32's CUDA layout read from its source, not run here);
- adapter: the LoRA A and B vLLM's layers hold (slot 0: the engine serves one adapter, ``lora_options``; vLLM folds
  the scaling into B at load, ``vllm/lora/lora_weights.py`` ``optimize``). Expected: the exported A, and B times the
  scaling, in the adapter's dtype, bit for bit.

A module whose engine value is still the one it held before the sync is named "not delivered"; one shard of a fused
module wrong while its siblings arrived, "partially delivered". Afterwards the engine is left as it was found: the
merged modules pushed back with the values read before the sync (checked by a second read) -- a block-FP8 layer's as
the FP8 values and scales it held, since vLLM's in-place reload rebuilds every layer it touches from its
construction-time parameters and a float weight sent alone would be cast into the FP8 parameter unscaled, beside a
``weight_scale_inv`` nothing loaded (``vllm/model_executor/model_loader/reload/layerwise.py``) --, the adapter dropped;
and the engine's prefill log-probs of two of the fixed batch's sequences, taken before the sync and after the restore,
must be the same bit for bit (``context.engine_restored``: weights that read back restored do not prove the engine
computes as before).
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from parity.precision import dequantize_weight_blocks, fake_quant_weight
from rollout.adapters import export_lora_adapter, lora_modules
from rollout.fp8_weights import SCALE_SUFFIX, block_fp8_tensors, scale_shard
from rollout.weight_export import iter_merged_lora_weights
from trainer.distributed.data_parallel import DataParallel
from trainer.doctor.context import Doctor, engine_prefill, engine_restored, relative_error
from trainer.doctor.records import FAIL, Check, CheckCannotRun, Finding, at_most
from trainer.models.policy import add_lora, load_base_model
from trainer.precision.lora_sync import ADAPTER
from trainer.sampling.policy_sync import policy_sync

NAME = "weight_sync"
B_STD = 0.02  # the LoRA B values: an update of a few hundred steps, well above half a BF16 step of W
SEED = 0
EYE_ROWS = 1024  # identity rows per GEMM when a weight is read through the layer's kernel
MAX_NAMED = 8  # modules named one finding each; the rest are counted in the summary


def trained_policy(doc: Doctor):
    """The recipe's LoRA policy, built as training builds it, with seeded non-zero LoRA B matrices."""
    policy = add_lora(load_base_model(doc.model_dir, doc.dtype, doc.device), doc.cfg.model.lora)
    policy = doc.precision.transform(policy)
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * B_STD)
    return policy.eval()


# ---- reading the engine ----------------------------------------------------------------------
def _is_linear(m) -> bool:
    return all(hasattr(m, a) for a in ("quant_method", "input_size_per_partition", "output_size_per_partition"))


def _linear_weight(m) -> torch.Tensor:
    """The [out, in] weight a vLLM linear layer computes with (read through its GEMM where vLLM dropped it)."""
    n_out, n_in = m.output_size_per_partition, m.input_size_per_partition
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor) and tuple(w.shape) == (n_out, n_in) and w.is_floating_point() \
            and w.element_size() > 1:
        return w.detach().clone().cpu()
    dtype = m.params_dtype if hasattr(m, "params_dtype") else torch.bfloat16
    device = next((t.device for t in m.buffers()), None) or next((t.device for t in m.parameters()), "cpu")
    cols = []
    with torch.no_grad():
        for k0 in range(0, n_in, EYE_ROWS):
            k1 = min(n_in, k0 + EYE_ROWS)
            eye = torch.zeros(k1 - k0, n_in, dtype=dtype, device=device)
            eye[:, k0:k1] = torch.eye(k1 - k0, dtype=dtype, device=device)
            cols.append(m.quant_method.apply(m, eye).cpu())  # [k, out] = rows k0:k1 of W^T
    return torch.cat(cols).t().contiguous()


def _shard_sizes(m) -> list[int]:
    sizes = getattr(m, "output_sizes", None)
    return list(sizes) if sizes else [m.output_size_per_partition]


def linear_states(model, modules: set[str]) -> dict:
    """Engine module name -> (weight [out, in] it computes with, shard row counts, holds FP8-quantized weights,
    vLLM's block-FP8 (values, scales) or None), for ``modules`` of the engine's ``model`` (run inside the engine)."""
    out = {}
    for name, m in model.named_modules():
        name = name.removesuffix(".base_layer")
        if name in modules and _is_linear(m) and not hasattr(m, "base_layer"):
            block = block_fp8_tensors(m)
            weight = _linear_weight(m) if block is None else dequantize_weight_blocks(
                *block, dtype=getattr(m, "orig_dtype", torch.bfloat16))
            out[name] = (weight, _shard_sizes(m), block is not None or hasattr(m, "fp8_shard_rows"), block)
    return out


def read_linears(engine, modules: set[str]) -> dict:
    """``linear_states`` of the engine's model, read in its own process."""
    return engine.llm.apply_model(partial(linear_states, modules=modules))[0]


def restore_tensors(before: dict, where: dict[str, tuple[str, int]]) -> list[tuple[str, torch.Tensor]]:
    """The update that puts back what ``before`` (``linear_states``) read, per HF module (``where``: its engine module
    and shard): the weight, or a block-FP8 layer's FP8 values and scales as it held them (module docstring)."""
    out = []
    for m, (e, i) in where.items():
        weight, sizes, _, block = before[e]
        if block is None:
            out.append((f"{m}.weight", _shard(weight, sizes, i)))
            continue
        q, s = block
        out += [(f"{m}.weight", _shard(q, sizes, i)), (f"{m}.{SCALE_SUFFIX}", scale_shard(s, sizes, i))]
    return out


def read_lora(engine) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Engine module name -> per slice (A [max_rank, in], B [out, max_rank]) of the adapter in slot 0."""

    def read(model):
        out = {}
        for name, m in model.named_modules():
            if hasattr(m, "lora_a_stacked") and hasattr(m, "lora_b_stacked"):
                out[name] = [(a[0, 0].detach().clone().cpu(), b[0, 0].detach().clone().cpu())
                             for a, b in zip(m.lora_a_stacked, m.lora_b_stacked)]
        return out

    return engine.llm.apply_model(read)[0]


def _engine_names(engine) -> tuple[dict[str, str], object]:
    """(HF leaf -> the vLLM module holding it, the model's HF-to-vLLM name mapper or None)."""
    leaf_to_fused = {leaf: fused for fused, leaves in engine.packed_modules.items() for leaf in leaves}
    mapper = engine.llm.apply_model(lambda model: getattr(type(model), "hf_to_vllm_mapper", None))[0]
    return leaf_to_fused, mapper


def _locate(hf_module: str, engine, names) -> tuple[str, int]:
    """(engine module, shard index) holding the HF module ``hf_module`` (e.g. ``model.layers.0.self_attn.k_proj``)."""
    leaf_to_fused, mapper = names
    mapped = hf_module
    if mapper is not None:
        mapped = (mapper._map_name(f"{hf_module}.weight") or f"{hf_module}.weight").removesuffix(".weight")
    parent = mapped.rpartition(".")[0]
    fused = leaf_to_fused.get(hf_module.rpartition(".")[2])  # the mapper may have renamed the leaf to its fused
    if fused is None:
        return mapped, 0
    return f"{parent}.{fused}" if parent else fused, engine.packed_modules[fused].index(hf_module.rpartition(".")[2])


def _shard(weight: torch.Tensor, sizes: list[int], i: int) -> torch.Tensor:
    start = sum(sizes[:i])
    return weight[start:start + sizes[i]]


# ---- the two modes ---------------------------------------------------------------------------
def _merged(doc: Doctor, engine, sync) -> tuple[dict, dict, dict]:
    """(per HF module: relative error, the delivered state, details) of a merged sync."""
    dtype = engine.torch_dtype
    exported = {n.removesuffix(".weight"): t for n, t in iter_merged_lora_weights(sync.policy, dtype=dtype)
                if n.endswith(".weight")}
    names = _engine_names(engine)
    where = {m: _locate(m, engine, names) for m in exported}
    before = read_linears(engine, {e for e, _ in where.values()})
    unreadable = sorted(m for m, (e, _) in where.items() if e not in before)
    if unreadable:
        raise CheckCannotRun(f"the engine has no linear layer for {unreadable[:4]}: the readback covers the "
                             "engine's linear layers only")
    try:
        restore = restore_tensors(before, where)  # before the sync: a layer it cannot put back is refused unchanged
    except ValueError as e:
        raise CheckCannotRun(f"the engine could not be restored after the check: {e}") from None
    try:
        sync(engine)
        after = read_linears(engine, set(before))
    finally:
        engine.load_weights(restore)
    restored = read_linears(engine, set(before))
    errors, state = {}, {}
    for m, (e, i) in where.items():
        w, sizes, fp8, _ = after[e]
        want = exported[m].to(dtype)
        want = fake_quant_weight(want).to(dtype) if fp8 else want
        got, old = _shard(w, sizes, i), _shard(before[e][0], sizes, i)
        errors[m] = relative_error(got.float(), want.float())
        state[m] = "delivered" if errors[m] == 0 else ("not delivered" if torch.equal(got, old) else "wrong")
    restore_err = max(relative_error(restored[e][0].float(), before[e][0].float()) for e in before)
    return errors, state, {"restore_error": restore_err, "where": {m: f"{e}[{i}]" for m, (e, i) in where.items()}}


def _adapter(doc: Doctor, engine, sync) -> tuple[dict, dict, dict]:
    """(per HF module: relative error, the delivered state, details) of an adapter sync."""
    if engine.adapter_version is not None:
        raise CheckCannotRun(f"the engine serves adapter version {engine.adapter_version}: this check's sync would "
                             "replace it, and the engine would not be left as it was found")
    dtype = engine.adapter_dtype
    exported = export_lora_adapter(sync.policy, version=1, dtype=dtype).tensors
    scaling = {n.removeprefix("base_model.model."): float(m.scaling["default"]) for n, m in lora_modules(sync.policy)}
    names = _engine_names(engine)
    try:
        sync(engine)
        # vLLM copies an adapter into its layers when a request first uses it
        engine.generate(doc.prompt_ids[:1], doc.spec(max_new_tokens=1))
        held = read_lora(engine)
    finally:
        engine.drop_adapter()
    errors, state = {}, {}
    for m, s in scaling.items():
        a_want = exported[f"base_model.model.{m}.lora_A.weight"]
        b_want = exported[f"base_model.model.{m}.lora_B.weight"].clone().mul_(s)  # vLLM's fold, in its dtype
        e, i = _locate(m, engine, names)
        if e not in held:
            errors[m], state[m] = float("inf"), "not delivered"
            continue
        a, b = held[e][i]
        a, b = a[: a_want.shape[0], : a_want.shape[1]], b[: b_want.shape[0], : b_want.shape[1]]
        errors[m] = max(relative_error(a.float(), a_want.float()), relative_error(b.float(), b_want.float()))
        state[m] = "delivered" if errors[m] == 0 else ("not delivered" if not (a.any() or b.any()) else "wrong")
    return errors, state, {"adapter_dropped": engine.adapter_version is None}


def _fused_member(m: str, engine, names) -> Optional[str]:
    e, _ = _locate(m, engine, names)
    return e if e.rpartition(".")[2] in engine.packed_modules else None


def run(doc: Doctor) -> list[Finding]:
    engine = doc.engine
    if not hasattr(engine, "llm") or not hasattr(engine, "packed_modules"):
        raise CheckCannotRun(f"the weight readback runs inside the colocated vLLM engine (apply_model); this engine "
                             f"is {type(engine).__name__}")
    policy = trained_policy(doc)
    sync = policy_sync(doc.cfg, engine, policy, DataParallel(), announce=False, model_dir=doc.model_dir)
    before = engine_prefill(engine, doc.batch())
    errors, state, extra = (_adapter if sync.mode == ADAPTER else _merged)(doc, engine, sync)
    restored = engine_restored(NAME, before, engine_prefill(engine, doc.batch()))
    names = _engine_names(engine)
    # a wrong shard of a fused module whose siblings arrived: partially delivered
    bad = {m for m, s in state.items() if s != "delivered"}
    for m in sorted(bad):
        fused = _fused_member(m, engine, names)
        siblings = [o for o in state if o != m and _fused_member(o, engine, names) == fused]
        if fused and any(state[o] == "delivered" for o in siblings):
            state[m] = f"partially delivered ({fused} took {', '.join(o.rpartition('.')[2] for o in siblings if state[o] == 'delivered')}, not {m.rpartition('.')[2]})"
    worst = max(errors, key=errors.get)
    details = {"mode": sync.mode, "modules": len(errors), "errors": errors,
               "not_delivered": sorted(bad), **extra}
    label = "merged weights" if sync.mode != ADAPTER else "LoRA A/B"
    out = [at_most(NAME, f"{sync.mode} sync, {len(errors)} modules: worst relative error ({worst})", errors[worst],
                   0.0, f"{len(bad)} module(s) not as exported after the sync: "
                        f"{', '.join(sorted(bad)[:4])}{' ...' if len(bad) > 4 else ''}", details=details)]
    for m in sorted(bad)[:MAX_NAMED]:
        out.append(Finding(NAME, f"{m}: {state[m]}", errors[m], "== 0", FAIL,
                           f"the engine's {label} of {m} are not what the trainer exported ({state[m]}): the sync "
                           "left this module out or loaded part of it"))
    if sync.mode != ADAPTER:
        out.append(at_most(NAME, "engine restored after the check (relative error vs before)",
                           extra["restore_error"], 0.0, "the engine's weights differ from those it held before the "
                                                        "check: the restoring push was not delivered"))
    elif not extra["adapter_dropped"]:
        out.append(Finding(NAME, "engine restored after the check", None, "no adapter", FAIL,
                           "the check's adapter is still served"))
    return out + [restored]


CHECK = Check(NAME, "does a sync deliver every module the trainer exported, bit for bit?", run)
