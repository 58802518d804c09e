"""Multi-turn episodes against single-turn completions: sampled tokens per second, in one invocation.

    python bench/bench_episodes.py [--episodes 32] [--turns 4] [--tokens 16] [--repeats 3]

Episodes (trainer/rl/episodes.py) advance one turn for every live episode per engine call: ``--episodes``
episodes of ``--turns`` assistant turns, each turn up to ``--tokens`` new tokens, every reply a short user
message. The baseline samples ``episodes x turns`` single-turn completions of up to ``--tokens`` tokens in one
call: about the same number of sampled tokens. Both run on the same vLLM engine (the built-in tiny model,
warm-started), alternating, ``--repeats`` times each; the script prints both rates and their ratio (the issue's
goal: episodes >= 0.8x). What the episodes pay on top: one call per turn instead of one, the prefill of the
growing history (vLLM's prefix cache holds the earlier turns), the environment steps and the replies' rendering.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before anything imports vllm
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.types import SamplingSpec  # noqa: E402


class AskAgain:
    """Replies to every turn with the same short question until the episode's last turn."""

    def reset(self, row):
        return None

    def step(self, message):
        return [{"role": "user", "content": "And then?"}], None, False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from rollout.vllm_engine import VLLMEngine
    from trainer.builtin.resolve import resolve_model_path
    from trainer.data.datasets import encode_prompts
    from trainer.data.tasks.arithmetic import arithmetic_dataset
    from trainer.models.policy import load_tokenizer
    from trainer.rl.episodes import EpisodeLimits, run_episodes

    model_dir = resolve_model_path("builtin:tiny")
    tok = load_tokenizer(model_dir)
    rows = list(arithmetic_dataset(args.episodes * args.turns, seed=0))
    limits = EpisodeLimits(max_turns=args.turns, max_tokens=256, max_observation_tokens=32)
    with VLLMEngine(model_dir, dtype="bfloat16", max_model_len=256, seed=0, kv_cache_memory_bytes=256 * 1024**2,
                    enforce_eager=True) as engine:
        single_prompts = encode_prompts(tok, [r["prompt"] for r in rows])

        def episodes(seed: int) -> tuple[int, float]:
            t = time.perf_counter()
            rollouts, _ = run_episodes(engine, tok, [[{"role": "user", "content": r["prompt"]}]
                                                     for r in rows[:args.episodes]], rows, AskAgain,
                                       SamplingSpec(n=1, max_new_tokens=args.tokens, seed=seed), limits)
            return rollouts.num_sampled_tokens, time.perf_counter() - t

        def single(seed: int) -> tuple[int, float]:
            t = time.perf_counter()
            out = engine.generate(single_prompts, SamplingSpec(n=1, max_new_tokens=args.tokens, seed=seed))
            return out.num_sampled_tokens, time.perf_counter() - t

        single(0), episodes(0)  # warm-up: compiled paths, caches
        runs = {"episodes": [], "single": []}
        for r in range(args.repeats):
            for name, fn in (("episodes", episodes), ("single", single)):
                runs[name].append(fn(1 + r))
    rate = {k: statistics.median(n / s for n, s in v) for k, v in runs.items()}
    tokens = {k: statistics.median(n for n, _ in v) for k, v in runs.items()}
    print(f"CPU: {os.cpu_count()} cores, tiny model, bf16, {args.repeats} runs each (median)")
    print(f"single-turn: {int(tokens['single'])} sampled tokens per batch, {rate['single']:.0f} tokens/s")
    print(f"{args.turns}-turn episodes: {int(tokens['episodes'])} sampled tokens per batch, "
          f"{rate['episodes']:.0f} tokens/s")
    print(f"ratio episodes / single-turn: {rate['episodes'] / rate['single']:.2f}")


if __name__ == "__main__":
    main()
