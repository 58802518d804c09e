"""Benchmark: parity.logprobs.fused_logprobs vs the naive full-logits reference (bf16, CPU).

    .venv/bin/python bench/bench_logprobs.py            # N=4096,H=1024,V=32768 and N=2048,H=1024,V=131072
    .venv/bin/python bench/bench_logprobs.py --quick    # smaller shapes, ~1 minute
    .venv/bin/python bench/bench_logprobs.py --threads 1  # one thread: fair on a loaded machine

Variants (each measurement runs in its own subprocess, so one variant's allocations
cannot hide or inflate another's peak):
  matmul  bare ``hidden @ weight.T`` of the same shape: the physical floor of the forward
          (forward+backward floors: 3 such matmuls with an lm_head gradient, 2 without);
  naive   full logits, ``log_softmax(logits.float()).gather`` (parity.logprobs.naive_logprobs);
  fused   parity.logprobs.fused_logprobs with its default, budget-derived chunk.
Modes:
  fwd     forward only, under torch.no_grad (how the engine-side comparison calls it);
  full    forward + backward, gradients for hidden and the lm_head weight (full fine-tuning);
  frozen  forward + backward, gradient for hidden only (LoRA: the lm_head is frozen).
The backward is driven by a per-token upstream gradient (a weighted loss), not a sum.

Peak extra memory = (peak RSS during one call, ``resource.getrusage(RUSAGE_SELF).ru_maxrss``)
minus (RSS just before the call, /proc/self/statm), with the inputs already allocated
directly in bf16 so no earlier temporary has raised the high-water mark. It counts every
page the call touches, including the returned gradients (the same for both variants) and
allocator slack; it is what an OOM killer would see. The first call is the measured one;
timings are the minimum (and median) of ``--reps`` further calls, in wall seconds and in
process CPU seconds (``time.process_time``, all threads). The machine may be shared: minima
are the least noisy wall statistic and CPU seconds are less sensitive to other load (but
include OpenMP spin-waiting: when other processes hold the cores, every multi-threaded op
waits for a descheduled peer, which penalises the fused version's ~10x more, smaller ops
far more than the naive one's few big ones; ``--threads 1`` removes that effect).
Timings are never asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

FULL_SHAPES = [(4096, 1024, 32768), (2048, 1024, 131072)]
QUICK_SHAPES = [(1024, 512, 16384), (512, 512, 65536)]
MODES = ("fwd", "full", "frozen")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def child(variant: str, mode: str, n: int, h: int, v: int, reps: int, threads: int) -> dict:
    import torch

    if threads > 0:
        torch.set_num_threads(threads)

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from parity.logprobs import fused_logprobs, naive_logprobs

    torch.manual_seed(0)
    dt = torch.bfloat16
    hidden = torch.randn(n, h, dtype=dt)
    weight = torch.randn(v, h, dtype=dt).mul_(h**-0.5)  # logits of O(1); in place: no temp raising the peak
    targets = torch.randint(0, v, (n,))
    g = torch.randn(n)  # per-token upstream gradient (advantage-weighted loss)
    hidden.requires_grad_(mode in ("full", "frozen"))
    weight.requires_grad_(mode == "full")
    fn = {"naive": naive_logprobs, "fused": fused_logprobs}.get(variant)

    def once():
        hidden.grad = weight.grad = None
        if variant == "matmul":
            with torch.no_grad():
                return hidden @ weight.T
        if mode == "fwd":
            with torch.no_grad():
                return fn(hidden, weight, targets)[0]
        lp, _ = fn(hidden, weight, targets)
        (lp * g).sum().backward()
        return lp

    base_rss, base_max = _rss_bytes(), _maxrss_bytes()
    out = once()
    peak = _maxrss_bytes()
    del out
    times, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        out = once()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        del out
    return {
        "variant": variant, "mode": mode, "n": n, "h": h, "v": v,
        "peak_extra_bytes": peak - base_rss,
        "baseline_polluted": base_max > base_rss + 64 * 2**20,
        "time_min": min(times), "time_median": statistics.median(times), "cpu_min": min(cpu),
        "threads": torch.get_num_threads(),
    }


def run_child(variant, mode, n, h, v, reps, threads) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, mode, str(n), str(h), str(v), str(reps),
           str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mb(x: float) -> str:
    return f"{x / 2**20:8.0f} MiB"


def report(shape, res) -> None:
    n, h, v = shape
    mm, mm_cpu = res[("matmul", "fwd")]["time_min"], res[("matmul", "fwd")]["cpu_min"]
    print(f"\n=== N={n} H={h} V={v} bf16; bare matmul {mm:.3f} s wall ({2 * n * h * v / mm / 1e9:.0f} GFLOP/s), "
          f"{mm_cpu:.3f} s cpu ===")
    floors = {"fwd": 1, "full": 3, "frozen": 2}
    print(f"{'mode':7s} {'naive s':>8s} {'fused s':>8s} {'fused/naive':>11s} {'(cpu)':>6s} {'naive/floor':>11s} "
          f"{'fused/floor':>11s} {'(cpu)':>6s} {'naive peak':>11s} {'fused peak':>11s} {'mem ratio':>9s}")
    for mode in MODES:
        a, b = res[("naive", mode)], res[("fused", mode)]
        floor, floor_cpu = floors[mode] * mm, floors[mode] * mm_cpu
        print(f"{mode:7s} {a['time_min']:8.3f} {b['time_min']:8.3f} {b['time_min'] / a['time_min']:11.2f} "
              f"{b['cpu_min'] / a['cpu_min']:6.2f} {a['time_min'] / floor:11.2f} {b['time_min'] / floor:11.2f} "
              f"{b['cpu_min'] / floor_cpu:6.2f} {_mb(a['peak_extra_bytes']):>11s} {_mb(b['peak_extra_bytes']):>11s} "
              f"{b['peak_extra_bytes'] / max(a['peak_extra_bytes'], 1):9.3f}")
        for r in (a, b):
            if r["baseline_polluted"]:
                print(f"  warning: {r['variant']}/{mode} baseline RSS below its earlier peak; memory figure is a lower bound")
    print("times are minima over the timed calls; (cpu) = the same ratio in process CPU seconds, less sensitive to "
          "other load on the machine. floor = bare matmul x matmuls needed (fwd 1, full 3, frozen 2). "
          "Goals: fused/naive <= 1.2, fused peak <= 1/8 of naive.")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes (about a minute)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per variant (default 3, quick 2)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (default: torch's default)")
    p.add_argument("--json", default=None, help="also write all raw results to this file")
    p.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        variant, mode, n, h, v, reps, threads = args.child
        print(json.dumps(child(variant, mode, int(n), int(h), int(v), int(reps), int(threads))))
        return
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    reps = args.reps or (2 if args.quick else 3)
    print(f"load average at start: {os.getloadavg()}; cpus: {os.cpu_count()}; threads: {args.threads or 'default'}",
          flush=True)
    everything = []
    for shape in shapes:
        res = {("matmul", "fwd"): run_child("matmul", "fwd", *shape, reps, args.threads)}
        for mode in MODES:
            for variant in ("naive", "fused"):
                res[(variant, mode)] = run_child(variant, mode, *shape, reps, args.threads)
                r = res[(variant, mode)]
                print(f"  {variant:6s} {mode:6s} N={shape[0]} V={shape[2]}: {r['time_min']:.3f} s min, "
                      f"{r['time_median']:.3f} s median, {r['cpu_min']:.3f} cpu-s, "
                      f"peak extra {_mb(r['peak_extra_bytes'])}", flush=True)
        report(shape, res)
        everything.extend(res.values())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)


if __name__ == "__main__":
    main()
