"""What bench/gpu/gpu_check.py and its row modules (bench/gpu/gpu_rows_*.py) share: a row, its skip, the time budget, the
processes a row starts, and the models the rows run on.

A row is ``(check, status, figure)``: status "pass", "FAIL" or "skipped" (the figure then says why). Nothing is
estimated: a figure is measured in the run, or the row has none.

Rows that start a vLLM engine run in a child process of their own (``child_rows`` runs one group of them:
``python bench/gpu/gpu_rows_<x>.py GROUP OUT.jsonl ARGS...``, one JSON line per row, written as each row ends): a CUDA
error poisons the process that hit it, the budget can stop a child, and an engine that hangs costs its group only.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trainer.builtin.zoo import build_arch_model  # noqa: E402 - after the repository is on sys.path

# Qwen2.5-0.5B's decoder shape (its config.json), random init: the rows' "real" shape. Every FP8-target matrix is
# 128-divisible (hidden 896 = 7 x 128, 2 KV heads x 64 = 128 rows, intermediate 4864 = 38 x 128): vLLM's CUDA
# block-FP8 layers run it (rollout.fp8_weights.check_cuda_block_shapes), unlike the built-in tiny model.
QWEN05_SHAPE = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                    rope_theta=1e6, tie_word_embeddings=True)
# The zoo's sizes made 128-divisible (hidden 128, head_dim 64, MoE experts 128 wide), as the CPU tests of the
# written FP8 checkpoint use (tests/rollout/test_fp8_quant.py BLOCK_SIZES, MOE_SIZES).
BLOCK_SHAPE = dict(hidden_size=128, intermediate_size=256, head_dim=64, num_attention_heads=2, num_key_value_heads=2,
                   moe_intermediate_size=128, shared_expert_intermediate_size=256)
KV_BYTES = 1024**3  # the KV cache of the rows' engines on the Qwen shape

Row = tuple[str, str, str]  # (check, status, figure)


class Skip(Exception):
    """The check cannot run here; the message says why."""


class Budget:
    """The wall-clock seconds the whole check may take (``--budget-s``); rows not started in time are skipped."""

    def __init__(self, seconds: float = math.inf) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


BUDGET = Budget()  # gpu_check.main replaces it with the command line's


def need_cuda(what: str = "") -> torch.device:
    if not torch.cuda.is_available():
        raise Skip(f"needs a CUDA GPU{what}")
    return torch.device("cuda")


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def need_gpus(n: int, why: str) -> int:
    """The number of visible GPUs, at least ``n``; else Skip naming both and ``why``."""
    count = gpu_count()
    if count < n:
        raise Skip(f"needs {n} CUDA GPUs ({count} visible): {why}")
    return count


def need_vllm_cuda() -> None:
    """Skip unless vLLM's CUDA build is importable here (every such skip says "needs vLLM's CUDA build")."""
    need_cuda(" and vLLM's CUDA build")
    if importlib.util.find_spec("vllm") is None:
        raise Skip("needs vLLM's CUDA build: vLLM is not installed (pip install vllm)")
    try:
        # late: vLLM takes seconds to import, and only these rows need it
        from vllm.platforms import current_platform
    except Exception as e:  # a broken install: say what it is
        raise Skip(f"needs vLLM's CUDA build: vLLM does not import: {type(e).__name__}: {e}") from None
    if not current_platform.is_cuda():
        raise Skip(f"needs vLLM's CUDA build: the installed vLLM's platform is {current_platform.device_type!r}")


def run_check(name: str, fn: Callable[[], str]) -> Row:
    """``fn()``'s figure as a passing row; Skip -> skipped; any other exception -> FAIL (the run goes on)."""
    t0 = time.perf_counter()
    print(f"... {name}", file=sys.stderr, flush=True)
    try:
        figure = fn()
    except Skip as e:
        return name, "skipped", str(e)
    except Exception as e:  # a failed check is a row, not the end of the run
        traceback.print_exc(file=sys.stderr)
        return name, "FAIL", f"{type(e).__name__}: {e}"[:400]
    return name, "pass", f"{figure} [{time.perf_counter() - t0:.0f} s]"


# ---------------------------------------------------------------- processes


def child_env(**extra: str) -> dict:
    """The environment of a child process: this one's, offline, with the checkout first on PYTHONPATH and what was
    on it kept behind (a machine whose packages sit in a PYTHONPATH folder, such as wheels unpacked beside the
    image's Python, loses them if it is replaced)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", **extra}


def run_process(cmd: Sequence[str], *, cap_s: float, what: str, env: Optional[dict] = None,
                cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``cmd`` in its own process group, for at most ``cap_s`` seconds or what the budget has left.

    Past ``cap_s``: AssertionError (a hang is a failure). Stopped by the budget first: Skip, saying so."""
    timeout = min(cap_s, BUDGET.left())
    if timeout < 5:
        raise Skip(f"time budget spent (--budget-s {BUDGET.seconds:.0f}); run it alone with --only")
    env = {**child_env(), "WANDB_MODE": "disabled", **(env or {})}
    env.pop("WANDB_API_KEY", None)
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this call started, vLLM's workers included
        out, err = proc.communicate()
        if timeout < cap_s:
            raise Skip(f"stopped at the time budget after {timeout:.0f} s (--budget-s {BUDGET.seconds:.0f}); "
                       "run it alone with --only") from None
        raise AssertionError(f"{what}: no end after {cap_s:.0f} s, killed; last line: "
                             f"{tail(subprocess.CompletedProcess(cmd, -9, out, err))}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop_server_group(server: subprocess.Popen, log) -> None:
    """End a server a row started in its own process group (the server and its engine workers), then its log."""
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    log.close()


def tail(proc: subprocess.CompletedProcess) -> str:
    """The last line of the process's stderr (where a failure is said), else of its stdout."""
    for text in (proc.stderr, proc.stdout):
        lines = [x for x in (text or "").strip().splitlines() if x.strip()]
        if lines:
            return lines[-1][:300]
    return f"exit {proc.returncode}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(recipe: str, sets: list[str], run_root: Path, cap_s: float, env: Optional[dict] = None
          ) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """``parityrl train`` in a subprocess (wandb off, run directory under ``run_root``): (process, metric rows of
    steps >= 1, in order)."""
    sets = [*sets, "logging.wandb.mode=disabled", f"logging.run_dir={run_root}/{{name}}", "checkpoint.every=0"]
    cmd = [sys.executable, "-m", "trainer", "train", str(REPO / "recipes" / recipe)]
    for s in sets:
        cmd += ["--set", s]
    proc = run_process(cmd, cap_s=cap_s, what=f"parityrl train {recipe}", env=env)
    rows = []
    for path in sorted(run_root.glob("*/metrics.jsonl")):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] >= 1:
                rows.append(row)
    return proc, rows


# ---------------------------------------------------------------- groups of rows in a child process


def child_rows(script: Path, group: str, names: Sequence[str], args: Sequence[str], cap_s: float) -> list[Row]:
    """Run ``script``'s ``group`` in a child process (``child_main``); its rows, in ``names``' order. A row the
    child did not reach says why: the budget, the cap, or how the child ended."""
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{group}_") as tmp:
        out = Path(tmp) / "rows.jsonl"
        ended: Optional[tuple[str, str]] = None
        try:
            proc = run_process([sys.executable, str(script), group, str(out), *args], cap_s=cap_s,
                               what=f"{script.name} {group}")
            if proc.returncode != 0:
                ended = ("FAIL", f"its process ended with exit {proc.returncode} before this row: {tail(proc)}")
        except Skip as e:
            ended = ("skipped", str(e))
        except AssertionError as e:
            ended = ("FAIL", str(e))
        got = {}
        if out.is_file():
            for line in out.read_text().splitlines():
                r = json.loads(line)
                got[r["check"]] = (r["check"], r["status"], r["figure"])
    missing = ended or ("FAIL", f"its process ended without this row: {tail(proc)}")
    return [got.get(n, (n, *missing)) for n in names]


def child_main(groups: dict[str, tuple[Sequence[str], Callable[..., None]]]) -> None:
    """The child side of ``child_rows``: ``argv = GROUP OUT.jsonl ARGS...``. ``groups[GROUP] = (names, body)``;
    ``body(emit, work_dir, *ARGS)`` calls ``emit(name, fn)`` for each row (``run_check``); a Skip or error raised by
    the body itself marks the rows it did not reach. ``work_dir``: a new directory beside OUT.jsonl (the parent
    removes both). Ends with os._exit: an in-process vLLM engine's threads must not hold the exit once the rows are
    written."""
    group, out, args = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    names, body = groups[group]
    work_dir = out.parent / "work"
    work_dir.mkdir(exist_ok=True)
    done: list[str] = []

    def write(row: Row) -> None:
        with out.open("a") as f:
            f.write(json.dumps({"check": row[0], "status": row[1], "figure": row[2]}) + "\n")
        done.append(row[0])

    def emit(name: str, fn: Callable[[], str]) -> Row:
        if name not in names:
            raise ValueError(f"{group}: row {name!r} is not one of {list(names)}")
        row = run_check(name, fn)
        write(row)
        return row

    status, figure = "FAIL", "the group ended without this row"
    try:
        body(emit, str(work_dir), *args)
    except Skip as e:
        status, figure = "skipped", str(e)
    except Exception as e:  # noqa: BLE001 - the rows not reached say what stopped them
        traceback.print_exc(file=sys.stderr)
        figure = f"{type(e).__name__}: {e}"[:400]
    for name in names:
        if name not in done:
            write((name, status, figure))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- models


def build_shaped_model(out: Path, shape: dict, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A random-init Qwen2 of ``shape`` in ``out`` with the built-in tiny tokenizer (its 512 ids are a
    subset of the vocabulary; ids above them decode to nothing, which the reward reads as a wrong answer)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from trainer.builtin.tiny import build_tokenizer

    tok = build_tokenizer(512, shape["max_position_embeddings"])
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape, **ids)).to(dtype)
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_block_zoo_model(arch: str, out: Path) -> Path:
    """The zoo's ``arch`` (trainer.builtin.zoo) at ``BLOCK_SHAPE``, saved in bfloat16 with its tokenizer."""
    model, tok = build_arch_model(arch, overrides=BLOCK_SHAPE)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def prompts_file(out: Path, n: int = 16) -> Path:
    """``n`` arithmetic prompts, one per line (a ``parityrl compare`` prompt file)."""
    lines = [f"What is {3 + 7 * i} plus {11 + 5 * i}?" for i in range(n)]
    out.write_text("\n".join(lines) + "\n")
    return out


def prompt_ids(n: int, length: int = 12, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` random ids of the built-in tiny tokenizer (3..511: no special id)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n, length), generator=g).tolist()


def lora_policy(model_dir, device: torch.device, seed: int = 0, dtype: str = "bfloat16"):
    """The trainer's policy on ``model_dir`` (``add_lora``, every decoder linear) with adapters drawn so that each
    merged update W + s*B*A moves W by about W's own spread: an engine still holding W is told apart by O(0.1) and
    more in log-prob, while one holding the update agrees to the dtype's rounding."""
    # late: Transformers and PEFT take seconds to import; only the GPU rows build a policy
    from trainer.config.schema import LoraConfig
    from trainer.models.policy import add_lora, load_base_model

    policy = add_lora(load_base_model(str(model_dir), dtype, device), LoraConfig(r=8, alpha=16))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in policy.modules():
            a, b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
            if not (isinstance(a, torch.nn.ModuleDict) and "default" in a):
                continue
            spread = module.base_layer.weight.float().std().item()
            wa, wb = a["default"].weight, b["default"].weight
            wa.copy_(torch.randn(wa.shape, generator=g) / wa.shape[0] ** 0.5)  # var(s*B@A) = spread^2
            wb.copy_(torch.randn(wb.shape, generator=g) * spread / module.scaling["default"])
    return policy.eval()


def engine_mae(rollouts, policy, pad_id: int, device: torch.device) -> float:
    """parity/mae of the engine's sampled log-probs against the trainer's scoring of the same tokens (T = 1)."""
    # late: as lora_policy
    from parity.metrics import compare
    from trainer.measurement.scoring import score_batch
    from trainer.models.batch import batch_from_rollouts

    batch = batch_from_rollouts(rollouts, pad_id, device)
    scores = score_batch(policy, batch, micro_batch_size=16, temperature=1.0)
    mask = batch.mask.cpu() > 0
    return float(compare(scores.logprobs.float().cpu() * mask, batch.rollout_logprobs.cpu(), mask)["parity/mae"])
