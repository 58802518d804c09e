"""Every Triton kernel the product can launch compiles for a Hopper GPU (sm_90), here, on a CPU.

Triton compiles for a ``GPUTarget`` without a GPU (its bundled ptxas makes the cubin), so a kernel that would
fail to compile, or whose compile grows with a problem size, shows up in CI instead of on a user's first CUDA
run: a kernel specialised on the number of gathered ids takes 127 s at k = 512 and does not finish at the
vocabulary size, which the architecture probe asks for at every model load. Each kernel's specialisation
arguments (``tl.constexpr``) must be flags or tile sizes from a fixed list, never a shape of the data, and each
compile must stay under ``COMPILE_SECONDS``. The registers and spills of every variant are printed (``pytest
-s``; ``cuobjdump --dump-resource-usage``, also bundled), not asserted: they are for reading, since only a
GPU run says whether a spill costs time.
"""
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import parity.fp8_triton as ft  # noqa: E402
import parity.logprobs_triton as lt  # noqa: E402

pytestmark = pytest.mark.skipif(not isinstance(lt._forward_kernel, JITFunction),
                                reason="kernels defined under TRITON_INTERPRET=1 cannot be compiled for a GPU")

HOPPER = GPUTarget("cuda", 90, 32)
COMPILE_SECONDS = 60
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

# Specialisation arguments the kernels may have: boolean features and tile sizes, nothing that follows the data.
FLAGS = {"HAS_BIAS", "HAS_CAP", "WANT_T", "HAS_TARGET", "HAS_ENT", "STORE_F32"}
TILES = {"BLOCK_M", "BLOCK_V", "BLOCK_K", "BLOCK", "GROUP", "PRECISION"}

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
INPUT_POINTERS = {"h_ptr", "w_ptr", "b_ptr", "z_ptr", "x_ptr"}
FLOAT_SCALARS = {"mult", "cap", "inv_fp8_max", "eps", "fp8_max"}


def _signature(kernel, dtype: torch.dtype) -> dict:
    """Argument types as a launch passes them: inputs in ``dtype``, ids int32, statistics float32, FP8 codes."""
    sig = {}
    for p in kernel.params:
        name = p.name
        if p.is_constexpr:
            sig[name] = "constexpr"
        elif name in INPUT_POINTERS:
            sig[name] = "*" + DTYPES[dtype]
        elif name == "tgt_ptr":
            sig[name] = "*i32"
        elif name == "q_ptr":
            sig[name] = "*fp8e4nv"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32"
        else:
            sig[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    return sig


def _tiles(kernel, dtype):
    t = lt.tiles_for(torch.device("cuda"), dtype)
    if kernel is lt._forward_kernel:
        return dict(BLOCK_M=t.block_m, BLOCK_V=t.block_v, BLOCK_K=t.block_k, PRECISION=lt._precision(dtype)), \
            dict(num_warps=t.num_warps, num_stages=t.num_stages)
    if kernel is ft._act_quant_kernel:
        return dict(GROUP=ft.BLOCK, BLOCK_M=ft.BLOCK_M), dict()
    return dict(BLOCK=lt.ROW_BLOCK), dict(num_warps=lt.ROW_WARPS)


def _variants():
    """(kernel, dtype, flags): every flag off, every flag on, in each dtype; each flag alone in bf16."""
    out = []
    for kernel in (lt._forward_kernel, lt._row_grad_kernel, lt._row_backward_kernel, ft._act_quant_kernel):
        flags = [p.name for p in kernel.params if p.is_constexpr and p.name in FLAGS and p.name != "STORE_F32"]
        for dtype in DTYPES:
            for on in ((False, True) if flags else (False,)):
                out.append((kernel, dtype, {f: on for f in flags}))
        for f in flags:
            out.append((kernel, torch.bfloat16, {g: g == f for g in flags}))
    return out


def _resources(cubin: bytes, tmp_path) -> str:
    path = tmp_path / "kernel.cubin"
    path.write_bytes(cubin)
    out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(path)], capture_output=True, text=True)
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out.stdout)
    return "REG {} STACK {} SHARED {} LOCAL {}".format(*found.groups()) if found else out.stdout.strip()[-200:]


@pytest.mark.parametrize("kernel", [lt._forward_kernel, lt._row_grad_kernel, lt._row_backward_kernel,
                                    ft._act_quant_kernel], ids=lambda k: k.__name__)
def test_specialisation_arguments_are_flags_and_tiles(kernel):
    constexprs = {p.name for p in kernel.params if p.is_constexpr}
    assert constexprs <= FLAGS | TILES, constexprs - FLAGS - TILES


@pytest.mark.parametrize("kernel, dtype, flags", _variants(),
                         ids=lambda x: "+".join(k for k, v in x.items() if v) or "plain" if isinstance(x, dict)
                         else getattr(x, "__name__", None) or DTYPES[x])
def test_every_kernel_variant_compiles_for_sm90(kernel, dtype, flags, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))  # a real compile, not a cached cubin
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"))
    tiles, options = _tiles(kernel, dtype)
    constexprs = dict(tiles, **flags)
    if "STORE_F32" in [p.name for p in kernel.params]:
        constexprs["STORE_F32"] = False  # the GPU stores float8; float32 stores are the interpreter's
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(kernel, _signature(kernel, dtype), constexprs=constexprs), target=HOPPER,
                              options=options)
    seconds = time.perf_counter() - start
    with capsys.disabled():
        on = "+".join(k for k, v in flags.items() if v) or "plain"
        print(f"\n  {kernel.__name__} {DTYPES[dtype]} {on}: {_resources(compiled.asm['cubin'], tmp_path)}, "
              f"compiled in {seconds:.1f} s")
    assert compiled.asm["cubin"]
    assert seconds < COMPILE_SECONDS


def test_a_kernel_specialised_on_a_count_is_caught():
    # The guard above, shown on a gather kernel unrolled per id: a constexpr named for a data size fails it.
    @triton.jit
    def unrolled(x_ptr, N_IDS: triton.language.constexpr):
        for j in triton.language.static_range(N_IDS):
            triton.language.store(x_ptr + j, 0.0)

    constexprs = {p.name for p in unrolled.params if p.is_constexpr}
    assert not constexprs <= FLAGS | TILES


def test_variant_list_covers_every_flag():
    seen = {(k.__name__, f) for k, _, flags in _variants() for f, on in flags.items() if on}
    for kernel in (lt._forward_kernel, lt._row_grad_kernel, lt._row_backward_kernel):
        for p in kernel.params:
            if p.is_constexpr and p.name in FLAGS:
                assert (kernel.__name__, p.name) in seen
    assert len(_variants()) >= 20
