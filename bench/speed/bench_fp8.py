"""BF16 vs FP8 (fp8_unified's trainer layers), one invocation: ``python bench/speed/bench_fp8.py``.

Per shape (Qwen2.5-7B's 3584/18944 and 18944/3584, Qwen2.5-0.5B's 896/4864 and 4864/896; M tokens,
default 8192), on a CUDA GPU:

- one LoRA'd linear (r = 16, PEFT): BF16 (PEFT's base + B A x) vs FP8 (``convert_to_fp8``'s layer,
  FP8 GEMM on the cached quantized merged weight; backward: dx through the dequantized weight, the
  adapters' gradients through the rank, no [N, K] weight gradient), forward and forward + backward;
- the FP8 forward's parts: activation quantization (fused Triton kernel), the FP8 GEMM alone, and
  the weight quantization paid once per optimizer step and adapter state (the cache's miss), with
  the quantization's share of the forward; the backward's parts: dequantizing the weight and the
  activation into BF16, the dx GEMM, the adapters' rank-r GEMMs;
- the weight cache's quantization count over the timed loops (1: the weights do not change) and over
  three micro-batches of a policy forward plus a reference forward with the adapter off (2: one per
  adapter state, not one per forward);
- one whole decoder layer (Qwen2 config of that size, LoRA on every linear, M tokens as 4 sequences),
  BF16 vs FP8, forward and forward + backward.

Timings: CUDA events, median of ``--iters`` after warm-up; ratios are BF16 time / FP8 time (> 1:
FP8 faster), all from this one run on one card (printed). On a machine without CUDA SM 9.x
(torch's block-scaled FP8 GEMM is Hopper-only) it says so, runs the FP8 layer's path on a small
shape on CPU with the GEMM emulated (``parity.fp8_gemm.fp8_gemm_emulated``: the same quantization,
cache and backward, so its quantization counts are real; its times are not FP8 figures), and exits 0.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = ((3584, 18944), (18944, 3584), (896, 4864), (4864, 896))  # (K, N)
LAYER_CONFIGS = {  # hidden -> (intermediate, heads, kv heads): Qwen2.5-7B and -0.5B
    3584: (18944, 28, 4),
    896: (4864, 14, 2),
}


def _timer(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() (CUDA events on CUDA, wall clock elsewhere)."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = torch.cuda.is_available()
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class _One(nn.Module):
    def __init__(self, k: int, n: int, dtype, device):
        super().__init__()
        self.proj = nn.Linear(k, n, bias=False, dtype=dtype, device=device)


def lora_linear(k: int, n: int, device, dtype=torch.bfloat16, r: int = 16):
    import peft

    torch.manual_seed(0)
    model = peft.get_peft_model(_One(k, n, dtype, device), peft.LoraConfig(r=r, lora_alpha=2 * r,
                                                                           target_modules=["proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model.get_base_model().proj


def to_fp8(layer, backend: str):
    from trainer.models.precision import _fp8_lora_class

    layer.__class__ = _fp8_lora_class(type(layer))
    layer.fp8_backend = backend
    return layer


def bench_linear(m: int, k: int, n: int, device, backend: str, iters: int) -> dict:
    import copy

    from parity import fp8_gemm as fg
    from trainer.models.precision import fp8_weight_quantizations, invalidate_fp8_caches

    bf16 = lora_linear(k, n, device)
    fp8 = to_fp8(copy.deepcopy(bf16), backend)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    out = {}
    for name, layer in (("bf16", bf16), ("fp8", fp8)):
        with torch.no_grad():
            out[f"{name}_fwd"] = _timer(lambda layer=layer: layer(x), iters)
        out[f"{name}_fwdbwd"] = _timer(lambda layer=layer: layer(x).backward(g), iters)
    if backend != "scaled_mm":
        return out
    out["quant_timed"] = fp8_weight_quantizations(fp8, reset=True)
    invalidate_fp8_caches(fp8)  # from an empty cache, as after a weight sync by .data
    for _ in range(3):  # micro-batches: policy forward + backward, then the reference forward, adapter off
        fp8(x).backward(g)
        fp8.enable_adapters(False)
        with torch.no_grad():
            fp8(x)
        fp8.enable_adapters(True)
    out["quant_policy_ref"] = fp8_weight_quantizations(fp8, reset=True)

    w = bf16.get_base_layer().weight.detach()
    fw = fg.quantize_weight_for_gemm(w)
    xq, sa = fg.quantize_act_for_gemm(x.detach(), fw.codes.shape[1])
    out["act_quant"] = _timer(lambda: fg.quantize_act_for_gemm(x.detach(), fw.codes.shape[1]), iters)
    out["gemm"] = _timer(lambda: fg._GEMM(xq, sa, fw, m, torch.bfloat16), iters)
    out["weight_quant_per_step"] = _timer(lambda: fg.quantize_weight_for_gemm(w), iters)
    # The backward's parts, as Fp8CachedLinear.backward runs them.
    a = fp8.lora_A["default"].weight.detach().bfloat16()
    b = fp8.lora_B["default"].weight.detach().bfloat16()
    wd = fw.dequantize(torch.bfloat16)
    xd = fg.dequantize_act_for_gemm(xq, sa, m, k, torch.bfloat16)
    out["bwd_dequant_w"] = _timer(lambda: fw.dequantize(torch.bfloat16), iters)
    out["bwd_dequant_x"] = _timer(lambda: fg.dequantize_act_for_gemm(xq, sa, m, k, torch.bfloat16), iters)
    out["bwd_dx"] = _timer(lambda: g @ wd, iters)
    out["bwd_lora"] = _timer(lambda: ((g @ b).t() @ xd, g.t() @ (xd @ a.t())), iters)
    return out


def bench_layer(m: int, hidden: int, device, backend: str, iters: int) -> dict:
    import copy

    import peft
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.models.precision import convert_to_fp8

    inter, heads, kv = LAYER_CONFIGS[hidden]
    cfg = Qwen2Config(vocab_size=1024, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096)
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
    bf16 = peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    fp8 = copy.deepcopy(bf16)
    convert_to_fp8(fp8, backend=backend)
    seqs = 4
    ids = torch.randint(0, 1024, (seqs, m // seqs), device=device)
    out = {}
    for name, model in (("bf16", bf16), ("fp8", fp8)):
        model.train()
        with torch.no_grad():
            out[f"{name}_fwd"] = _timer(lambda model=model: model(ids), iters)
        out[f"{name}_fwdbwd"] = _timer(lambda model=model: model(ids, labels=ids).loss.backward(), iters)
    return out


def _report(title: str, r: dict) -> None:
    fwd, fb = r["bf16_fwd"] / r["fp8_fwd"], r["bf16_fwdbwd"] / r["fp8_fwdbwd"]
    print(f"  {title}: forward BF16 {r['bf16_fwd']:.3f} ms, FP8 {r['fp8_fwd']:.3f} ms ({fwd:.2f}x); "
          f"fwd+bwd BF16 {r['bf16_fwdbwd']:.3f} ms, FP8 {r['fp8_fwdbwd']:.3f} ms ({fb:.2f}x)")
    if "gemm" in r:
        share = r["act_quant"] / r["fp8_fwd"]
        print(f"    FP8 forward parts: activation quantization {r['act_quant']:.3f} ms ({share:.0%} of the "
              f"forward), FP8 GEMM alone {r['gemm']:.3f} ms; weight quantization {r['weight_quant_per_step']:.3f} ms "
              "once per optimizer step and adapter state (cached)")
        print(f"    FP8 backward parts: dequantize W {r['bwd_dequant_w']:.3f} ms, dequantize x "
              f"{r['bwd_dequant_x']:.3f} ms, dx GEMM {r['bwd_dx']:.3f} ms, adapters' rank-r GEMMs {r['bwd_lora']:.3f} ms")
        print(f"    weight quantizations: {r['quant_timed']} over the timed loops (weights fixed: 1 expected); "
              f"{r['quant_policy_ref']} over 3 micro-batches of policy + reference (adapter off) forwards "
              "(2 expected: one per adapter state)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=8192, help="tokens (rows of the activation)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-layer", action="store_true", help="skip the whole-decoder-layer benchmark")
    args = ap.parse_args(argv)

    from parity.fp8_gemm import scaled_mm_supported, verify_scaled_mm

    cuda = torch.cuda.is_available()
    if not cuda or not scaled_mm_supported("cuda"):
        where = torch.cuda.get_device_name() if cuda else "no CUDA device"
        print(f"FP8 GEMM not measured: it needs a CUDA GPU with torch's block-scaled FP8 GEMM "
              f"(SM 9.x, torch.nn.functional.scaled_mm); here: {where}.")
        print("The FP8 layer's path on CPU with the GEMM emulated (same quantization, cache and backward; "
              "times are not FP8 figures, the quantization counts are), small shape:")
        from parity import fp8_gemm as fg

        fg._GEMM = fg.fp8_gemm_emulated
        m, k, n = 256, 896, 896
        r = bench_linear(m, k, n, "cpu", "scaled_mm", iters=3)
        _report(f"LoRA linear M={m} K={k} N={n} (CPU, emulated GEMM)", r)
        return 0

    print(f"device: {torch.cuda.get_device_name()} (SM {'.'.join(map(str, torch.cuda.get_device_capability()))}), "
          f"torch {torch.__version__}; verify_scaled_mm relative error {verify_scaled_mm('cuda'):.2e}")
    for k, n in SHAPES:
        print(f"K={k} N={n} M={args.m}")
        _report("LoRA linear (r=16)", bench_linear(args.m, k, n, "cuda", "scaled_mm", args.iters))
        if not args.no_layer and k in LAYER_CONFIGS and LAYER_CONFIGS[k][0] == n:
            _report(f"decoder layer (hidden {k}, intermediate {n}, LoRA all-linear)",
                    bench_layer(args.m, k, "cuda", "scaled_mm", max(3, args.iters // 4)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
