"""The doctor's layers check against each model's own noise floor: healthy, then each fault the doctor's tests plant.

For each model, one in-process vLLM engine (bf16 unless ``--dtype``) and the doctor on the demo recipe's prompts with
``model.path`` set to it; the layers check (``trainer.doctor.checks.layers``) runs healthy, then with each planted
fault (as tests/doctor/test_layers.py plants them):

- ``mlp``: the trainer's layer 2 ``mlp.down_proj`` weights perturbed by 25% of their spread (trainer side);
- ``o_proj``: layer 1's ``o_proj`` delivered x1.1 to the engine (engine side);
- ``rope``: the trainer's RoPE frequencies those of theta 1e6 while the engine reads the config's theta.

Printed per run: the doctor's table, and for the healthy run the largest ratio engine-vs-trainer / floor over the
points (what ``trainer.diagnostics.noise_floor.FACTOR`` must stay above).

Models: ``tiny`` (builtin:tiny), ``qwen3`` (the zoo's 2-layer Qwen3), ``qwen3-48`` (the zoo's Qwen3 config with 48
layers, std-0.2 weights: ``trainer.builtin.zoo.build_arch_model(..., overrides={"num_hidden_layers": 48})``),
``smollm2`` (builtin:smollm2-135m, 30 layers, the ``realmodel`` extra).

    PYTHONPATH=. .venv/bin/python bench/parity/doctor_floor.py --models tiny qwen3-48 smollm2
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "grpo_tiny.yaml"
FAULTS = ("mlp", "o_proj", "rope")


def deep_qwen3(out: Path, layers: int = 48) -> Path:
    """The zoo's Qwen3 (hidden 64, std-0.2 weights) with ``layers`` decoder layers, saved in float32 under ``out``."""
    from trainer.builtin.zoo import build_arch_model

    path = out / f"qwen3-{layers}"
    if not (path / "config.json").is_file():
        model, tok = build_arch_model("qwen3", overrides={"num_hidden_layers": layers})
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return path


def model_path(name: str, work: Path) -> str:
    from trainer.builtin.zoo import ensure_arch_model

    if name == "tiny":
        return "builtin:tiny"
    if name == "smollm2":
        return "builtin:smollm2-135m"
    if name == "qwen3":
        return str(ensure_arch_model("qwen3", dtype="float32"))
    if name.startswith("qwen3-"):
        return str(deep_qwen3(work, int(name.split("-")[1])))
    raise SystemExit(f"--models {name!r}: expected tiny, qwen3, qwen3-<layers> or smollm2")


def plant(fault: str, doc, engine):
    """Plant ``fault``; returns the function that removes it (None: the model has no such place)."""
    layers = doc.model.model.layers
    if len(layers) <= {"mlp": 2, "o_proj": 1}.get(fault, 0):
        return None
    if fault == "mlp":
        w = layers[2].mlp.down_proj.weight
        original = w.detach().clone()
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            w.add_(0.25 * float(w.float().std()) * torch.randn(w.shape, generator=gen).to(w.dtype))
        return lambda: w.data.copy_(original)
    if fault == "o_proj":
        o = layers[1].self_attn.o_proj.weight.detach()
        engine.load_weights([("model.layers.1.self_attn.o_proj.weight", o.float() * 1.1)])
        return lambda: engine.load_weights([("model.layers.1.self_attn.o_proj.weight", o.float())])
    rope = doc.model.model.rotary_emb
    original = rope.inv_freq.detach().clone()
    config = doc.model.config
    theta = float(getattr(config, "rope_parameters", None) and config.rope_parameters.get("rope_theta")
                  or config.rope_theta)
    with torch.no_grad():
        rope.inv_freq.copy_(original.double().pow(math.log(1e6) / math.log(theta)).to(original.dtype))
    return lambda: rope.inv_freq.copy_(original)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "qwen3-48", "smollm2"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--faults", nargs="*", default=list(FAULTS))
    args = ap.parse_args()

    from rollout.vllm_engine import VLLMEngine
    from trainer.config.validate import sequence_length
    from trainer.diagnostics.doctor_report import table
    from trainer.doctor.checks.layers import run
    from trainer.doctor.context import Doctor
    from trainer.lifecycle.preflight import load_recipe

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.models:
            path = model_path(name, work)
            cfg = load_recipe(RECIPE, [f"model.path={path}", f"model.dtype={args.dtype}",
                                       f"logging.run_dir={work / 'run'}"])
            doc = Doctor(cfg, work / f"doctor-{name}", say=lambda _m: None)
            with VLLMEngine(str(doc.model_dir), dtype=args.dtype, max_model_len=sequence_length(cfg),
                            kv_cache_memory_bytes=256 * 1024**2, enforce_eager=True) as engine:
                doc._engine, doc._owns_engine = engine, False
                found = run(doc)
                rows = found[0].details["points"]
                ratio = max(rows, key=lambda r: r["rel_error"] / max(r["floor"], 1e-30))
                print(f"\n=== {name} ({path}), {args.dtype}: healthy; largest ratio to the floor "
                      f"{ratio['rel_error'] / max(ratio['floor'], 1e-30):.2f} at {ratio['point']} "
                      f"(rel {ratio['rel_error']:.3g}, floor {ratio['floor']:.3g}) ===")
                print(table(found))
                print("  point                  rel        floor      ratio")
                for r in rows:
                    print(f"  {r['point']:<22} {r['rel_error']:.3e}  {r['floor']:.3e}  "
                          f"{r['rel_error'] / max(r['floor'], 1e-30):.2f}")
                for fault in args.faults:
                    undo = plant(fault, doc, engine)
                    if undo is None:
                        continue
                    try:
                        found = run(doc)
                    finally:
                        with torch.no_grad():
                            undo()
                    print(f"\n=== {name}, {args.dtype}: planted {fault} ===")
                    print(table(found))


if __name__ == "__main__":
    main()
