"""Benchmark: parity.logprobs.fused_logprobs vs the naive full-logits reference (bf16; CPU, or CUDA).

    .venv/bin/python bench/speed/bench_logprobs.py            # N=4096,H=1024,V=32768 and N=2048,H=1024,V=131072
    .venv/bin/python bench/speed/bench_logprobs.py --quick    # smaller shapes, ~1 minute
    .venv/bin/python bench/speed/bench_logprobs.py --threads 1  # one thread: fair on a loaded machine
    .venv/bin/python bench/speed/bench_logprobs.py --device cuda  # GPU table: see cuda_main

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

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
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


# ----------------------------------------------------------------------------------
# --device cuda: one process, every implementation, the table of issue 25
# ----------------------------------------------------------------------------------
#
# Qwen2.5-7B's lm_head in bf16; per-token log-probs and a per-token upstream gradient.
# Modes: values (no_grad), frozen (grad to hidden: LoRA), full (hidden and lm_head),
# entropy (frozen, entropy differentiable and in the loss: PPO with ent_coef > 0),
# entropy_logged (frozen, entropy returned detached: what the loop needs when it only logs it).
# Time: median of --reps (default 5) after 2 warm-ups, CUDA-synchronised wall time. Memory:
# peak allocated during one call minus allocated before it (includes the returned gradients,
# the same for every variant). Accuracy against float64 over every row (``reference_float64``,
# in row chunks on the device): max |log-prob error|, the relative error of grad_hidden
# (frozen and full) and of grad_weight on REF_VOCAB_ROWS sampled vocabulary rows (full).
CUDA_H, CUDA_V = 3584, 152064
CUDA_NS = (16384, 65536)
CUDA_MODES = ("values", "frozen", "full", "entropy", "entropy_logged")
REF_VOCAB_ROWS = 512
REF_CHUNK_ROWS = 512
CUDA_DEVICE = "cuda"  # a name, so the table code can be dry-run on CPU with small shapes


def _cuda_variants():
    """name -> fn(hidden, weight, targets, entropy: None | "grad" | "detached") -> (logprob, entropy or None)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    # late: after the sys.path insert, as child() does
    import parity.logprobs.fused as fused  # fused_logprobs looks its backend up here
    from parity.logprobs import fused_logprobs, naive_logprobs
    from parity.logprobs.optional_triton import logprobs_triton
    from parity.logprobs.torch_path import _ChunkedLogProbs

    def naive(h, w, t, ent):
        return naive_logprobs(h, w, t, return_entropy=ent is not None)

    def ours(backend):
        def run(h, w, t, ent):
            saved = fused._backend_for
            fused._backend_for = lambda _h: backend  # pin the backend for this variant
            try:
                return fused_logprobs(h, w, t, return_entropy=ent is not None, entropy_grad=ent == "grad")
            finally:
                fused._backend_for = saved
        return run

    out = {"naive": naive, "torch": ours(_ChunkedLogProbs)}
    if logprobs_triton is not None:
        out["triton"] = ours(logprobs_triton.TritonLogProbs)
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        def liger(h, w, t, ent):
            if ent is not None:
                return None
            loss = liger_fused_linear_cross_entropy(h, w, t, reduction="none")
            return -(loss[0] if isinstance(loss, tuple) else loss), None

        out["liger"] = liger
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy

        def cce(h, w, t, ent):
            return None if ent is not None else (-linear_cross_entropy(h, w, t, reduction="none"), None)

        out["cce"] = cce
    except ImportError:
        pass
    return out


def _cuda_once(fn, mode, hidden, weight, targets, a, b):
    """One call of ``fn`` in ``mode``; returns (logprob, entropy) or None if the variant lacks the mode."""
    import torch

    hidden.grad = weight.grad = None
    hidden.requires_grad_(mode != "values")
    weight.requires_grad_(mode == "full")
    ent = {"entropy": "grad", "entropy_logged": "detached"}.get(mode)
    with torch.set_grad_enabled(mode != "values"):
        res = fn(hidden, weight, targets, ent)
        if res is None:
            return None
        lp, e = res
        if mode != "values":
            loss = (a * lp).sum()
            if mode == "entropy":
                loss = loss + (b * e).sum()
            loss.backward()
    return lp.detach(), e


def _cuda_measure(fn, mode, inputs, reps, sampled=None):
    """Time, peak memory, and what the accuracy columns compare: every row's log-prob; grad_hidden (frozen, full);
    grad_weight on the ``sampled`` vocabulary rows (full)."""
    import torch

    try:
        for _ in range(2):
            if _cuda_once(fn, mode, *inputs) is None:
                return None
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            _cuda_once(fn, mode, *inputs)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        lp, _ = _cuda_once(fn, mode, *inputs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"oom": True}
    res = {"oom": False, "time": statistics.median(times), "peak": peak, "lp": lp.float()}
    if mode in ("frozen", "full"):
        res["grad_h"] = inputs[0].grad.float()
    if mode == "full" and sampled is not None:
        res["grad_w"] = inputs[1].grad[sampled].double()
    inputs[0].grad = inputs[1].grad = None
    torch.cuda.empty_cache()
    return res


def reference_float64(hidden, weight, targets, a, sampled, chunk=REF_CHUNK_ROWS):
    """float64 log-probs and grad_hidden of every row, and grad_weight on the ``sampled`` vocabulary rows, for the
    loss sum_i a_i logprob_i: row chunks of full float64 logits, so N = 65536 at V = 152k fits (one chunk is
    ``chunk`` x V doubles). d logprob_i / d z_i = onehot(t_i) - p_i; grad_hidden_i = a_i (onehot - p_i) W;
    grad_weight[S] = sum_i a_i (onehot - p_i)[S]^T h_i."""
    import torch

    w64 = weight.detach().double()
    n = hidden.shape[0]
    lp = torch.empty(n, dtype=torch.float64, device=hidden.device)
    gh = torch.empty(n, hidden.shape[1], dtype=torch.float64, device=hidden.device)
    gw = torch.zeros(len(sampled), hidden.shape[1], dtype=torch.float64, device=hidden.device)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        h = hidden[r0:r1].detach().double()
        # The logits as every implementation sees them: a GEMM in the input dtype, rounded to it.
        z = (hidden[r0:r1].detach() @ weight.detach().T).double()
        logp = torch.log_softmax(z, dim=1)
        del z
        t = targets[r0:r1]
        lp[r0:r1] = logp.gather(1, t[:, None]).squeeze(1)
        d = -logp.exp_()  # -p, in place
        d.scatter_add_(1, t[:, None], torch.ones_like(t[:, None], dtype=d.dtype))
        d *= a[r0:r1].double()[:, None]
        gh[r0:r1] = d @ w64
        gw += d[:, sampled].T @ h
        del d, logp
    return lp, gh, gw


def _rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def cuda_main(ns, reps, json_path) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch")
    reps = reps or 5
    variants = _cuda_variants()
    dev = torch.device(CUDA_DEVICE)
    print(f"{torch.cuda.get_device_name(dev)}; torch {torch.__version__}; bf16, H={CUDA_H}, V={CUDA_V}; "
          f"variants: {', '.join(variants)}; median of {reps} after 2 warm-ups", flush=True)
    everything = []
    for n in ns or CUDA_NS:
        torch.manual_seed(0)
        hidden = torch.randn(n, CUDA_H, device=dev, dtype=torch.bfloat16)
        weight = (torch.randn(CUDA_V, CUDA_H, device=dev, dtype=torch.bfloat16) * CUDA_H**-0.5)
        targets = torch.randint(0, CUDA_V, (n,), device=dev)
        a, b = torch.randn(n, device=dev), 0.01 * torch.randn(n, device=dev)
        sampled = torch.randperm(CUDA_V, device=dev)[:REF_VOCAB_ROWS]
        ref_lp, ref_gh, ref_gw = reference_float64(hidden, weight, targets, a, sampled)
        inputs = (hidden, weight, targets, a, b)
        res = {}
        for mode in CUDA_MODES:
            for name, fn in variants.items():
                r = _cuda_measure(fn, mode, inputs, reps, sampled)
                res[(name, mode)] = r
                if r is not None and not r["oom"]:
                    r["lp_err"] = (r.pop("lp") - ref_lp).abs().max().item()
                    if "grad_h" in r and mode in ("frozen", "full"):
                        r["gh_rel"] = _rel(r.pop("grad_h"), ref_gh)
                    if "grad_w" in r:
                        r["gw_rel"] = _rel(r.pop("grad_w"), ref_gw)
                    r.pop("grad_h", None)
                everything.append({"n": n, "variant": name, "mode": mode, **(r or {"missing": True})})
        _cuda_report(n, res, list(variants))
        del hidden, weight, inputs
        torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            json.dump(everything, f, indent=1)


def _cuda_report(n, res, names) -> None:
    flops = 2 * n * CUDA_H * CUDA_V
    print(f"\n=== N={n} H={CUDA_H} V={CUDA_V} bf16: median ms (ratio to naive), peak extra GiB ===")
    print(f"{'mode':15s}" + "".join(f"{name:>24s}" for name in names))
    for mode in CUDA_MODES:
        naive = res.get(("naive", mode))
        base = naive["time"] if naive and not naive["oom"] else None
        cells = []
        for name in names:
            r = res[(name, mode)]
            if r is None:
                cells.append("—")
            elif r["oom"]:
                cells.append("OOM")
            else:
                ratio = f" ({r['time'] / base:.2f}x)" if base else ""
                cells.append(f"{r['time'] * 1e3:.0f} ms{ratio}, {r['peak'] / 2**30:.2f} G")
        print(f"{mode:15s}" + "".join(f"{c:>24s}" for c in cells))
    print("values TFLOP/s: " + ", ".join(
        f"{name} {flops / res[(name, 'values')]['time'] / 1e12:.0f}" for name in names
        if res[(name, "values")] and not res[(name, "values")]["oom"]))
    for name in names:
        cells = [f"{mode} {key} {res[(name, mode)][key]:.1e}" for mode in ("values", "frozen", "full")
                 for key in ("lp_err", "gh_rel", "gw_rel")
                 if res[(name, mode)] and not res[(name, mode)]["oom"] and key in res[(name, mode)]
                 and (key != "lp_err" or mode == "values")]
        print(f"accuracy vs float64, every row ({name}): " + ", ".join(cells))
    if "liger" in names and "triton" in names:
        print("triton / liger: " + ", ".join(
            f"{mode} {res[('triton', mode)]['time'] / res[('liger', mode)]['time']:.2f}" for mode in CUDA_MODES
            if all(res[(x, mode)] and not res[(x, mode)]["oom"] for x in ("triton", "liger"))))
    print("goals (issue 25): triton values and frozen <= 0.9x liger, full <= 1.0x liger, "
          "entropy_logged <= 1.15x frozen, grad_h and grad_w (sampled rows) rel <= 3e-3")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes (about a minute)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per variant (default 3, quick 2)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (default: torch's default)")
    p.add_argument("--json", default=None, help="also write all raw results to this file")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: naive, parityrl's torch and Triton paths, Liger / cut-cross-entropy, in one process")
    p.add_argument("--n", type=int, nargs="*", default=None, help="with --device cuda: token counts (default 16384 65536)")
    p.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cuda":
        cuda_main(args.n, args.reps, args.json)
        return
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
