"""Peak RSS of one training micro-batch (LoRA forward + fused log-probs + backward) by micro-batch size.

    python bench/speed/bench_train_memory.py [--model builtin:smollm2-135m] [--prompt 64] [--completion 64] 4 8 16 32
    python bench/speed/bench_train_memory.py --gradient-checkpointing 4 8 16 32   # train.gradient_checkpointing: true

Each size runs in a fresh process (ru_maxrss only grows), and prints the process's peak
RSS after loading the model and after one forward/backward of ``mbs`` random sequences of
prompt + completion tokens, plus the difference per 1k tokens: what ``train.micro_batch_size``
costs on top of the model. The rollout engine (its weights and ``rollout.kv_cache_memory_bytes``)
comes on top in a real run. Prints numbers, asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def one(model: str, mbs: int, prompt: int, completion: int, checkpointing: bool = False) -> dict:
    import torch

    from trainer.builtin.resolve import resolve_model_path
    from trainer.config.schema import LoraConfig
    from trainer.models.batch import build_token_batch
    from trainer.models.checkpointing import enable_gradient_checkpointing
    from trainer.models.policy import add_lora, completion_logprobs, load_base_model

    torch.manual_seed(0)
    policy = add_lora(load_base_model(resolve_model_path(model), "bfloat16"), LoraConfig()).train()
    if checkpointing:  # as load_policy does with train.gradient_checkpointing (train mode: it only acts there)
        enable_gradient_checkpointing(policy)
    loaded = _peak_mib()
    vocab = policy.config.vocab_size
    ids = lambda n: torch.randint(3, vocab, (n,)).tolist()  # noqa: E731
    batch = build_token_batch([ids(prompt) for _ in range(mbs)], [ids(completion) for _ in range(mbs)], pad_id=0)
    lp, _ = completion_logprobs(policy, batch, temperature=1.0)
    (-(lp * batch.mask).sum() / batch.mask.sum()).backward()
    step = _peak_mib()
    tokens = mbs * (prompt + completion)
    return {"micro_batch_size": mbs, "tokens": tokens, "gradient_checkpointing": checkpointing, "peak_after_load_mib": round(loaded),
            "peak_after_step_mib": round(step), "mib_per_1k_tokens": round((step - loaded) / tokens * 1000, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sizes", nargs="*", type=int, default=[4, 8, 16, 32])
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--gradient-checkpointing", action="store_true", help="train.gradient_checkpointing: true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one(a.model, a.sizes[0], a.prompt, a.completion, a.gradient_checkpointing)))
        return
    for mbs in a.sizes:
        out = subprocess.run([sys.executable, __file__, "--child", "--model", a.model, "--prompt", str(a.prompt),
                              "--completion", str(a.completion), str(mbs)]
                             + (["--gradient-checkpointing"] if a.gradient_checkpointing else []),
                             capture_output=True, text=True, check=True)
        print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
