"""Rollout throughput: vLLM (several engine settings) vs the HF ``generate`` engine on the same prompts.

    .venv/bin/python bench/speed/bench_rollout.py                    # tiny built-in base model
    .venv/bin/python bench/speed/bench_rollout.py --model DIR --prompts 32 --n 8 --new-tokens 24

Every sample runs to exactly ``--new-tokens`` tokens (EOS stopping off on both
engines) so both do the same work. One warm-up batch per engine is excluded.
Figures: completion tokens / wall second, best of ``--repeats`` batches, and the
median ratio of *paired* batches (HF, then vLLM, alternating) -- on a shared
machine the load drifts, and pairing keeps the ratio honest.
Prints a table and each vLLM setting's ratio to HF. No assertions: numbers only.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before anything imports vllm
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollout.types import SamplingSpec  # noqa: E402  (light: no vllm / transformers import)

# (label, VLLMEngine keyword arguments)
VLLM_SETTINGS = [
    ("eager, prefix cache, max_num_seqs=256", dict(enforce_eager=True, enable_prefix_caching=True, max_num_seqs=256)),
    ("eager, no prefix cache", dict(enforce_eager=True, enable_prefix_caching=False, max_num_seqs=256)),
    ("eager, max_num_seqs=64", dict(enforce_eager=True, enable_prefix_caching=True, max_num_seqs=64)),
    ("compiled (enforce_eager=False)", dict(enforce_eager=False, enable_prefix_caching=True, max_num_seqs=256)),
    ("compiled, no prefix cache", dict(enforce_eager=False, enable_prefix_caching=False, max_num_seqs=256)),
]


def _prompts(num: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(6, vocab, (8 + i % 9,), generator=g).tolist() for i in range(num)]


def _timed(engine, prompts, spec) -> float:
    """Completion tokens per wall second of one batch."""
    t0 = time.perf_counter()
    r = engine.generate(prompts, spec)
    return r.num_completion_tokens / (time.perf_counter() - t0)


def _paired(vllm, hf, prompts, spec, repeats: int) -> tuple[float, float, float, float]:
    """Alternate HF and vLLM batches so both see the same machine load.

    Returns (best vLLM tokens/s, best HF tokens/s, median of the per-pair ratios vLLM/HF,
    vLLM warm-up seconds). The first vLLM batch is the excluded warm-up.
    """
    t0 = time.perf_counter()
    vllm.generate(prompts, spec)
    warm = time.perf_counter() - t0
    v_rates, h_rates = [], []
    for i in range(repeats):
        s = SamplingSpec(**{**spec.__dict__, "seed": spec.seed + 1 + i})
        h_rates.append(_timed(hf, prompts, s))
        v_rates.append(_timed(vllm, prompts, s))
    ratios = sorted(v / h for v, h in zip(v_rates, h_rates))
    return max(v_rates), max(h_rates), ratios[len(ratios) // 2], warm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: trainer.builtin.tiny.ensure_tiny_base())")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--settings", default="all", help="comma-separated indices into VLLM_SETTINGS, or 'all'")
    args = ap.parse_args()

    import torch

    from rollout.hf_engine import HFEngine
    from rollout.vllm_engine import VLLMEngine
    from trainer.config import RolloutConfig

    model = args.model
    if model is None:
        from trainer.builtin.tiny import ensure_tiny_base

        model = str(ensure_tiny_base())
    import json

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prompts = _prompts(args.prompts, vocab)
    spec = SamplingSpec(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    max_len = max(len(p) for p in prompts) + args.new_tokens
    print(f"model {model}: {args.prompts} prompts x n={args.n}, {args.new_tokens} new tokens, "
          f"torch threads {torch.get_num_threads()}")

    hf = HFEngine(model, dtype="bfloat16", eos_ids=[])
    hf.generate(prompts, spec)  # warm-up

    rows = []
    picks = range(len(VLLM_SETTINGS)) if args.settings == "all" else [int(i) for i in args.settings.split(",")]
    for i in picks:
        label, kwargs = VLLM_SETTINGS[i]
        t0 = time.perf_counter()
        engine = VLLMEngine(model, dtype="bfloat16", max_model_len=max(max_len, 64), eos_ids=[],
                            kv_cache_memory_bytes=256 * 1024**2,
                            gpu_memory_utilization=RolloutConfig.gpu_memory_utilization, **kwargs)
        start = time.perf_counter() - t0
        v_rate, h_rate, ratio, warm = _paired(engine, hf, prompts, spec, args.repeats)
        engine.close()
        rows.append((f"vLLM {label}", v_rate, h_rate, ratio, warm, start))
        print(f"  done: {label}", flush=True)

    print(f"\n{'vLLM setting':44s} {'vLLM tok/s':>10s} {'HF tok/s':>9s} {'vLLM/HF':>8s} {'warm-up s':>9s} {'start s':>8s}")
    for label, v_rate, h_rate, ratio, warm, start in rows:
        print(f"{label:44s} {v_rate:10.0f} {h_rate:9.0f} {ratio:8.2f} {warm:9.2f} {start:8.1f}")
    best = max(rows, key=lambda r: r[3])
    print(f"\nfastest vLLM setting: {best[0]} ({best[3]:.2f}x HF generate, median of paired batches)")


if __name__ == "__main__":
    main()
