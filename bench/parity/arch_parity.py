"""Parity per architecture: vLLM engine vs trainer, and trainer vs the model's own forward.

For every architecture of ``trainer.builtin.zoo`` (tiny random-init models, std 0.2) and
dtype, one in-process vLLM engine samples ``--prompts`` x ``--n`` completions of
``--tokens`` tokens (T = ``--temperature``, seeded); the trainer (``load_base_model`` +
``completion_logprobs``: fused kernel with the model's logit transform) scores them, and so
does ``log_softmax(model(...).logits.float() / T)``. Printed: MAE engine vs trainer and
trainer vs own forward over the sampled tokens, and the mean sampled-token log-prob (how
far from uniform, log 512 = 6.24, and from deterministic, 0, the samples are).

``--sync-check ARCH,...``: after 2 LoRA updates (Adam, lr 1e-2, on the sampled tokens),
the merged weights are pushed into the running engine (``merged_lora_weights`` +
``load_weights``), and a fresh engine is started from ``parityrl merge`` of the saved
adapter; both sample the same seeded requests. Reported: whether samples and log-probs are
bitwise equal.

    PYTHONPATH=. .venv/bin/python bench/parity/arch_parity.py                       # the bench/RESULTS.md table
    PYTHONPATH=. .venv/bin/python bench/parity/arch_parity.py --dtypes float32 --json out.json --sync-check qwen2,gemma2

Engines are started one after another in this process (each closed before the next);
run it as its own process, not inside a session that holds another engine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

PROMPTS = [[1, 3, 40, 77, 301, 4], [1, 3, 9, 500, 4], [1, 3, 250, 251, 252, 253, 4], [1, 3, 66, 4]]


def masked_mae(a, b, mask) -> float:
    return float(((a - b).abs() * mask).sum() / mask.sum())


def _engine(path: str, dtype: str):
    from rollout.vllm_engine import VLLMEngine
    from trainer.config import RolloutConfig

    return VLLMEngine(path, dtype=dtype, max_model_len=64, seed=0, kv_cache_memory_bytes=32 * 1024**2,
                      enforce_eager=True, gpu_memory_utilization=RolloutConfig.gpu_memory_utilization)


def _scores(model, rollouts, temperature):
    """(trainer log-probs, own-forward log-probs, engine log-probs, mask), each [S, C]."""
    from trainer.models.batch import batch_from_rollouts
    from trainer.models.policy import completion_logprobs

    batch = batch_from_rollouts(rollouts, pad_id=0)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, batch, temperature=temperature)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits.float()
    p, c = batch.prompt_len, batch.targets.shape[1]
    own = torch.log_softmax(logits[:, p - 1:p - 1 + c] / temperature, -1)
    own = own.gather(-1, batch.targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return lp, own, batch.rollout_logprobs, batch.mask


def _two_lora_updates(model, rollouts, temperature):
    """The policy after 2 Adam steps on the sampled tokens (a stand-in for two RL updates)."""
    from trainer.config import LoraConfig
    from trainer.models.batch import batch_from_rollouts
    from trainer.models.policy import add_lora, completion_logprobs

    policy = add_lora(model, LoraConfig(r=4, alpha=8.0))
    batch = batch_from_rollouts(rollouts, pad_id=0)
    adv = torch.linspace(-1, 1, batch.mask.shape[0]).unsqueeze(1)
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        lp, _ = completion_logprobs(policy, batch, temperature=temperature)
        loss = -(lp * adv * batch.mask).sum() / batch.mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return policy.eval()


def measure(arch: str, dtype: str, args, sync: bool) -> dict:
    from rollout.types import SamplingSpec
    from rollout.weight_export import merged_lora_weights
    from trainer.builtin.zoo import ensure_arch_model
    from trainer.commands.merge import merge_adapter
    from trainer.models.policy import load_base_model

    path = str(ensure_arch_model(arch, dtype=dtype))
    spec = SamplingSpec(n=args.n, temperature=args.temperature, max_new_tokens=args.tokens, seed=1)
    prompts = PROMPTS[:args.prompts]
    t0 = time.time()
    engine = _engine(path, dtype)
    row = {"arch": arch, "dtype": dtype}
    try:
        rollouts = engine.generate(prompts, spec)
        model = load_base_model(path, dtype).eval()
        lp, own, eng, mask = _scores(model, rollouts, args.temperature)
        row.update(engine_vs_trainer=masked_mae(eng, lp, mask), trainer_vs_own=masked_mae(lp, own, mask),
                   engine_vs_own=masked_mae(eng, own, mask), mean_logprob=float((eng * mask).sum() / mask.sum()),
                   tokens=int(mask.sum()))
        if sync:
            policy = _two_lora_updates(model, rollouts, args.temperature)
            engine.load_weights(merged_lora_weights(policy, dtype=getattr(torch, dtype)))
            spec2 = SamplingSpec(n=args.n, temperature=args.temperature, max_new_tokens=args.tokens, seed=2)
            synced = engine.generate(prompts, spec2)
            engine.close()
            with tempfile.TemporaryDirectory() as tmp:
                policy.save_pretrained(f"{tmp}/adapter")
                merged = str(merge_adapter(path, f"{tmp}/adapter", f"{tmp}/merged"))
                engine = _engine(merged, dtype)
                fresh = engine.generate(prompts, spec2)
            row.update(sync_same_samples=synced.completion_ids == fresh.completion_ids,
                       sync_same_logprobs=synced.rollout_logprobs == fresh.rollout_logprobs,
                       sync_changed=synced.completion_ids != rollouts.completion_ids
                       or synced.rollout_logprobs != rollouts.rollout_logprobs)
    finally:
        engine.close()
    row["seconds"] = round(time.time() - t0, 1)
    return row


def main(argv=None) -> int:
    from trainer.builtin.zoo import ARCHITECTURES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", default=",".join(ARCHITECTURES))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--sync-check", default="", help="comma-separated archs (float32 only) to check the LoRA sync on")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    archs, dtypes = args.archs.split(","), args.dtypes.split(",")
    sync = set(filter(None, args.sync_check.split(",")))
    bad = [a for a in archs + sorted(sync) if a not in ARCHITECTURES]
    if bad or not 1 <= args.prompts <= len(PROMPTS):
        print(f"--archs/--sync-check: unknown {bad} (expected {sorted(ARCHITECTURES)}); --prompts in 1..{len(PROMPTS)}",
              file=sys.stderr)
        return 2
    rows = [measure(a, d, args, sync=a in sync and d == "float32") for d in dtypes for a in archs]
    print(f"{'arch':<11} {'dtype':<9} {'engine-trainer':>14} {'trainer-own':>12} {'engine-own':>11} "
          f"{'mean lp':>8} {'tokens':>6}  sync")
    for r in rows:
        sync_txt = "" if "sync_same_samples" not in r else (
            "bitwise" if r["sync_same_samples"] and r["sync_same_logprobs"] else "DIFFERENT")
        print(f"{r['arch']:<11} {r['dtype']:<9} {r['engine_vs_trainer']:>14.3g} {r['trainer_vs_own']:>12.3g} "
              f"{r['engine_vs_own']:>11.3g} {r['mean_logprob']:>8.3f} {r['tokens']:>6}  {sync_txt}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
