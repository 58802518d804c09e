"""Rows of bench/gpu/gpu_check.py on the colocated teacher (issue 57 items 4 and 5), vLLM's CUDA build.

Each group runs in a child process (``python bench/gpu/gpu_rows_teacher.py GROUP OUT.jsonl MODEL_DIR``); both start
the teacher's engine as training does (``trainer.sampling.engines.start_vllm`` with
``trainer.lifecycle.teacher_memory.teacher_engine_options``), before the student's, as ``trainer/rl/loop.py`` does.
What they check is read from vLLM 0.32's source (rollout/vllm_workspace.py, trainer/lifecycle/teacher_memory.py);
neither has run on a GPU yet.

- group ``moe_teacher`` (item 4), on the zoo's small Qwen3-MoE as teacher and student: the teacher scores 8
  sequences; the student's engine starts as training starts it (CUDA graphs, sleep mode: its workspace locked
  after capture, in its cumem pool), generates, and sleeps (``release_memory``); the teacher scores the same
  sequences while the student sleeps, then the student generates again. Pass: no error ("Workspace is locked",
  an illegal memory access), each engine kept its own workspace manager and the student's is current between
  forwards, and the teacher's log-probs equal those before the student started (max |diff| <= 1e-6: the same
  eager engine on the same batch; 0 expected).
- group ``teacher_memory`` (item 5), on the Qwen2.5-0.5B-shaped model: the teacher's engine alone on the GPU. Pass:
  vLLM's config has the teacher's options (eager, no sleep mode / cumem, ``kv_cache_memory_bytes`` and the share
  ``teacher_engine_options`` gives), and the GPU memory its start took (free memory before and after) is at least
  what the capacity check counts for it (``TeacherMemory.engine``: weights + KV, a lower bound); the overhead
  (activations, the prompt-logits chunk, CUDA context) is printed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from gpu_rows_common import REPO, Row, child_main, child_rows, need_vllm_cuda, prompt_ids

from rollout.types import SamplingSpec

MOE_TEACHER_ROWS = ("MoE teacher scores beside a sleeping MoE student",)
TEACHER_MEMORY_ROWS = ("teacher engine: eager, own KV and share, counted",)
GiB = 2**30
SCORE_DIFF_LIMIT = 1e-6
MAX_LEN = 256


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _teacher(model_dir: str, work_dir: str):
    """(the teacher's engine as training starts it, its options, the recipe) for ``model_dir`` as the teacher."""
    # late: vLLM's engine and the trainer's modules load only where the rows run
    from trainer.lifecycle.capacity import gpu_total_bytes
    from trainer.lifecycle.preflight import load_recipe
    from trainer.lifecycle.teacher_memory import model_size, teacher_engine_options
    from trainer.sampling.engines import start_vllm

    cfg = load_recipe(REPO / "recipes" / "grpo_tiny.yaml", ["algorithm.name=opd", f"teacher.path={model_dir}"],
                      check_paths=False)
    options = teacher_engine_options(cfg, model_size(model_dir), max_model_len=MAX_LEN, cuda=True,
                                     gpu_total=gpu_total_bytes())
    engine = start_vllm(model_dir, precision="bf16", dtype="bfloat16", max_model_len=MAX_LEN, seed=0,
                        work_dir=work_dir, **options)
    return engine, options, cfg


def moe_teacher_group(emit, work_dir: str, model_dir: str) -> None:
    need_vllm_cuda()
    # late: as above
    from vllm.v1.worker import workspace

    from rollout.vllm_engine import VLLMEngine

    def beside_sleeping_student() -> str:
        teacher, _, _ = _teacher(model_dir, work_dir)
        student = None
        try:
            seqs = prompt_ids(8, length=24, seed=3)
            before = teacher.score(seqs).logprobs
            student = VLLMEngine(model_dir, max_model_len=MAX_LEN, kv_cache_memory_bytes=GiB,
                                 gpu_memory_utilization=0.3, enable_sleep_mode=True)  # graphs: the CUDA default
            spec = SamplingSpec(n=2, max_new_tokens=16, seed=0)
            student.generate(prompt_ids(4), spec)
            student.release_memory()  # asleep: its workspace unmapped, as when the loop's teacher scores
            after = teacher.score(seqs).logprobs
            current = workspace._manager
            again = student.generate(prompt_ids(4), spec)
            diff = max(abs(a - b) for ra, rb in zip(after, before) for a, b in zip(ra, rb))
            own = teacher._workspace is not None and student._workspace is not None and \
                teacher._workspace is not student._workspace
            figure = (f"Qwen3-MoE teacher and student: teacher log-probs with the student asleep vs before it "
                      f"started: max |diff| {diff:.1e} over {sum(map(len, after))} tokens; own workspaces {own}, "
                      f"the student's current between forwards {current is student._workspace}; the woken student "
                      f"generated {sum(map(len, again.completion_ids))} tokens")
            if not (diff <= SCORE_DIFF_LIMIT and own and current is student._workspace):
                raise AssertionError(f"{figure}; expected max |diff| <= {SCORE_DIFF_LIMIT}, own workspaces, the "
                                     "student's current")
            return figure
        finally:
            if student is not None:
                student.close()
            teacher.close()

    emit(MOE_TEACHER_ROWS[0], beside_sleeping_student)


def teacher_memory_group(emit, work_dir: str, model_dir: str) -> None:
    need_vllm_cuda()
    # late: as above
    from trainer.lifecycle.teacher_memory import model_size, teacher_memory

    def own_options_counted() -> str:
        free0 = _free()
        teacher, options, cfg = _teacher(model_dir, work_dir)
        try:
            taken = free0 - _free()
            c = teacher.llm.llm_engine.vllm_config
            made = {"enforce_eager": c.model_config.enforce_eager, "sleep": c.model_config.enable_sleep_mode,
                    "cumem": c.model_config.enable_cumem_allocator, "kv": c.cache_config.kv_cache_memory_bytes,
                    "share": c.cache_config.gpu_memory_utilization,
                    "batch": c.scheduler_config.max_num_batched_tokens}
            want = {"enforce_eager": True, "sleep": False, "cumem": False, "kv": options["kv_cache_memory_bytes"],
                    "share": options["gpu_memory_utilization"], "batch": options["max_num_batched_tokens"]}
            bound = teacher_memory(cfg, model_size(model_dir), max_model_len=MAX_LEN, cuda=True).engine
            figure = (f"Qwen2.5-0.5B shape as teacher: vLLM config {made}; its start took {taken / GiB:.2f} GiB, the "
                      f"capacity check counts {bound / GiB:.2f} GiB (weights + KV): overhead "
                      f"{(taken - bound) / GiB:+.2f} GiB")
            if made != want or taken < bound:
                raise AssertionError(f"{figure}; expected {want} and at least the counted bytes")
            return figure
        finally:
            teacher.close()

    emit(TEACHER_MEMORY_ROWS[0], own_options_counted)


GROUPS = {"moe_teacher": (MOE_TEACHER_ROWS, moe_teacher_group),
          "teacher_memory": (TEACHER_MEMORY_ROWS, teacher_memory_group)}


def moe_teacher_rows(moe: Callable[[], Path]) -> list[Row]:
    need_vllm_cuda()
    return child_rows(Path(__file__), "moe_teacher", MOE_TEACHER_ROWS, [str(moe())], cap_s=300)


def teacher_memory_rows(shaped: Callable[[], Path]) -> list[Row]:
    need_vllm_cuda()
    return child_rows(Path(__file__), "teacher_memory", TEACHER_MEMORY_ROWS, [str(shaped())], cap_s=180)


if __name__ == "__main__":
    child_main(GROUPS)
