"""Worker for tests/trainer/vision/test_vl_train.py: the vision-language recipe trained three times: as it is, on the
engine the run starts itself, then with each planted fault of the input identity check, which must stop the run
before its first update, with merged weight updates between evaluations of the same held-out images, and at
rollout.max_staleness 2 with a resume (one engine for all but the first two). Prints one JSON line per run: its steps' metrics, or the stop's exit status
and message. A process of its own: the test session already holds a (text) engine (tests/conftest.py).

Usage: python vl_runs_worker.py <run-dir-root>
"""
import json
import sys
from pathlib import Path

import torch
from peft.utils import load_peft_weights
from vl_faults import engine_drops_an_image, processor_at_42_pixels

import trainer.rl.loop as loop
from trainer.builtin.resolve import resolve_model_path
from trainer.config.validate import sequence_length
from trainer.io.checkpoint import latest_checkpoint
from trainer.lifecycle.preflight import load_recipe
from trainer.lifecycle.stops import RunStopped
from trainer.measurement.probe import Probe
from trainer.sampling.engines import make_engine

REPO = Path(__file__).resolve().parents[3]


def probe_image_tokens(seen: list):
    """Record, at every probe, how many image placeholder ids the probe's fixed prompts hold (0: probed as text)."""
    real = Probe.__call__

    def call(self, engine, model):
        out = real(self, engine, model)
        if self.fixed is not None and self.images is not None:
            seen.append(sum(p.count(self.images.image_token_id) for p in self.fixed.prompt_ids))
        elif self.fixed is not None:
            seen.append(0)
        return out

    Probe.__call__ = call
    return lambda: setattr(Probe, "__call__", real)


def digit_share(prompts, completions, **columns):
    """A reward with a spread across a group (the untrained model never counts right): the share of digits."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def main(root: str) -> None:
    # the untrained model (no warm start to build), rewarded by digit_share, so that its updates carry a gradient
    sets = ["train.steps=3", "logging.wandb.mode=disabled", "checkpoint.every=0", "eval.every=0",
            "model.path=builtin:zoo-idefics3", "algorithm.group_size=4",
            "reward.functions={digits: 'vl_runs_worker:digit_share'}"]
    shared = None
    # merged_eval: merged weight updates between evaluations of the same held-out images (a reload clears the
    # engine's image features; its scheduler must forget them too)
    merged_eval = ["rollout.lora_sync=merged", "eval.every=1", "eval.num_prompts=4", "train.steps=2"]
    # processor_42px is caught by the probe before training (its prompts are checked when fixed); image_dropped by
    # step 1's own check (no probe prompts)
    # processor_setting: data.image_processor given to both sides (the engine it starts gets them as
    # mm_processor_kwargs): the inputs stay equal, where the same setting on the trainer's side alone is a fault
    setting = ["data.image_processor={image_mean: [0.4, 0.4, 0.4], image_std: [0.3, 0.3, 0.3]}", "train.steps=1"]
    # image_splitting: each 56-pixel image resized to 112 and split into 2 x 2 crops and a global view (the published
    # Idefics3 / SmolVLM checkpoints split by default)
    splitting = ["data.image_processor={do_image_splitting: true, size: {longest_edge: 112}}",
                 "data.max_prompt_tokens=160", "train.steps=1"]
    own_engine = ("clean", "processor_setting", "image_splitting")
    for name, plant, extra in (("clean", None, []), ("processor_setting", None, setting),
                               ("image_splitting", None, splitting),
                               ("processor_42px", processor_at_42_pixels, []),
                               ("image_dropped", engine_drops_an_image, ["parity.probe_prompts=0"]),
                               ("merged_eval", None, merged_eval)):
        cfg = load_recipe(REPO / "recipes" / "grpo_vl_tiny.yaml", sets + extra + [f"logging.run_dir={root}/{name}"])
        probes: list[int] = []
        undo = plant() if plant else probe_image_tokens(probes)
        if name not in own_engine and shared is None:  # one engine serves the rest
            shared = make_engine(cfg, resolve_model_path(cfg.model.path), max_model_len=sequence_length(cfg))
        try:
            # the clean run starts its engine as a user's run does (the adapter's layers named by the policy)
            res = loop.train(cfg, engine=None if name in own_engine else shared)
            out = {"run": name, "history": res.history, "probe_image_tokens": probes}
        except RunStopped as e:
            out = {"run": name, "exit_status": e.exit_status, "message": str(e),
                   "steps_logged": sum(1 for _ in open(Path(root) / name / "metrics.jsonl"))
                   if (Path(root) / name / "metrics.jsonl").exists() else 0}
        finally:
            if undo:
                undo()
        print("RESULT " + json.dumps(out, default=float), flush=True)
    print("RESULT " + json.dumps(stale_resume(root, sets, shared), default=float), flush=True)
    shared.close()


def stale_resume(root: str, sets: list[str], engine) -> dict:
    """rollout.max_staleness = 2 on images: 4 steps at once, and 2 steps, then a resume to 4 from the checkpoint
    after step 2, which holds the pending batches of steps 3 and 4 (their rows' images, their pixels)."""
    recipe = REPO / "recipes" / "grpo_vl_tiny.yaml"
    stale = sets + ["rollout.max_staleness=2", "train.steps=4", "checkpoint.every=2"]
    full = loop.train(load_recipe(recipe, stale + [f"logging.run_dir={root}/stale_full"]), engine=engine)
    half = load_recipe(recipe, stale + [f"logging.run_dir={root}/stale_split"])
    half.train.steps = 2
    loop.train(half, engine=engine)
    half.train.steps = 4
    resumed = loop.train(half, resume=True, engine=engine)
    pa = load_peft_weights(str(latest_checkpoint(full.run_dir) / "adapter"), device="cpu")
    pb = load_peft_weights(str(latest_checkpoint(resumed.run_dir) / "adapter"), device="cpu")
    return {"run": "stale_resume", "full": full.history, "resumed": resumed.history,
            "adapters_equal": all(torch.equal(pa[k], pb[k]) for k in pa)}


if __name__ == "__main__":
    main(sys.argv[1])
