"""The damaged-checkpoint corpus: what a resume does with a checkpoint broken thirteen ways (fourteen when not root).

    PYTHONPATH=<checkout> python bench/checks/damaged_checkpoints.py --work /tmp/corpus

In one process, with the checkout on PYTHONPATH: the tiny model's LoRA policy, its optimizer and
schedule are saved as checkpoints 1 and 2 by that checkout's ``save_checkpoint``; then for each
damage a copy of the run has ``step_000002`` broken and goes through that checkout's own
``trainer.rl.loop._restore`` (what ``parityrl train --resume`` runs before any step; no engine,
so a damage that loads is reported as loaded, whatever the engine would later make of it).
A run resumed from step 1 then writes its retrained step 2 over the damaged one, as the
training loop would. The outcome is classified as `parityrl train` would show it:

  clean      resumed from step 1 and the output names step_000002 as skipped, or a one-line
             exit 2 (FileNotFoundError / FileExistsError, trainer/commands/train.py)
  raw-os-error  a one-line exit 2 that is a bare "[Errno 2] No such file" about one file
  traceback  any other exception: a raw traceback reaches the user
  silent     resumed from step 1 (older) without a word about step_000002
  loaded     resumed from the damaged step 2 itself
  save-fails resumed, but writing the retrained step 2 over the damaged one raised

The folder made unreadable (chmod 000) is only in the corpus when not run as root (root reads it anyway).

Prints one row per damage and the tally.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]


def _weights(ck: Path) -> Path:
    return next((ck / "adapter").glob("adapter_model.*"))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _empty(p: Path) -> None:
    p.write_bytes(b"")


def _random(p: Path) -> None:
    p.write_bytes(os.urandom(p.stat().st_size))


def _replace_by_file(ck: Path) -> None:
    shutil.rmtree(ck)
    ck.write_text("not a checkpoint")


def _replace_by_link_to_itself(ck: Path) -> None:
    shutil.rmtree(ck)
    os.symlink(ck.name, ck)


def _state_of_step_1(ck: Path) -> None:
    """state.json says step 1 and the manifest is recomputed to match: only the step tells."""
    import json

    from trainer.io import checkpoint as ckpt  # late: the checkout under test, from PYTHONPATH

    state = json.loads((ck / "state.json").read_text())
    (ck / "state.json").write_text(json.dumps({**state, "step": 1}))
    (ck / "manifest.json").write_text(json.dumps(ckpt._manifest(ck)))


DAMAGES = {
    "weights_truncated": lambda ck: _truncate(_weights(ck)),
    "weights_emptied": lambda ck: _empty(_weights(ck)),
    "weights_random_bytes": lambda ck: _random(_weights(ck)),
    "optimizer_missing": lambda ck: (ck / "optimizer.pt").unlink(),
    "optimizer_random_bytes": lambda ck: _random(ck / "optimizer.pt"),
    "scheduler_missing": lambda ck: (ck / "scheduler.pt").unlink(),
    "rng_missing": lambda ck: (ck / "rng.pt").unlink(),
    "state_unreadable": lambda ck: (ck / "state.json").write_bytes(b"\x00{not json"),
    "state_missing": lambda ck: (ck / "state.json").unlink(),
    "adapter_config_missing": lambda ck: (ck / "adapter" / "adapter_config.json").unlink(),
    "step_replaced_by_file": _replace_by_file,
    "step_symlink_to_itself": _replace_by_link_to_itself,
    "state_of_another_step": _state_of_step_1,
}
if os.geteuid() != 0:
    DAMAGES["folder_unreadable"] = lambda ck: ck.chmod(0)


def _policy(cfg):
    import torch

    from trainer.builtin.resolve import resolve_model_path
    from trainer.models.optim import make_scheduler
    from trainer.models.policy import add_lora, load_base_model

    model = add_lora(load_base_model(resolve_model_path(cfg.model.path), cfg.model.dtype, "cpu"), cfg.model.lora)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.train.learning_rate)
    return model, opt, make_scheduler(opt, "constant", 0, 10)


class _NotDamaged:
    """The run's parts whose checkpointed state this corpus leaves alone (probe, parity limit, prefetch)."""

    def load_state_dict(self, state) -> None:
        pass


def _run(cfg, model, opt, sched):
    from trainer.data.datasets import PromptBatcher
    from trainer.distributed.data_parallel import DataParallel

    batcher = PromptBatcher([{"prompt": str(i)} for i in range(8)], 2)
    return SimpleNamespace(cfg=cfg, stage=0, policy=model, optimizer=opt, scheduler=sched, modules={},
                           kl_controller=None, batcher=batcher, is_main=True, accelerator=None, dp=DataParallel(),
                           probe=_NotDamaged(), ratio_limit=_NotDamaged(), prefetch=_NotDamaged())


def _save(cfg, run, step):
    from trainer.io import checkpoint as ckpt

    for p in run.optimizer.param_groups[0]["params"]:  # a real optimizer state: one step on a fake gradient
        p.grad = p.detach().clone().normal_() * 1e-3
    run.optimizer.step()
    ckpt.save_checkpoint(cfg.run_dir, step, model=run.policy, optimizer=run.optimizer, scheduler=run.scheduler,
                         state={"batcher": run.batcher.state_dict(), "name": cfg.name}, keep_last=2)


def classify(run, cfg) -> tuple[str, str]:
    from trainer.rl.loop import _restore

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            step = _restore(run)
    except (FileNotFoundError, FileExistsError) as e:
        # one line, but a bare OS error about one file is no verdict on the checkpoint
        return ("raw-os-error" if str(e).startswith("[Errno") else "clean"), f"exit 2: {e}"
    except Exception as e:  # noqa: BLE001 - the classification
        return "traceback", f"{type(e).__name__}: {str(e)[:120]}"
    text = out.getvalue()
    if step == 2:
        return "loaded", text.strip().splitlines()[-1]
    try:
        with contextlib.redirect_stdout(out):
            _save(cfg, run, 2)  # the retrained step, written where the damaged one is
    except Exception as e:  # noqa: BLE001 - the classification
        return "save-fails", f"{type(e).__name__}: {str(e)[:160]}"
    text = out.getvalue()
    return ("clean" if "step_000002" in text else "silent"), " | ".join(text.strip().splitlines())[:300]


def main() -> int:
    from trainer.lifecycle.preflight import load_recipe

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    args = ap.parse_args()
    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    base = work / "base"
    recipe = REPO / "recipes" / "grpo_tiny.yaml"
    cfg = load_recipe(recipe, [f"logging.run_dir={base}", "model.path=builtin:tiny-base"], check_paths=False)
    model, opt, sched = _policy(cfg)
    run = _run(cfg, model, opt, sched)
    _save(cfg, run, 1)
    _save(cfg, run, 2)
    tally: dict[str, int] = {}
    for name, damage in DAMAGES.items():
        target = work / name
        shutil.copytree(base, target)
        damage(target / "checkpoints" / "step_000002")
        run.cfg = load_recipe(recipe, [f"logging.run_dir={target}"], check_paths=False)
        kind, detail = classify(run, run.cfg)
        tally[kind] = tally.get(kind, 0) + 1
        print(f"{name:24s} {kind:9s} {detail}", flush=True)
    print("tally:", ", ".join(f"{k} {v}" for k, v in sorted(tally.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
