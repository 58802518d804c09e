"""Worker for tests/trainer/distributed/test_data_parallel.py, launched with ``torchrun --nproc_per_node 2``.

Several recipes trained in turn by the same two ranks: each run is ``trainer.rl.loop.train`` on its recipe and
``--set`` overrides, as ``-m trainer.train`` runs it, on an engine this rank starts once -- started as the test
session's shared engine (tests/conftest.py ``vllm_engine``), which the single-process references run on. The
launch's start-up (torch, Transformers and vLLM imported, an engine started in each rank: ~30 s of a two-rank run
on 2 cores) is then paid once for every two-rank comparison of the test file. ``train`` syncs the engine to its
own policy when it starts, so no run samples with another's weights. The CLI's own launch of one recipe under
torchrun, its engine started by the run, is tests/trainer/distributed/test_zero_training.py's and
tests/rollout/test_server_engine.py's.
Usage: torchrun --nproc_per_node 2 dp_runs_worker.py <runs.json>, a JSON list of [recipe.yaml, [key=value, ...]]
"""
import json
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from worker_exit import finish  # this script's folder is on sys.path

import trainer.rl.loop as loop
from rollout.vllm_engine import VLLMEngine
from trainer.builtin.resolve import resolve_model_path
from trainer.distributed.deepspeed import accelerator_kwargs
from trainer.lifecycle.preflight import load_recipe
from trainer.sampling.engines import lora_target_leaves


def train_after_the_others_checked(cfg, engine, rank: int, world: int) -> None:
    """``train(cfg, engine=engine)`` on every rank, rank 0 starting once the others have checked the run directory.

    ``train`` checks the directory on every rank (``check_run_dir``: refused while a live process holds its lock),
    then rank 0 claims it. In a launch of one run the process group's rendezvous orders the two: no rank claims
    before every rank has joined, after its own check. Here the group exists already, so the other ranks say when
    their check is done (a file next to the run directory) and rank 0 waits for it."""
    checked = [Path(f"{cfg.run_dir}.checked.{r}") for r in range(1, world)]
    if rank:
        check = loop.check_run_dir

        def check_then_say(*args, **kwargs):
            check(*args, **kwargs)
            checked[rank - 1].touch()

        loop.check_run_dir = check_then_say
        try:
            loop.train(cfg, engine=engine)
        finally:
            loop.check_run_dir = check
        return
    deadline = time.monotonic() + 600
    while not all(p.exists() for p in checked):
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks 1..{world - 1} did not check {cfg.run_dir} within 600 s")
        time.sleep(0.05)
    loop.train(cfg, engine=engine)


def main() -> None:
    runs = json.loads(Path(sys.argv[1]).read_text())
    # the process group first, as train() makes it before its engine starts
    Accelerator(**accelerator_kwargs())
    model_dir = str(resolve_model_path("builtin:tiny"))
    cfg = load_recipe(runs[0][0], runs[0][1])
    engine = VLLMEngine(model_dir, dtype="bfloat16", max_model_len=128, seed=0, kv_cache_memory_bytes=256 * 1024**2,
                        enforce_eager=True, max_lora_rank=cfg.model.lora.r,
                        lora_target_modules=lora_target_leaves(cfg, model_dir), sampling_supports=True)
    try:
        for recipe, sets in runs:
            train_after_the_others_checked(load_recipe(recipe, sets), engine, torch.distributed.get_rank(),
                                           torch.distributed.get_world_size())
    finally:
        engine.close()


if __name__ == "__main__":
    main()
    finish()  # both ranks leave together, then end without the interpreter's teardown (worker_exit.py says why)
