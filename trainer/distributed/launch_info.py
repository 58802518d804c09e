"""What a launch runs on, in one console line, and the launch that asked for N processes but got one.

``accelerate launch --num_processes N`` without a multi-process config or flag runs accelerate's
"simple launcher" on a machine without several GPUs: ONE process, exit status 0
(``accelerate/commands/launch.py``: ``_validate_launch_command`` turns on ``multi_gpu`` only from a config
file's ``distributed_type`` or when more than one CUDA device is visible; ``launch_command`` then picks
``simple_launcher``). That launcher still exports ``MASTER_ADDR``/``MASTER_PORT`` when N > 1
(``accelerate/utils/launch.py: prepare_simple_launcher_cmd_env``) and never ``WORLD_SIZE``, which is
what ``launch_mismatch`` reads. ``recipes/accelerate/ddp.yaml`` (``distributed_type: MULTI_GPU``) makes
accelerate start N processes through torchrun, on CPU (gloo) as on GPUs.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping, Optional

import torch

from trainer.config import RunConfig

__all__ = ["describe_launch", "launch_lines", "launch_mismatch", "requested_processes"]

FIX = ("add `--config_file recipes/accelerate/ddp.yaml` to `accelerate launch`, "
       "or run `torchrun --nproc_per_node N -m trainer.train <recipe>` (docs/scale-out.md)")


def device_text(device: torch.device) -> str:
    """'cpu', or 'cuda:0 (NVIDIA H100 80GB HBM3)'."""
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return device.type  # 'cpu' (several processes share it: accelerate names it cpu:0 in each)


def describe_launch(*, world: int, backend: Optional[str], device: str, dtype: str, precision: Optional[str] = None,
                    engine: Optional[str] = None) -> str:
    """The launch line: processes (world size), process-group backend, this rank's device, dtype, and for RL the
    precision recipe and the rollout engine."""
    procs = f"{world} process{'es' if world != 1 else ''}"
    where = device if world == 1 or device == "cpu" else f"{device} on rank 0, one device per process"
    rl = (f", precision.recipe {precision}" if precision else "") + (f", engine {engine}" if engine else "")
    return f"launch: {procs} (backend {backend or 'none'}) on {where}; model.dtype {dtype}{rl}"


def current_backend() -> Optional[str]:
    d = torch.distributed
    return str(d.get_backend()) if d.is_available() and d.is_initialized() else None


def requested_processes(cmdline: list[str]) -> Optional[int]:
    """N from an ``accelerate launch ... --num_processes N`` command line (also ``--num_processes=N``), else None."""
    for i, arg in enumerate(cmdline):
        m = re.fullmatch(r"--num[_-]processes(?:=(\d+))?", arg)
        if m:
            value = m.group(1) or (cmdline[i + 1] if i + 1 < len(cmdline) else "")
            return int(value) if value.isdigit() else None
    return None


def _parent_cmdline() -> list[str]:
    try:  # Linux; elsewhere the warning just cannot name N
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def launch_mismatch(world: int, env: Mapping[str, str] | None = None,
                    parent_cmdline: list[str] | None = None) -> Optional[str]:
    """A warning when ``accelerate launch`` was asked for several processes and started this one alone, else None."""
    env = os.environ if env is None else env
    if world != 1 or "WORLD_SIZE" in env or "ACCELERATE_USE_CPU" not in env or "MASTER_ADDR" not in env:
        return None
    cmdline = _parent_cmdline() if parent_cmdline is None else parent_cmdline
    n = requested_processes(cmdline)
    if (n is not None and n <= 1) or (n is None and cmdline):  # MASTER_ADDR from the environment, not accelerate
        return None
    asked = f"--num_processes {n}" if n else "several processes"
    return (f"warning: accelerate launch was asked for {asked} but started 1 (its simple launcher: no "
            f"multi-process config or flag, and not several GPUs); this run trains in one process. To get N: {FIX}")


def launch_lines(cfg: RunConfig, world: int, device: torch.device, dtype_reason: Optional[str] = None,
                 threads: Optional[str] = None) -> str:
    """What this launch runs on, in one line (and a second if a launch of N started one process). ``dtype_reason``:
    the precision recipe's own account of the dtype, said beside it ("model.dtype float32, precision.recipe bf16"
    alone reads as a contradiction; the bf16 recipe is "both phases run in model.dtype"). ``threads``: what
    ``apply_cpu_threads`` set."""
    r = cfg.rollout
    engine = f"vllm server {r.server_url}" if r.mode == "server" else f"{r.engine} (colocated)"
    line = describe_launch(world=world, backend=current_backend(), device=device_text(device), dtype=cfg.model.dtype,
                           precision=cfg.precision.recipe + (f" ({dtype_reason})" if dtype_reason else ""),
                           engine=engine) + (f"; {threads}" if threads else "")
    mismatch = launch_mismatch(world)
    return f"{line}\n{mismatch}" if mismatch else line
