"""The step loop frees the engine's memory for the update (``RolloutEngine.release_memory``: the colocated CUDA
vLLM engine sleeps) and the sync comes after the update: the order a sleeping engine needs (it wakes its weights
for the sync, its KV cache after it: tests/rollout/test_engine_cuda_options.py). Run with the HF engine, recorded."""
from pathlib import Path

import pytest
import torch

import trainer.sampling.engines
from rollout.hf_engine import HFEngine
from trainer.lifecycle.preflight import load_recipe

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_each_step_releases_the_engine_after_its_rollout_and_syncs_after_the_update(tmp_path, monkeypatch,
                                                                                    tiny_model_dir):
    from trainer.rl.loop import train

    log = []

    class Recorded(HFEngine):
        def generate(self, prompt_ids, spec):
            log.append("generate")
            return super().generate(prompt_ids, spec)

        def release_memory(self):
            log.append("release_memory")

        def load_weight_chunks(self, chunks):
            log.append("sync")
            super().load_weight_chunks(chunks)

        def load_adapter(self, adapter):  # rollout.lora_sync auto: the HF engine runs the adapter itself
            log.append("sync")
            super().load_adapter(adapter)

    step = torch.optim.AdamW.step

    def recorded_step(self, *a, **k):
        log.append("update")
        return step(self, *a, **k)

    monkeypatch.setattr(trainer.sampling.engines, "HFEngine", Recorded)
    monkeypatch.setattr(torch.optim.AdamW, "step", recorded_step)
    cfg = load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [
        "rollout.engine=hf", f"logging.run_dir={tmp_path}", "logging.wandb.mode=disabled", "train.steps=2",
        "rollout.prompts_per_step=2", "algorithm.group_size=2", "rollout.max_new_tokens=6",
        "train.micro_batch_size=4", "parity.probe_prompts=0", "checkpoint.every=0", "eval.every=0"])
    train(cfg)
    steps = log[log.index("sync") + 1:]  # after the start's alignment sync
    assert steps == ["generate", "release_memory", "update", "sync"] * 2, log
