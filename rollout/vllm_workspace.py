"""Each in-process vLLM engine's own scratch workspace, when two engines share the process (a colocated teacher).

vLLM keeps one workspace manager per process (``vllm/v1/worker/workspace.py``: the module global ``_manager``).
Every CUDA worker makes a new one as it starts (``gpu_worker.py: _init_workspace_and_model_runner`` ->
``init_workspace_manager``, which replaces the global with a warning), and every kernel that needs scratch asks for
the current one at call time: the fused-MoE forward (``fused_moe/modular_kernel.py``: ``current_workspace_manager()
.get_simultaneous``; the CPU platform skips it and allocates its own), MLA / sparse attention backends. Model Runner
V2 locks the manager after capturing CUDA graphs (``v1/worker/gpu/model_runner.py: capture_model``: "A resize after
capture frees the static cuda graph buffer"), and under sleep mode the scratch lives in the engine's cumem pool
(tag ``workspace``, unmapped while it sleeps).

With two engines in one process (the teacher starts before the student: ``trainer/rl/loop.py: setup``) the second
engine's manager replaces the first's, so the first engine's forwards use the second's:

- a locked manager smaller than the first engine's need raises "Workspace is locked but allocation ... requires";
- the first engine's own buffer loses its last reference and is freed, while CUDA graphs it captured still write
  into that memory;
- the student sleeps between its rollout and the update, exactly when the teacher scores (``loop.py``): a teacher
  forward then writes into the student's unmapped scratch.

The engine therefore keeps the manager its worker made (``engine_workspace``, read right after ``vllm.LLM`` is
built, in-process) and makes it vLLM's current one for the length of each of its forwards (``using_workspace``;
``guard_generate`` wraps ``LLM.generate``, the one entry point through which parityrl's engines run the model). Each
engine then reads and grows only its own scratch, in its own pool, and its graphs' buffer lives as long as it does.
CPU engines make no manager (``cpu_worker.py`` builds its runner without one): nothing to keep there.
"""
from __future__ import annotations

import contextlib
import functools


def engine_workspace():
    """The workspace manager vLLM's worker made for the engine just built in this process (None: none made, as on
    CPU). Read right after ``vllm.LLM(...)`` returns: the next engine's start replaces it."""
    from vllm.v1.worker import workspace  # late: vLLM is imported once the engine's environment is set

    return workspace._manager


@contextlib.contextmanager
def using_workspace(manager):
    """``manager`` as vLLM's current workspace manager inside the block, the previous one after it; nothing done
    for None (an engine that made none)."""
    if manager is None:
        yield
        return
    from vllm.v1.worker import workspace  # late: as above

    previous, workspace._manager = workspace._manager, manager
    try:
        yield
    finally:
        workspace._manager = previous


def guard_generate(llm, manager) -> None:
    """``llm.generate`` made to run under ``manager`` (``using_workspace``): every caller of this engine's
    ``generate`` (rollouts, scoring, the doctor's legs) gets the engine's own scratch."""
    if manager is None:
        return
    generate = llm.generate

    @functools.wraps(generate)
    def guarded(*args, **kwargs):
        with using_workspace(manager):
            return generate(*args, **kwargs)

    llm.generate = guarded
