"""FP8 rows of bench/gpu/gpu_check.py (issue 44 items 5 and 6): one quantizer, the one vLLM's CUDA engine runs.

In the check's own process (no engine):

- ``quantizer_torch_row``: ``parity.precision.quantize_act_groups`` on CUDA and the Triton kernel
  (``parity.fp8_triton``) against the CPU path, bitwise (FP8 codes and float32 scales), on 1x128 groups with every
  positive finite bf16 amax, zero groups and groups below the 1e-10 floor (torch on CUDA rewrites ``t / number``
  as a multiplication: the division must stay by a tensor).
- ``quantizer_vllm_row``: vLLM's ``per_token_group_quant_fp8`` (its CUDA op ``per_token_group_fp8_quant``, row- and
  column-major scales) against ours on the same input, bitwise.

In a child process (``python bench/gpu/gpu_rows_fp8.py GROUP OUT.jsonl ...``), with vLLM's CUDA build and a GPU whose
CUTLASS block-FP8 kernel vLLM runs:

- group ``engine`` on a Qwen2.5-0.5B-shaped random model (``trainer.sampling.engines.start_vllm``, precision
  fp8_rollout, eager: the hooks below see every call):
  ``FP8_ENGINE_ROWS[0]`` the engine starts (its own check of every layer) and every linear of the 24 decoder layers
  (qkv, o, gate_up, down) is ``Fp8LinearMethod`` on ``CutlassFp8BlockScaledMMKernel``;
  ``[1]`` the activation quantizer inside the engine's forward (a hook on layer 0's o_proj and down_proj kernels'
  ``quant_fp8``): its codes and scales equal ``quantize_act_groups`` of the same input, bitwise;
  ``[2]`` after the trainer's sync of a LoRA update (``sync_weights(block_fp8=True)``), every FP8 layer's weight and
  ``weight_scale_inv`` read back from the engine equal ``quantize_weight_blocks`` of the merged weights (fused
  layers' shards concatenated in vLLM's order), bitwise, and a generate afterwards gives finite log-probs.
- group ``archs``, block-sized random Phi3 and OLMoE (the zoo at 128-divisible sizes): the fp8_rollout engine starts
  (its own check refuses an FP8 method on a layer the checkpoint keeps in BF16); Phi3's fused qkv_proj/gate_up_proj,
  OLMoE's router and experts stay unquantized, some decoder linears run FP8; the engine's samples scored by a
  trainer that emulates its FP8 layers (``convert_to_fp8``, the CPU engine's numerics; OLMoE with routing replay)
  give a finite parity/mae below ``ARCH_MAE_LIMIT``. ``parityrl compare`` against the BF16 trainer (``run_compare``
  on that engine) is printed beside it. A guard against garbage (an uninitialised scale: NaN, inf, errors of order
  1), not a fine measure: the zoo's std-0.2 weights make FP8 rounding large and bf16 noise flips FP8 codes. This
  row's body on the CPU engine (emulated FP8; 2026-11-27): Phi3 0.11 against the emulating trainer, 0.18 against
  the BF16 one; OLMoE 0.08 and 0.34. The fine measures are the bitwise rows above.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
from gpu_rows_common import (
    KV_BYTES,
    QWEN05_SHAPE,
    Row,
    Skip,
    build_block_zoo_model,
    child_main,
    child_rows,
    engine_mae,
    lora_policy,
    need_cuda,
    need_vllm_cuda,
    prompt_ids,
    prompts_file,
)

from parity.precision import BLOCK, quantize_act_groups, quantize_weight_blocks
from rollout.fp8_weights import FP8_LINEAR_KERNEL, engine_fp8_layers
from rollout.types import SamplingSpec

FP8_ENGINE_ROWS = ("FP8 engine: every decoder linear on CUTLASS", "FP8 engine: activation quantizer = ours",
                   "FP8 engine: weights read back after a sync = ours")
FP8_ARCH_ROWS = ("FP8 engine: Phi3, fused qkv/gate_up stay BF16", "FP8 engine: OLMoE, router and experts stay BF16")
ARCH_MAE_LIMIT = 0.5  # ~5x the CPU engine's level on these models (module docstring)


def act_test_input() -> torch.Tensor:
    """bf16 [n, 256]: row i's first 1x128 group has the i-th positive finite bf16 value as its amax (one element
    at +amax, one at -amax, the rest below), its second group random; then a zero row and rows below EPS."""
    v = torch.arange(0x0001, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    g = torch.Generator().manual_seed(11)
    first = (v.float()[:, None] * (torch.rand(len(v), 128, generator=g) * 2 - 1)).bfloat16()
    first[:, 5] = v
    first[:, 9] = -v
    second = (torch.randn(len(v), 128, generator=g) * 10.0 ** torch.randint(-2, 4, (len(v), 1), generator=g)).bfloat16()
    special = torch.zeros(3, 256, dtype=torch.bfloat16)
    special[1, :3] = torch.tensor([1e-12, -3e-11, 2e-12])
    special[2, 128:] = 2.0**-12
    return torch.cat([torch.cat([first, second], dim=1), special])


def _codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _diff(name: str, q, s, ref_q, ref_s) -> list[str]:
    """What differs between (q, s) and the reference, bitwise ([] when nothing)."""
    q, s = q.cpu(), s.float().cpu()
    if q.shape != ref_q.shape or s.shape != ref_s.shape:
        return [f"{name}: shapes {tuple(q.shape)}/{tuple(s.shape)}, expected {tuple(ref_q.shape)}/{tuple(ref_s.shape)}"]
    out = []
    codes = (_codes(q) != _codes(ref_q)).sum().item()
    scales = (s != ref_s).sum().item()
    if codes or scales:
        out.append(f"{name}: {codes} codes and {scales} scales differ")
    return out


def quantizer_torch_row() -> str:
    device = need_cuda()
    x = act_test_input()
    ref_q, ref_s = quantize_act_groups(x)
    q, s = quantize_act_groups(x.to(device))
    bad = _diff("torch CUDA", q, s, ref_q, ref_s)
    try:
        # late: Triton is optional (torch's CUDA wheels bring it)
        from parity.fp8_triton import quantize_act_groups_triton
    except ImportError as e:
        triton = f"Triton: not importable ({e})"
    else:
        m, k = x.shape
        tq, ts = quantize_act_groups_triton(x.to(device))
        bad += _diff("Triton", tq[:m, :k], ts.t()[:m], ref_q, ref_s)
        triton = "Triton"
    figure = (f"{x.shape[0]} rows x 2 groups of 128 (every positive finite bf16 amax, zero and sub-EPS groups): "
              f"torch CUDA, {triton} vs CPU")
    if bad:
        raise AssertionError(f"{figure}: " + "; ".join(bad))
    return figure + ": bitwise equal"


def quantizer_vllm_row() -> str:
    need_vllm_cuda()
    # late: vLLM's CUDA build is optional
    import vllm._custom_ops  # noqa: F401 - loads the compiled ops (torch.ops._C)
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

    if not hasattr(torch.ops._C, "per_token_group_fp8_quant"):
        raise AssertionError("vLLM's compiled op per_token_group_fp8_quant is missing (torch.ops._C)")
    x = act_test_input().cuda().contiguous()  # contiguous: the CUDA op, not vLLM's Triton fallback
    ref_q, ref_s = quantize_act_groups(x)
    ref_q, ref_s = ref_q.cpu(), ref_s.cpu()
    bad = []
    for column_major in (False, True):  # True: what the CUTLASS kernel's QuantFP8 asks for
        q, s = per_token_group_quant_fp8(x, BLOCK, column_major_scales=column_major, use_ue8m0=False)
        bad += _diff(f"column_major_scales={column_major}", q, s, ref_q, ref_s)
    figure = f"{x.shape[0]} rows x 2 groups: vLLM's CUDA op (row- and column-major scales) vs parity.precision"
    if bad:
        raise AssertionError(f"{figure}: " + "; ".join(bad))
    return figure + ": bitwise equal"


# ---------------------------------------------------------------- in the child process


def _need_cutlass_block_fp8() -> None:
    # late: vLLM's CUDA build (the caller checked it is here)
    from vllm.model_executor.layers.quantization.utils.w8a8_utils import cutlass_block_fp8_supported

    if not cutlass_block_fp8_supported():
        cap = ".".join(map(str, torch.cuda.get_device_capability()))
        raise Skip(f"needs a GPU whose CUTLASS block-FP8 kernel vLLM runs (SM 9.0, 10.x); here SM {cap}")


def _start(model_dir: str, work_dir: str, **kw):
    # late: imports vLLM's engine
    from trainer.sampling.engines import start_vllm

    return start_vllm(model_dir, precision="fp8_rollout", dtype="bfloat16", max_model_len=256, seed=0,
                      work_dir=work_dir, kv_cache_memory_bytes=KV_BYTES, gpu_memory_utilization=0.3,
                      enforce_eager=True, **kw)


def _layer_counts(engine) -> Counter:
    return Counter(engine.llm.apply_model(engine_fp8_layers)[0].values())


def _read_fp8_layers(model) -> dict:
    """Every Fp8LinearMethod layer's (weight, weight_scale_inv), on the CPU (run in the engine)."""
    return {prefix: (m.weight.detach().cpu(), m.weight_scale_inv.detach().cpu())
            for prefix, m in model.named_modules()
            if type(getattr(m, "quant_method", None)).__name__ == "Fp8LinearMethod"}


def _hook_quantizers(captured: list, per_module: int = 16):
    """A forward hook on layer 0's o_proj and down_proj kernels' activation quantizer (run in the engine)."""

    def install(model):
        layer = model.model.layers[0]
        handles = []
        for name, linear in (("o_proj", layer.self_attn.o_proj), ("down_proj", layer.mlp.down_proj)):
            def hook(_module, args, output, name=name):
                if sum(c[0] == name for c in captured) < per_module:
                    captured.append((name, args[0].detach().clone(), output[0].detach().clone(),
                                     output[1].detach().clone()))
            handles.append(linear.quant_method.fp8_linear.quant_fp8.register_forward_hook(hook))
        return handles

    return install


def engine_group(emit, work_dir: str, model_dir: str) -> None:
    need_vllm_cuda()
    _need_cutlass_block_fp8()
    state: dict = {}
    layers = QWEN05_SHAPE["num_hidden_layers"]

    def kernels() -> str:
        state["engine"] = engine = _start(model_dir, work_dir)
        counts = _layer_counts(engine)
        want = {("Fp8LinearMethod", FP8_LINEAR_KERNEL): 4 * layers}
        shown = ", ".join(f"{n} x {m}/{k}" for (m, k), n in sorted(counts.items()))
        if dict(counts) != want:
            raise AssertionError(f"layers: {shown}; expected {4 * layers} x Fp8LinearMethod/{FP8_LINEAR_KERNEL}")
        return f"Qwen2.5-0.5B shape, the engine's start check passed: {shown}"

    emit(FP8_ENGINE_ROWS[0], kernels)
    if "engine" not in state:
        raise RuntimeError("the FP8 engine did not start (see the first FP8 engine row)")
    engine = state["engine"]

    def activations() -> str:
        captured: list = []
        handles = engine.llm.apply_model(_hook_quantizers(captured))[0]
        try:
            engine.generate(prompt_ids(4), SamplingSpec(n=2, max_new_tokens=8, seed=1))
        finally:
            for h in handles:
                h.remove()
        names = Counter(c[0] for c in captured)
        if set(names) != {"o_proj", "down_proj"}:
            raise AssertionError(f"the hooks saw {dict(names)}: expected calls of o_proj and down_proj")
        bad, tokens = [], 0
        for name, x, q, s in captured:
            ref_q, ref_s = quantize_act_groups(x)
            tokens += x.shape[0]
            bad += _diff(f"{name} [{x.shape[0]} x {x.shape[1]}, contiguous={x.is_contiguous()}]", q, s,
                         ref_q.cpu(), ref_s.cpu())
        figure = f"{len(captured)} calls of layer 0's o_proj/down_proj quantizer ({tokens} token rows)"
        if bad:
            raise AssertionError(f"{figure}: " + "; ".join(bad[:4]))
        return figure + ": codes and scales bitwise ours"

    emit(FP8_ENGINE_ROWS[1], activations)

    def readback() -> str:
        # late: the trainer's side (Transformers, PEFT) and the sync path
        from rollout.weight_export import iter_merged_lora_weights
        from trainer.sampling.engines import sync_weights

        policy = lora_policy(model_dir, torch.device("cuda"))
        sync_weights(engine, policy, block_fp8=True, dtype=torch.bfloat16)
        merged = dict(iter_merged_lora_weights(policy, dtype=torch.bfloat16))
        held = engine.llm.apply_model(_read_fp8_layers)[0]
        bad = []
        for prefix, (w, s) in sorted(held.items()):
            parent, leaf = prefix.rsplit(".", 1)
            shards = [quantize_weight_blocks(merged[f"{parent}.{sh}.weight"])
                      for sh in engine.packed_modules.get(leaf, [leaf])]
            bad += _diff(prefix, w, s, torch.cat([q for q, _ in shards]).cpu(), torch.cat([x for _, x in shards]).cpu())
        out = engine.generate(prompt_ids(4, seed=2), SamplingSpec(n=2, max_new_tokens=8, seed=2))
        lps = [lp for row in out.rollout_logprobs for lp in row]
        finite = bool(lps) and all(math.isfinite(lp) for lp in lps)
        figure = f"{len(held)} FP8 layers after the sync of a LoRA update (r 8)"
        if bad or not finite:
            raise AssertionError(f"{figure}: " + "; ".join(bad[:4] + ([] if finite else ["non-finite log-probs"])))
        return figure + f": weights and scales bitwise the trainer's; {len(lps)} sampled log-probs finite"

    emit(FP8_ENGINE_ROWS[2], readback)
    engine.close()


def _fp8_method(name: str) -> bool:
    """A vLLM quantization method class of block FP8 (``Fp8LinearMethod``, ``Fp8MoEMethod``, ...)."""
    return name.startswith("Fp8")


def _emulating_trainer(model_dir: Path, fp8_leaves: set[str], packed: dict, moe: bool, device: torch.device):
    """The model in bf16 with the engine's FP8 layers run as ``parity.precision``'s emulation (quantize ->
    dequantize -> BF16 GEMM: the CPU engine's numerics) and, for an MoE model, routing replay."""
    # late: Transformers load only where the row runs
    from trainer.models.policy import load_base_model
    from trainer.models.precision import convert_to_fp8
    from trainer.models.routing_replay import RoutingReplay

    model = load_base_model(str(model_dir), "bfloat16", device).eval()
    targets = sorted({hf for leaf in fp8_leaves for hf in packed.get(leaf, [leaf])})
    convert_to_fp8(model, targets=targets, backend="emulated")
    if moe:
        RoutingReplay(model)
    return model


def arch_group(emit, work_dir: str) -> None:
    need_vllm_cuda()
    _need_cutlass_block_fp8()
    # late: `parityrl compare`'s module imports matplotlib and openpyxl
    from trainer.diagnostics.compare import run_compare
    from trainer.models.policy import load_tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    prompts = prompts_file(Path(work_dir) / "prompts.txt", 8)
    # (arch, row, the vLLM layers that must stay unquantized, whether the model routes)
    cases = (("phi3", FP8_ARCH_ROWS[0], ("qkv_proj", "gate_up_proj"), False),
             ("olmoe", FP8_ARCH_ROWS[1], ("gate", "experts"), True))
    for arch, row, bf16_leaves, moe in cases:
        def check(arch=arch, bf16_leaves=bf16_leaves, moe=moe) -> str:
            model_dir = build_block_zoo_model(arch, Path(work_dir) / arch)
            engine = _start(str(model_dir), str(Path(work_dir) / f"{arch}_run"), return_routes=moe)
            try:
                layers = engine.llm.apply_model(engine_fp8_layers)[0]
                bad = []
                for leaf in bf16_leaves:  # vLLM's layer named <leaf>, or a module inside it
                    methods = {m for p, (m, _) in layers.items() if re.search(rf"\.{leaf}(\.|$)", p)}
                    if not methods or any(_fp8_method(m) for m in methods):
                        bad.append(f"{leaf}: {sorted(methods) or 'no such layer'}")
                fp8 = {p.rsplit(".", 1)[-1] for p, (m, _) in layers.items() if _fp8_method(m)}
                packed = dict(engine.packed_modules)
                summary = run_compare(str(model_dir), str(prompts), str(Path(work_dir) / f"{arch}_compare"),
                                      engine=engine, precision="fp8_rollout", dtype="bfloat16", max_new_tokens=32,
                                      n=2, seed=0)
                rollouts = engine.generate(prompt_ids(8, seed=3), SamplingSpec(n=2, max_new_tokens=32, seed=3))
            finally:
                engine.close()
            trainer = _emulating_trainer(model_dir, fp8, packed, moe, device)
            mae = engine_mae(rollouts, trainer, load_tokenizer(str(model_dir)).pad_token_id, device)
            bf16_mae = summary["metrics"]["parity/mae"]
            figure = (f"started (its layer check passed); FP8: {', '.join(sorted(fp8)) or 'none'}; BF16: "
                      f"{', '.join(bf16_leaves)}; parity/mae {mae:.2e} against a trainer emulating those FP8 layers, "
                      f"{bf16_mae:.2e} against the BF16 trainer (parityrl compare)" + (", routes replayed" if moe else ""))
            if not fp8:
                bad.append("no FP8 layer at all")
            if not (math.isfinite(mae) and mae < ARCH_MAE_LIMIT):
                bad.append(f"MAE against the emulating trainer not below {ARCH_MAE_LIMIT}")
            if bad:
                raise AssertionError(f"{figure}; " + "; ".join(bad))
            return figure

        emit(row, check)


GROUPS = {"engine": (FP8_ENGINE_ROWS, engine_group), "archs": (FP8_ARCH_ROWS, arch_group)}


def engine_rows(shaped: Callable[[], Path]) -> list[Row]:
    """FP8_ENGINE_ROWS, from a child process (module docstring)."""
    need_vllm_cuda()
    return child_rows(Path(__file__), "engine", FP8_ENGINE_ROWS, [str(shaped())], cap_s=360)


def arch_rows() -> list[Row]:
    """FP8_ARCH_ROWS, from a child process (module docstring)."""
    need_vllm_cuda()
    return child_rows(Path(__file__), "archs", FP8_ARCH_ROWS, [], cap_s=300)

if __name__ == "__main__":
    child_main(GROUPS)
