"""Worker for tests/trainer/vision/test_vl_doctor.py: ``parityrl doctor`` on the vision-language recipe (the random
tiny Idefics3, std 0.2 weights), healthy and with each planted fault: the trainer's processor at other pixels, one
image dropped from the engine's request, a vision-tower weight the engine holds wrong (layer 1's fc2, scaled by 1.1)
and the same on the trainer's side (layer 0's attention out_proj). One engine for every battery, eager as the doctor
starts it for its hooks, in a process of its own (the test session already holds a text engine, tests/conftest.py).
Prints one JSON line per battery: its exit status and findings; then `parityrl compare` on the same engine.

Usage: python vl_doctor_worker.py <out-dir-root>
"""
import json
import sys
from pathlib import Path

import torch
from vl_faults import engine_drops_an_image, processor_at_42_pixels

import trainer.doctor.checks.images as images_check
from trainer.builtin.resolve import resolve_model_path
from trainer.commands.doctor import run_doctor
from trainer.config.validate import sequence_length
from trainer.diagnostics.compare import run_compare
from trainer.doctor.context import engine_config
from trainer.lifecycle.preflight import load_recipe
from trainer.sampling.engines import make_engine

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "grpo_vl_tiny.yaml"
SETS = ["model.path=builtin:zoo-idefics3"]
CHECKS = ["layers", "images"]
TOWER_WEIGHT = "model.vision_model.encoder.layers.1.mlp.fc2.weight"


def engine_tower_weight_scaled(engine):
    """The engine's vision layer 1 fc2 scaled by 1.1 (a sync that delivered it wrong); returns its undo."""
    from safetensors.torch import load_file

    files = sorted(Path(resolve_model_path(SETS[0].split("=")[1])).glob("*.safetensors"))
    w = next(load_file(f)[TOWER_WEIGHT] for f in files if TOWER_WEIGHT in load_file(f))

    def plant():
        engine.load_weights([(TOWER_WEIGHT, w.float() * 1.1)])
        return lambda: engine.load_weights([(TOWER_WEIGHT, w.float())])
    return plant


def trainer_attention_perturbed():
    """The trainer's vision layer 0 attention out_proj perturbed by 25% of its spread, on the trainer's side only
    (the check's trainer states, wherever the trainer's model comes from); returns its undo."""
    real = images_check.trainer_states

    def states(model, pixels, names):
        w = model.model.vision_model.encoder.layers[0].self_attn.out_proj.weight
        original = w.detach().clone()
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            w.add_(0.25 * float(w.float().std()) * torch.randn(w.shape, generator=gen).to(w.dtype))
        try:
            return real(model, pixels, names)
        finally:
            with torch.no_grad():
                w.copy_(original)

    images_check.trainer_states = states
    return lambda: setattr(images_check, "trainer_states", real)


def main(root: str) -> None:
    cfg = load_recipe(RECIPE, SETS)
    engine = make_engine(engine_config(cfg, CHECKS, say=lambda _m: None), resolve_model_path(cfg.model.path),
                         max_model_len=sequence_length(cfg))
    try:
        for name, plant in (("healthy", None), ("processor_42px", processor_at_42_pixels),
                            ("image_dropped", engine_drops_an_image),
                            ("engine_tower_weight", engine_tower_weight_scaled(engine)),
                            ("trainer_tower_attention", trainer_attention_perturbed)):
            undo = plant() if plant else None
            try:
                status = run_doctor(str(RECIPE), SETS, out=Path(root) / name, only=CHECKS, engine=engine,
                                    say=lambda _m: None)
            finally:
                if undo:
                    undo()
            report = json.loads((Path(root) / name / "doctor.json").read_text())
            print("RESULT " + json.dumps({"run": name, "status": status, "findings": report["findings"]}), flush=True)
        # `parityrl compare` on the same model: its prompts as text, its level at the depth the text config holds
        # (an Idefics3 config has none of its own)
        prompts = Path(root) / "prompts.jsonl"
        prompts.write_text('{"prompt": "How many shapes are in the image?"}\n{"prompt": "Name a colour."}\n')
        summary = run_compare("builtin:zoo-idefics3", prompts, Path(root) / "compare", engine=engine, dtype="float32",
                              max_new_tokens=8)
        print("RESULT " + json.dumps({"run": "compare", "mae": summary["metrics"]["parity/mae"],
                                      "vision_language": summary.get("vision_language"),
                                      "verdict": summary["expected_level"]}, default=str), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main(sys.argv[1])
