"""The vLLM CPU engine's rollout speed on a machine it shares: thread settings, idle and beside a busy neighbour.

    .venv/bin/python bench/speed/bench_shared_cpu.py                       # every setting, idle and beside a neighbour
    .venv/bin/python bench/speed/bench_shared_cpu.py --settings auto,one-thread --batches 3

The work is one rollout of the demo's shape: 8 prompts x 8 samples x up to 96 new tokens from the built-in
tools model in bfloat16, timed over ``--batches`` batches after one warm-up. Each setting runs in a process
of its own (vLLM reads its thread settings once, when the engine starts), first on its own and then beside
a neighbour: a second process that trains a small MLP with torch's default threads, as another training run
or test session on the same cores would. Prints completion tokens per second and the slowdown the neighbour
causes for each setting. No assertions: numbers only.

Why it exists: the colocated engine runs in the trainer's process, whose OpenMP pool has one thread per core
(vLLM binds threads only in its multiprocess executor), and every decode step of a 1 M-parameter model is
hundreds of tiny parallel regions, each ending in a barrier. When a neighbour holds one of the cores, each
barrier waits for the descheduled thread's next time slice.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (name, environment the engine process gets, what it means)
SETTINGS = {
    "auto": ({}, "vLLM's default: one pinned OpenMP thread per core"),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, "pinned, threads sleep at barriers instead of spinning"),
    "nobind": ({"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, "one thread per core, not pinned"),
    "one-thread": ({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"},
                   "a single unpinned thread: no barriers"),
}


def engine_worker(batches: int) -> None:
    """Start the engine, run one warm-up and ``batches`` timed rollouts, print tokens/s as JSON."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(ROOT))
    from rollout.types import SamplingSpec
    from rollout.vllm_engine import VLLMEngine
    from trainer.builtin.resolve import resolve_model_path
    from trainer.config import RolloutConfig
    from trainer.data.tasks.arithmetic_tools import arithmetic_tools_dataset
    from trainer.environments.arithmetic_tools import calculate
    from trainer.environments.tools import Toolbox
    from trainer.models.policy import load_tokenizer

    model = str(resolve_model_path("builtin:tiny-tools"))
    tok = load_tokenizer(model)
    rows = arithmetic_tools_dataset(8, seed=0)
    tools = Toolbox([calculate]).schemas  # offered as the demo's episodes offer it, so the samples call it
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tools=tools, add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"] for p in rows["prompt"]]
    engine = VLLMEngine(model, dtype="bfloat16", max_model_len=256, eos_ids=[tok.eos_token_id],
                        kv_cache_memory_bytes=256 * 1024**2, enforce_eager=True,
                        gpu_memory_utilization=RolloutConfig.gpu_memory_utilization)
    rates = []
    for i in range(batches + 1):
        spec = SamplingSpec(n=8, temperature=1.0, max_new_tokens=96, seed=i)
        t0 = time.perf_counter()
        out = engine.generate(prompts, spec)
        if i:  # the first batch carries the warm-up
            rates.append(out.num_completion_tokens / (time.perf_counter() - t0))
    engine.close()
    print(json.dumps({"tokens_per_s": rates}))


def neighbour() -> None:
    """A busy neighbour: an MLP trained forever with torch's default threads (killed by the parent)."""
    import torch

    net = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(256, 512)
    while True:
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()


def run_setting(name: str, batches: int, busy: bool) -> float:
    env = {**os.environ, **SETTINGS[name][0], "VLLM_LOGGING_LEVEL": "ERROR"}
    other = subprocess.Popen([sys.executable, __file__, "--neighbour"]) if busy else None
    try:
        if other is not None:
            time.sleep(2)  # the neighbour is busy before the engine starts
        out = subprocess.run([sys.executable, __file__, "--engine-worker", "--batches", str(batches)], env=env,
                             check=True, capture_output=True, text=True).stdout
    finally:
        if other is not None:
            other.kill()
            other.wait()
    rates = json.loads(out.strip().splitlines()[-1])["tokens_per_s"]
    return sorted(rates)[len(rates) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {list(SETTINGS)}")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--engine-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--neighbour", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine_worker:
        return engine_worker(args.batches)
    if args.neighbour:
        return neighbour()
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        ap.error(f"--settings: unknown {unknown}; expected some of {list(SETTINGS)}")
    print(f"{os.cpu_count()} CPUs; demo-shaped rollout (64 samples x <= 96 tokens, builtin:tiny-tools, bfloat16); "
          f"median tokens/s of {args.batches} batches")
    print(f"{'setting':12s} {'idle tok/s':>10s} {'busy tok/s':>10s} {'slowdown':>8s}  meaning")
    for name in names:
        idle = run_setting(name, args.batches, busy=False)
        busy = run_setting(name, args.batches, busy=True)
        print(f"{name:12s} {idle:10.0f} {busy:10.0f} {idle / busy:7.1f}x  {SETTINGS[name][1]}", flush=True)


if __name__ == "__main__":
    main()
