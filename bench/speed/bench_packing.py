"""Benchmark: the update pass on a batch whose completion lengths spread 10x, padded vs bucketed vs packed.

    .venv/bin/python bench/speed/bench_packing.py              # CPU (and CUDA too when present)
    .venv/bin/python bench/speed/bench_packing.py --quick      # a smaller model and batch, ~1 minute on CPU

One GRPO ``policy_gradient_pass`` (forward, loss, backward; trainer/rl/update.py) of a random
Qwen2-shaped model with a LoRA adapter, on four batches of the SAME number of real tokens:
  equal     every row the same length (prompt + completion): no padding at all, the baseline;
  rows      the spread batch, micro-batches cut in row order (the padded path before bucketing);
  bucketed  the spread batch, micro-batches cut longest-first (trainer/measurement/micro_batches.py, the default);
  packed    bucketed, and each micro-batch's sequences packed into rows (``train.pack_sequences``).
Each batch runs with two micro-batch sizes: ``--micro-batch-size`` rows (several micro-batches:
what bucketing can regroup) and the whole batch in one (what only packing can shorten).
Useful tokens/s = real (prompt + completion) tokens / seconds of the pass; the ratio is
against ``equal``. ``computed`` is the share of the positions the backbone runs that are real
tokens. Attention's cost grows with each row's length, so the spread batch costs somewhat more
than equal rows even with no padding at all: a ratio < 1 is not all waste.

Timings: minimum of ``--reps`` passes after one warm-up. CPU: process CPU seconds with
``--threads`` (default 1) torch threads -- on a shared machine wall time measures the other
processes, a one-thread process's CPU time measures the work (no OpenMP spin-waiting). CUDA:
wall seconds around synchronised passes. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("PARITYRL_CACHE", str(Path(__file__).resolve().parents[2] / ".cache" / "parityrl"))

from trainer.algorithms import ADVANTAGES, AdvantageInputs  # noqa: E402
from trainer.config import LoraConfig  # noqa: E402
from trainer.lifecycle.preflight import load_recipe  # noqa: E402
from trainer.measurement import micro_batches  # noqa: E402
from trainer.models.batch import build_token_batch  # noqa: E402
from trainer.models.packing import pack  # noqa: E402
from trainer.models.policy import add_lora, check_packing  # noqa: E402
from trainer.rl.learner import Learner  # noqa: E402
from trainer.rl.update import policy_gradient_pass  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def build_model(hidden: int, layers: int, vocab: int, dtype: torch.dtype, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
                      max_position_embeddings=4096, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype)
    check_packing(model, {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype])
    return add_lora(model, LoraConfig(r=16, alpha=32))


def batches(rows: int, min_len: int, spread: float, vocab: int, device: str):
    """(spread batch, equal batch): completions min_len .. spread x min_len in shuffled order; the equal
    batch has the same prompts' total and the same completion tokens, split evenly over the rows."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.linspace(min_len, spread * min_len, rows).round().long()
    lengths = lengths[torch.randperm(rows, generator=g)].tolist()
    prompt_lens = [24 + int(x) for x in torch.randint(0, 17, (rows,), generator=g)]

    def ids(n):
        return torch.randint(5, vocab, (n,), generator=g).tolist()

    spread_b = build_token_batch([ids(p) for p in prompt_lens], [ids(n) for n in lengths], pad_id=0, device=device)
    total_p, total_c = sum(prompt_lens), sum(lengths)
    eq_p = [total_p // rows + (i < total_p % rows) for i in range(rows)]
    eq_c = [total_c // rows + (i < total_c % rows) for i in range(rows)]
    equal_b = build_token_batch([ids(p) for p in eq_p], [ids(n) for n in eq_c], pad_id=0, device=device)
    assert int(spread_b.attention_mask.sum()) == int(equal_b.attention_mask.sum())
    return spread_b, equal_b


@contextlib.contextmanager
def row_order():
    """Micro-batches cut as the rows come (the padded path the length order replaced)."""
    saved = micro_batches.length_order
    micro_batches.length_order = lambda b: torch.arange(len(b))
    try:
        yield
    finally:
        micro_batches.length_order = saved


def computed_share(batch, mb: int, packed: bool) -> float:
    """Real tokens / positions the backbone runs, over the pass's micro-batches."""
    ran = 0
    for rows in micro_batches.micro_batch_rows(batch, mb):
        micro = batch.select(rows)
        ran += pack(micro).input_ids.numel() if packed else micro.input_ids.numel()
    return float(batch.attention_mask.sum()) / ran


def time_pass(model, cfg, batch, reps: int, device: str) -> float:
    rewards = torch.tensor([float(i % 3 == 0) for i in range(len(batch))], device=device)
    a = cfg.algorithm
    adv = ADVANTAGES.get(a.name)(AdvantageInputs(rewards=rewards, mask=batch.mask, group_size=a.group_size), a.options)
    learner = Learner(cfg=cfg, model=model, backward=lambda loss: loss.backward())
    clock = time.process_time if device == "cpu" else time.perf_counter
    best = float("inf")
    for i in range(reps + 1):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        t = clock()
        policy_gradient_pass(learner, batch, adv)
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            best = min(best, clock() - t)
    return best


def run(device: str, args) -> None:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    hidden, layers, vocab = (args.hidden, args.layers, args.vocab) if device == "cpu" else (896, 8, 32768)
    rows = args.rows if device == "cpu" else 4 * args.rows
    model = build_model(hidden, layers, vocab, dtype, device)
    spread_b, equal_b = batches(rows, args.min_len, args.spread, vocab, device)
    tokens = int(spread_b.attention_mask.sum())
    c = spread_b.mask.sum(1)
    unit = f"CPU seconds, {torch.get_num_threads()} thread(s)" if device == "cpu" else "wall seconds"
    print(f"\n{device} ({dtype}; {unit}): Qwen2-shaped hidden {hidden}, {layers} layers, vocab {vocab}, "
          f"LoRA r 16; {rows} rows, completions {int(c.min())}..{int(c.max())} tokens, prompts 24..40; "
          f"{tokens} real tokens per batch", flush=True)
    for mb in (args.micro_batch_size, rows):
        over = [f"train.micro_batch_size={mb}", f"algorithm.group_size={8 if rows % 8 == 0 else 1}"]
        cfg = load_recipe(REPO / "recipes/grpo_tiny.yaml", over, check_paths=False)
        cfg_pack = load_recipe(REPO / "recipes/grpo_tiny.yaml", over + ["train.pack_sequences=true"],
                               check_paths=False)
        variants = [("equal", cfg, equal_b, contextlib.nullcontext, False),
                    ("rows", cfg, spread_b, row_order, False),
                    ("bucketed", cfg, spread_b, contextlib.nullcontext, False),
                    ("packed", cfg_pack, spread_b, contextlib.nullcontext, True)]
        results = {}
        for name, c_, b, ctx, packed in variants:
            with ctx():
                results[name] = (time_pass(model, c_, b, args.reps, device), computed_share(b, mb, packed))
        eq = tokens / results["equal"][0]
        print(f"micro-batch {mb} rows\n{'variant':<10} {'seconds':>8} {'tokens/s':>10} {'vs equal':>9} "
              f"{'computed':>9}")
        for name, (sec, share) in results.items():
            print(f"{name:<10} {sec:8.3f} {tokens / sec:10.0f} {tokens / sec / eq:9.2f} {share:9.0%}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=16, help="shortest completion (the longest is --spread times it)")
    ap.add_argument("--spread", type=float, default=10.0)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    ap.add_argument("--quick", action="store_true", help="16 rows, hidden 128, 2 layers")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: CPU, then CUDA when present")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.hidden, args.layers, args.micro_batch_size = 16, 128, 2, 4
    devices = {"auto": ["cpu"] + (["cuda"] if torch.cuda.is_available() else []), "cpu": ["cpu"],
               "cuda": ["cuda"]}[args.device]
    torch.set_num_threads(args.threads)
    for device in devices:
        run(device, args)
    if "cuda" not in devices:
        print("\nCUDA: not present, not measured")


if __name__ == "__main__":
    main()
