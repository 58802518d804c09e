"""Engine-vs-trainer parity under the precision recipes, on the real vLLM engine (CPU: FP8 emulated).

    .venv/bin/python bench/parity/bench_fp8_parity.py                       # builtin:tiny, FP8 engine
    .venv/bin/python bench/parity/bench_fp8_parity.py --engine bf16         # the BF16 engine, for the baseline
    .venv/bin/python bench/parity/bench_fp8_parity.py --hidden-size 512     # a wider random tiny base (built once)
    .venv/bin/python bench/parity/bench_fp8_parity.py --no-reload --prompts 16 --n 4 --new-tokens 24 --temperature 1 \
        --adapters runs/x/checkpoints/step_00000{1,5}/adapter     # at the weights a run went through

One engine per process (``--engine fp8``: vLLM with ``rollout.vllm_plugins.fp8_quant``'s
emulated block-FP8 linear layers; ``--engine bf16``: plain BF16). It samples
completions of arithmetic-task prompts and scores them with two trainers, the
BF16 HF model and the same model converted by ``trainer.models.precision.convert_to_fp8``;
``parity.metrics.compare`` gives each pair's mismatch. With the FP8 engine the
pairs are the recipes:

    fp8_unified  = FP8 engine vs FP8 trainer   (same quantized forward on both sides)
    fp8_rollout  = FP8 engine vs BF16 trainer  (the common mismatched setup)

and with ``--engine bf16``: ``bf16`` = BF16 engine vs BF16 trainer.

Then (unless ``--no-reload``) a LoRA adapter with random B is merged and pushed
with ``load_weights`` (vLLM's in-place ``reload_weights``), new completions are
sampled, and both pairs are measured again, plus ``stale``: the new FP8 trainer
against the pre-sync completions, which shows the sync changed the engine.

``--adapters DIR ...`` (PEFT adapter directories, e.g. a run's
``checkpoints/step_N/adapter``): each is pushed in turn the same way and both pairs are
measured at exactly those weights -- how the recipes compare at the weights a real run went
through, which their own runs' train-step figures cannot show (each run takes its own path).
Prints one JSON object (figures only, no assertions; tests/rollout/test_fp8_quant.py asserts).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before anything imports vllm
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

KEYS = ("mae", "max_abs", "kl_k3", "num_tokens")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:tiny", help="builtin:tiny, builtin:tiny-base or a local HF dir")
    p.add_argument("--hidden-size", type=int, default=None,
                   help="use a random tiny base of this width instead of --model (head_dim = width / 4)")
    p.add_argument("--engine", choices=("fp8", "bf16"), default="fp8")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora-b-std", type=float, default=0.05, help="std of the random LoRA B pushed by the reload check")
    p.add_argument("--no-reload", action="store_true")
    p.add_argument("--adapters", nargs="+", default=[], metavar="DIR",
                   help="PEFT adapter dirs (a run's checkpoints/step_N/adapter) to push and measure in turn")
    p.add_argument("--json-out", default=None, help="also write the result to this file (stdout carries vLLM's logs)")
    args = p.parse_args(argv)
    for d in args.adapters:  # before the engine starts
        if not (Path(d) / "adapter_config.json").is_file():
            p.error(f"--adapters: {d!r} is not a PEFT adapter directory (expected {d}/adapter_config.json, "
                    "e.g. <run_dir>/checkpoints/step_000010/adapter)")
    return args


def model_dir(args) -> str:
    if args.hidden_size is not None:
        from trainer.builtin.tiny import ensure_tiny_base

        h = args.hidden_size
        return str(ensure_tiny_base(hidden_size=h, intermediate_size=3 * h, num_heads=4, num_kv_heads=2))
    from trainer.builtin.resolve import resolve_model_path

    return resolve_model_path(args.model)


def parity(model, rollouts, pad_id: int, temperature: float) -> dict:
    from parity.metrics import compare
    from trainer.models.batch import batch_from_rollouts
    from trainer.models.policy import completion_logprobs

    batch = batch_from_rollouts(rollouts, pad_id)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, batch, temperature=temperature)
    m = compare(lp, batch.rollout_logprobs, batch.mask)
    return {k: m[f"parity/{k}"] for k in KEYS}


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def engine_weight_mismatches(engine, trainer) -> list[str]:
    """Engine linear weights (vLLM names, fused) that are not bitwise the trainer's fake-quantized weights."""
    from trainer.models.precision import fp8_weights

    expected = fp8_weights(trainer)

    def grab(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()
                if n.rsplit(".", 2)[-2] in (*_FUSED, "o_proj", "down_proj")}

    got = engine.llm.apply_model(grab)[0]
    bad = []
    for name, w in got.items():
        prefix, leaf, param = name.rsplit(".", 2)
        parts = [f"{prefix}.{s}.{param}" for s in _FUSED.get(leaf, (leaf,))]
        if not all(p in expected for p in parts) or not torch.equal(w, torch.cat([expected[p] for p in parts])):
            bad.append(name)
    return bad if got else ["<no engine weights found>"]


def engine_methods(engine) -> dict[str, str]:
    """Quantization method class of layer 0's linear layers and of lm_head, as the engine built them."""
    wanted = ("layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj", "layers.0.mlp.gate_up_proj",
              "layers.0.mlp.down_proj", "lm_head")

    def grab(model):
        return {n: type(getattr(m, "quant_method", None)).__name__ for n, m in model.named_modules() if n.endswith(wanted)}

    return engine.llm.apply_model(grab)[0]


def pairs(engine_kind: str, fp8_trainer, bf16_trainer, rollouts, pad_id, temperature) -> dict:
    if engine_kind == "fp8":
        return {"fp8_unified": parity(fp8_trainer, rollouts, pad_id, temperature),
                "fp8_rollout": parity(bf16_trainer, rollouts, pad_id, temperature)}
    return {"bf16": parity(bf16_trainer, rollouts, pad_id, temperature),
            "bf16_engine_vs_fp8_trainer": parity(fp8_trainer, rollouts, pad_id, temperature)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    from rollout.types import SamplingSpec
    from rollout.vllm_engine import VLLMEngine
    from rollout.weight_export import merged_lora_weights
    from trainer.config import LoraConfig, RolloutConfig
    from trainer.data.datasets import encode_prompts
    from trainer.data.tasks.arithmetic import arithmetic_dataset
    from trainer.models.policy import add_lora, load_base_model, load_tokenizer
    from trainer.models.precision import convert_to_fp8
    from trainer.precision import recipe_for

    path = model_dir(args)
    tok = load_tokenizer(path)
    prompts = encode_prompts(tok, list(arithmetic_dataset(args.prompts, seed=args.seed, split="test")["prompt"]))
    spec = SamplingSpec(n=args.n, temperature=args.temperature, max_new_tokens=args.new_tokens, seed=args.seed)
    engine_recipe = recipe_for("fp8_unified" if args.engine == "fp8" else "bf16")
    kwargs = engine_recipe.engine_options(torch.cuda.is_available())
    max_len = max(len(p) for p in prompts) + args.new_tokens + 8

    t0 = time.perf_counter()
    engine = VLLMEngine(path, dtype="bfloat16", max_model_len=max_len, seed=0, kv_cache_memory_bytes=256 * 1024**2,
                        gpu_memory_utilization=RolloutConfig.gpu_memory_utilization, **kwargs)
    start_s = time.perf_counter() - t0
    bf16 = load_base_model(path, "bfloat16").eval()
    fp8 = copy.deepcopy(bf16)
    convert_to_fp8(fp8)
    out = {"model": path, "engine": args.engine, "engine_kwargs": kwargs, "temperature": args.temperature,
           "engine_start_s": round(start_s, 1), "engine_methods": engine_methods(engine)}
    before = engine.generate(prompts, spec)
    out["initial"] = pairs(args.engine, fp8, bf16, before, tok.pad_token_id, args.temperature)
    if args.engine == "fp8":  # the engine holds exactly the trainer's quantized weights
        out["initial"]["weight_mismatches"] = engine_weight_mismatches(engine, fp8)

    def push_and_measure(policy, seed: int) -> tuple[dict, object]:
        """Sync ``policy`` (merged LoRA, the loop's arithmetic) into the engine, sample, score both pairs.
        Returns the figures and the trainer of this engine's recipe (FP8 or BF16)."""
        policy.eval()
        policy_fp8 = copy.deepcopy(policy)
        convert_to_fp8(policy_fp8)
        engine.load_weights(merged_lora_weights(policy, dtype=torch.bfloat16))
        rollouts = engine.generate(prompts, SamplingSpec(**{**spec.__dict__, "seed": seed}))
        result = pairs(args.engine, policy_fp8, policy, rollouts, tok.pad_token_id, args.temperature)
        if args.engine == "fp8":
            result["weight_mismatches"] = engine_weight_mismatches(engine, policy_fp8)
        return result, policy_fp8 if args.engine == "fp8" else policy

    if not args.no_reload:
        torch.manual_seed(args.seed)
        policy = add_lora(copy.deepcopy(bf16), LoraConfig(r=8, alpha=16.0, dropout=0.0))
        g = torch.Generator().manual_seed(args.seed + 1)
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if "lora_B" in n:  # PEFT starts B at 0: a trained adapter is not
                    p.copy_(torch.randn(p.shape, generator=g) * args.lora_b_std)
        out["after_reload"], stale_trainer = push_and_measure(policy, args.seed + 1)
        out["after_reload"]["stale"] = parity(stale_trainer, before, tok.pad_token_id, args.temperature)
    if args.adapters:
        from peft import PeftModel

        out["adapters"] = {}
        for i, adapter in enumerate(args.adapters):
            policy = PeftModel.from_pretrained(copy.deepcopy(bf16), adapter)
            out["adapters"][adapter], _ = push_and_measure(policy, args.seed + 2 + i)
    engine.close()
    print(json.dumps(out, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
