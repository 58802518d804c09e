"""The AMX tile permission of the process a CPU engine runs in, asked for before vLLM's first half-precision GEMM.

Linux gives a process AMX tiles only after it asks (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); a
tile instruction before that is an illegal instruction, and the process dies with SIGILL. PyTorch asks inside its
brgemm (``at::native::cpublas::brgemm``; ``torch.cpu._init_amx`` is the same request), and so does oneDNN. vLLM's
CPU build picks AMX kernels for bf16 on such a CPU (its ``amx`` attention backend, ``vllm/v1/attention/backends/
cpu_attn.py``; SGLang's GEMM for small linears, ``vllm/model_executor/layers/utils.py`` ``check_cpu_sgl_kernel``),
and that GEMM calls PyTorch's brgemm only for more than 4 rows (``can_use_brgemm<at::BFloat16>``: ``M > 4``,
``csrc/cpu/sgl-kernels/gemm.h``). So an engine whose first forward has 1-4 tokens can reach a tile instruction
before anything asked -- our reading of the SIGILL seen with a bf16 engine and a 1-4-token prompt on an AMX host,
where a longer first prompt made later short ones safe. Asking once when the engine starts removes the order; on a
CPU without AMX tiles nothing is asked.

Read from vLLM 0.32's, SGLang's and PyTorch's source; not reproduced here (the CPUs this project's CI runs on have no
AMX): ``tests/rollout/test_cpu_amx.py`` runs a 1-token bf16 prompt first where the host has AMX.
"""
from __future__ import annotations

import torch


def request_amx_permission() -> bool:
    """Ask the kernel for this process's AMX tiles where the CPU has them: True when granted (or already held)."""
    if not torch.cpu._is_amx_tile_supported():
        return False
    return bool(torch.cpu._init_amx())
