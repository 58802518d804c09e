"""Multi-turn episodes against single-turn completions: sampled tokens per second, in one invocation.

    python bench/speed/bench_episodes.py [--episodes 32] [--turns 4] [--tokens 16] [--repeats 3]

Episodes (trainer/sampling/episodes.py) advance one turn for every live episode per engine call: ``--episodes``
episodes of ``--turns`` assistant turns, each turn up to ``--tokens`` new tokens, every reply a short user
message. Three baselines on the same vLLM engine (the built-in tiny model, warm-started), alternating,
``--repeats`` times each (medians):

* ``single-turn, wide``: ``episodes x turns`` single-turn completions of up to ``--tokens`` tokens in one call:
  about the same number of sampled tokens, with ``turns`` times the concurrency;
* ``single-turn, narrow``: ``episodes`` completions of up to ``turns x tokens`` tokens: the same number of
  sequences and the same token cap (the tiny model stops early on its own, so fewer tokens are sampled);
* ``engine alone``: the episodes' own requests (every turn's prompts, recorded from an episode run) replayed
  as bare ``generate`` calls: the same work without the episode loop (parsing, environment steps in threads,
  rendering the replies, bookkeeping), so the ratio is the loop's overhead.

What the episodes pay against the wide batch is the T sequential rounds at 1/T of its concurrency: on a CPU a
decode step of the tiny model costs about the same for 32 or 128 sequences, so that ratio is near 1/T there
and closer to 1 where a step's cost grows with the batch (a large model, a GPU).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before anything imports vllm
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

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
    from trainer.config import RolloutConfig
    from trainer.data.datasets import encode_prompts
    from trainer.data.tasks.arithmetic import arithmetic_dataset
    from trainer.environments.episode_environment import EpisodeLimits
    from trainer.models.policy import load_tokenizer
    from trainer.sampling.episodes import run_episodes

    model_dir = resolve_model_path("builtin:tiny")
    tok = load_tokenizer(model_dir)
    rows = list(arithmetic_dataset(args.episodes * args.turns, seed=0))
    limits = EpisodeLimits(max_turns=args.turns, max_tokens=256, max_observation_tokens=32)
    with VLLMEngine(model_dir, dtype="bfloat16", max_model_len=256, seed=0, kv_cache_memory_bytes=256 * 1024**2,
                    enforce_eager=True, gpu_memory_utilization=RolloutConfig.gpu_memory_utilization) as engine:
        single_prompts = encode_prompts(tok, [r["prompt"] for r in rows])

        def episode_run(seed: int, eng) -> tuple[int, float]:
            t = time.perf_counter()
            rollouts, _ = run_episodes(eng, tok, [[{"role": "user", "content": r["prompt"]}]
                                                  for r in rows[:args.episodes]], rows, AskAgain,
                                       SamplingSpec(n=1, max_new_tokens=args.tokens, seed=seed), limits)
            return rollouts.num_sampled_tokens, time.perf_counter() - t

        def single(prompts, tokens: int, seed: int) -> tuple[int, float]:
            t = time.perf_counter()
            out = engine.generate(prompts, SamplingSpec(n=1, max_new_tokens=tokens, seed=seed))
            return out.num_sampled_tokens, time.perf_counter() - t

        def replay(seed: int) -> tuple[int, float]:
            recorder = Recorder(engine)
            episode_run(seed, recorder)
            t, n = time.perf_counter(), 0
            for prompts, spec in recorder.calls:
                n += engine.generate(prompts, spec).num_sampled_tokens
            return n, time.perf_counter() - t

        cases = {"single-turn, wide": lambda s: single(single_prompts, args.tokens, s),
                 "single-turn, narrow": lambda s: single(single_prompts[:args.episodes], args.tokens * args.turns, s),
                 "engine alone": replay,
                 f"{args.turns}-turn episodes": lambda s: episode_run(s, engine)}
        for fn in cases.values():  # warm-up: compiled paths, caches
            fn(0)
        runs = {name: [] for name in cases}
        for r in range(args.repeats):
            for name, fn in cases.items():
                runs[name].append(fn(1 + r))
    rate = {k: statistics.median(n / t for n, t in v) for k, v in runs.items()}
    tokens = {k: statistics.median(n for n, _ in v) for k, v in runs.items()}
    episodes = f"{args.turns}-turn episodes"
    print(f"CPU: {os.cpu_count()} cores, tiny model, bf16, {args.repeats} runs each (median)")
    for name in runs:
        ratio = "" if name == episodes else f"   episodes / this: {rate[episodes] / rate[name]:.2f}"
        print(f"{name:22s} {int(tokens[name]):6d} sampled tokens per batch, {rate[name]:7.0f} tokens/s{ratio}")


class Recorder:
    """The engine, with every generate call's prompts and spec kept (to replay them bare)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, spec):
        self.calls.append(([list(p) for p in prompts], spec))
        return self.engine.generate(prompts, spec)


if __name__ == "__main__":
    main()
