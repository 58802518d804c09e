"""Rows of bench/gpu/gpu_check.py on issue 57 item 7's scale-out paths: the LoRA adapter served under data parallelism,
and the OLMoE recipe as it resolves on CUDA (adapter + routes). Neither path has run on a GPU: what the rows expect
was read from vLLM 0.32's source (Model Runner V2's LoRA state, ``vllm/v1/worker/gpu/lora_utils.py``; its routed
experts capture, ``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py``) and from the trainer's rules,
which the CPU tests pin (tests/bench/test_gpu_rows_scaleout_adapters.py: the recipe's resolution, the pass rules);
these rows are the first run.

- ``dp_adapter_row`` (vLLM's CUDA build): ``torchrun`` of bench/gpu/gpu_worker_adapter_dp.py, 2 ranks with 2 GPUs
  (each rank's colocated engine on GPU ``LOCAL_RANK``, vLLM's ``external_launcher``), else the 1-rank fallback of a
  one-GPU machine (as gpu_rows_distributed.py's rows; the cross-rank comparison then has one rank). Each rank runs
  ``parityrl train recipes/grpo_tiny.yaml`` (the product's entry, ``-m trainer.train``'s) with
  ``rollout.lora_sync=adapter`` for 2 steps and records, after every sync, the adapter version its engine serves
  and a digest of the adapter files vLLM loaded. Expected (pass): exit 0 on every rank; every sync in adapter
  mode; each rank's engine serves versions 1, 2, 3 (the start's sync, then one per step), equal to its trainer's;
  the digests of each version equal across ranks (the all-reduced update gives every rank the same adapter);
  each rank's engine on ``cuda:<LOCAL_RANK>``; every step's pooled ``parity/mae`` within the bf16 recipe's level
  for the tiny model's depth (``trainer.precision.levels.parity_level``, up to the ``MAE_WARN_FACTOR`` that
  ``parityrl doctor`` and ``compare`` call WARN; beyond it they say FAIL).
- ``olmoe_row`` (vLLM's CUDA build): ``parityrl train recipes/grpo_olmoe_gpu.yaml`` as written, except what no
  offline machine has or a short check cannot spend: the model is a random OLMoE of reduced size
  (``OLMOE_SHAPE``: OLMoE-1B-7B's 64 experts, top-8 and vocabulary, 4 layers of hidden 512; the real model needs the
  hub), the data 16 arithmetic rows in the recipe's columns, 2 steps of 4 prompts x 4 samples of at most 16 tokens,
  a 1 GiB KV cache and ``parity.unreplayed_every=1``. On CUDA the recipe resolves to the adapter sync
  (``rollout.lora_sync`` auto: an MoE model serves its adapter there; on vLLM's CPU build it falls back to merged)
  and to routing replay (``parity.routing_replay: on``). Expected (pass): exit 0, both steps logged; no "merged"
  fallback announced and one adapter tensor set per sync (``perf/sync_chunks`` 1); routes returned for every routed
  position (``parity/routing_unrouted`` 0) and replayed (``parity/unreplayed/mae`` logged beside ``parity/mae``);
  every step's ``parity/mae`` within the bf16 level for 4 layers as above. ``parity/routing_agree`` is printed, not
  judged: the random router's near-uniform scores make the unreplayed top-8 sets a coin toss.
"""
from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import torch
from gpu_rows_common import BENCH, KV_BYTES, REPO, gpu_count, need_vllm_cuda, run_process, tail, train

from trainer.lifecycle.preflight import load_recipe
from trainer.models.routing_mode import routing_mode
from trainer.precision.levels import parity_level
from trainer.precision.lora_sync import ADAPTER, lora_sync_mode
from trainer.precision.registry import recipe_for
from trainer.precision.verdict import MAE_WARN_FACTOR

DP_ADAPTER_ROWS = ("LoRA adapter served under data parallel",)
OLMOE_ROWS = ("OLMoE recipe on CUDA: adapter + routes, 2 steps",)
STEPS = 2
DP_RECIPE = REPO / "recipes" / "grpo_tiny.yaml"
OLMOE_RECIPE = REPO / "recipes" / "grpo_olmoe_gpu.yaml"
# OLMoE-1B-7B's routing (64 experts, top-8, no top-k renormalisation) and vocabulary at a depth and width a short
# check can start and train (the real model: hidden 2048, 16 layers, experts 1024 wide; its config.json).
OLMOE_SHAPE = dict(vocab_size=50304, hidden_size=512, intermediate_size=256, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=8, num_experts=64, num_experts_per_tok=8,
                   norm_topk_prob=False, max_position_embeddings=4096, tie_word_embeddings=False)
MERGED_LINE = "rollout.lora_sync: merged"  # what a run prints when auto falls back (trainer.sampling.policy_sync)


def dp_sets(model_dir: str, run_dir: str) -> list[str]:
    """The data-parallel row's overrides of grpo_tiny (8 prompts: 4 per rank, groups of 4)."""
    return [f"model.path={model_dir}", "rollout.lora_sync=adapter", f"train.steps={STEPS}",
            "rollout.prompts_per_step=8", "algorithm.group_size=4", "eval.every=0", "checkpoint.every=0",
            "logging.wandb.mode=disabled", f"logging.run_dir={run_dir}"]


def olmoe_sets(model_dir: str, data: str) -> list[str]:
    """The OLMoE row's overrides of grpo_olmoe_gpu.yaml: the model and data an offline machine has, a short run."""
    return [f"model.path={model_dir}", f"data.source={data}", f"train.steps={STEPS}", "rollout.prompts_per_step=4",
            "algorithm.group_size=4", "rollout.max_new_tokens=16", "data.max_prompt_tokens=64",
            f"rollout.kv_cache_memory_bytes={KV_BYTES}", "parity.unreplayed_every=1", "eval.every=0"]


def mae_bound(num_layers: int) -> float:
    """The largest parity/mae the rows accept: the bf16 level at this depth times the WARN factor (doctor's FAIL
    begins beyond it, trainer/precision/verdict.py)."""
    return MAE_WARN_FACTOR * parity_level(recipe_for("bf16"), "bfloat16", num_layers)


def olmoe_resolution(sets: Sequence[str], config, cuda: bool) -> tuple[str, str]:
    """(``rollout.lora_sync`` resolved, ``parity.routing_replay`` resolved) for the OLMoE recipe with ``sets`` on a
    model of Transformers ``config``, on CUDA or on vLLM's CPU build (``cuda``)."""
    cfg = load_recipe(OLMOE_RECIPE, list(sets), check_paths=False)
    sync = lora_sync_mode(cfg, model_config=config, cuda=cuda)[0]
    return sync, routing_mode(cfg.parity.routing_replay, config, where=f"recipe {cfg.name!r}")


def _num_layers(model_dir) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"])


def _number(x) -> bool:
    """A figure as metrics.jsonl holds it (JSON writes a float 0.0 as 0, read back as an int)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _mae_problems(rows: list[dict], bound: float) -> list[str]:
    return [f"step {r['step']}: parity/mae {r.get('parity/mae')!r} above {bound:.2e}" for r in rows
            if not (_number(r.get("parity/mae")) and r["parity/mae"] <= bound)]


# ---------------------------------------------------------------- the adapter under data parallel


def adapter_dp_problems(results: list[dict], metrics: list[dict], ranks: int, bound: float) -> list[str]:
    """What in the ranks' records (gpu_worker_adapter_dp.py) and rank 0's metric rows breaks ``dp_adapter_row``'s
    pass rule (the module docstring)."""
    bad = []
    if sorted(r.get("rank") for r in results) != list(range(ranks)):
        return [f"rank records {sorted(r.get('rank') for r in results)}, expected {list(range(ranks))}"]
    versions = list(range(1, STEPS + 2))
    for r in sorted(results, key=lambda r: r["rank"]):
        who, syncs = f"rank {r['rank']}", r.get("syncs", [])
        if r.get("exit") != 0:
            bad.append(f"{who}: exit {r.get('exit')}: {r.get('error', '')}"[:300])
        if r.get("recorder_errors"):
            bad.append(f"{who}: the recorder failed: {r['recorder_errors'][0]}")
        if [s.get("mode") for s in syncs] != [ADAPTER] * len(versions):
            bad.append(f"{who}: sync modes {[s.get('mode') for s in syncs]}, expected {len(versions)} x adapter")
        served = [s.get("served") for s in syncs]
        if served != versions or [s.get("version") for s in syncs] != versions:
            bad.append(f"{who}: engine served versions {served}, trainer's {[s.get('version') for s in syncs]}, "
                       f"expected {versions}")
        if r.get("engine_device") != f"cuda:{r.get('local_rank')}":
            bad.append(f"{who}: engine on {r.get('engine_device')}, expected cuda:{r.get('local_rank')}")
    digests = {r["rank"]: [s.get("digest") for s in r.get("syncs", [])] for r in results}
    for i, v in enumerate(versions):
        seen = {rank: d[i] if i < len(d) else None for rank, d in digests.items()}
        if None in seen.values() or len(set(seen.values())) != 1:
            bad.append(f"adapter version {v}: the ranks' served files differ ({seen})")
    if [m.get("step") for m in metrics] != list(range(1, STEPS + 1)):
        bad.append(f"rank 0 logged steps {[m.get('step') for m in metrics]}, expected {list(range(1, STEPS + 1))}")
    return bad + _mae_problems(metrics, bound)


def _metric_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r for r in rows if isinstance(r.get("step"), int) and r["step"] >= 1]


def dp_adapter_row(tiny: Callable[[], Path]) -> str:
    need_vllm_cuda()
    ranks = 2 if gpu_count() >= 2 else 1
    model_dir = tiny()  # built here, once, before the ranks read it
    bound = mae_bound(_num_layers(model_dir))
    with tempfile.TemporaryDirectory(prefix="gpu_check_adapter_dp_") as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               str(BENCH / "gpu_worker_adapter_dp.py"), tmp, str(DP_RECIPE)]
        for s in dp_sets(str(model_dir), f"{tmp}/run"):
            cmd += ["--set", s]
        proc = run_process(cmd, cap_s=480, what="torchrun gpu_worker_adapter_dp.py",
                           env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        results = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank_*.json"))]
        metrics = _metric_rows(Path(tmp) / "run" / "metrics.jsonl")
    if not results:
        raise AssertionError(f"torchrun exit {proc.returncode}, no rank wrote its record: {tail(proc)}")
    bad = adapter_dp_problems(results, metrics, ranks, bound)
    if proc.returncode != 0:
        bad.insert(0, f"torchrun exit {proc.returncode}: {tail(proc)}")
    maes = ", ".join(f"{m.get('parity/mae', math.nan):.2e}" for m in metrics)
    where = ("2 ranks, engines on " + ", ".join(str(r.get("engine_device")) for r in results) if ranks == 2
             else f"1 rank (the one-GPU fallback: no second rank to compare), engine on {results[0].get('engine_device')}")
    figure = (f"{where}: adapter versions {[s.get('served') for s in results[0].get('syncs', [])]} served alike; "
              f"parity/mae per step {maes} (bound {bound:.1e})")
    if bad:
        raise AssertionError(f"{figure}; " + "; ".join(bad[:5]))
    return figure


# ---------------------------------------------------------------- OLMoE with adapter + routes


def build_olmoe_shaped_model(out: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A random-init OLMoE of ``OLMOE_SHAPE`` in ``out`` with the built-in tiny tokenizer (its 512 ids are a subset
    of the vocabulary; as ``gpu_rows_common.build_shaped_model``)."""
    from transformers import GenerationConfig, OlmoeConfig, OlmoeForCausalLM

    from trainer.builtin.tiny import build_tokenizer

    tok = build_tokenizer(512, OLMOE_SHAPE["max_position_embeddings"])
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = OlmoeForCausalLM(OlmoeConfig(**OLMOE_SHAPE, **ids)).to(dtype)
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def arithmetic_rows(out: Path, n: int = 16) -> Path:
    """``n`` arithmetic problems in the OLMoE recipe's columns (``question``, ``answer``), one JSON row a line."""
    rows = [{"question": f"What is {3 + 7 * i} plus {11 + 5 * i}?", "answer": str(14 + 12 * i)} for i in range(n)]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def olmoe_problems(rows: list[dict], stdout: str, bound: float) -> list[str]:
    """What in the run's metric rows (steps >= 1) and its stdout breaks ``olmoe_row``'s pass rule."""
    bad = []
    if [r.get("step") for r in rows] != list(range(1, STEPS + 1)):
        bad.append(f"steps logged {[r.get('step') for r in rows]}, expected {list(range(1, STEPS + 1))}")
    if MERGED_LINE in stdout:
        line = next(x for x in stdout.splitlines() if MERGED_LINE in x)
        bad.append(f"the run fell back to the merged sync: {line.strip()[:200]}")
    for r in rows:
        if r.get("perf/sync_chunks") != 1.0:
            bad.append(f"step {r['step']}: perf/sync_chunks {r.get('perf/sync_chunks')!r}, expected 1 (one adapter)")
        if r.get("parity/routing_unrouted") != 0:
            bad.append(f"step {r['step']}: parity/routing_unrouted {r.get('parity/routing_unrouted')!r}, expected 0")
        if not _number(r.get("parity/unreplayed/mae")):
            bad.append(f"step {r['step']}: no parity/unreplayed/mae (the step was not replayed)")
    return bad + _mae_problems(rows, bound)


def olmoe_row(root: Path) -> str:
    need_vllm_cuda()
    model_dir = root / "olmoe_shape"
    if not (model_dir / "config.json").is_file():
        build_olmoe_shaped_model(model_dir)
    with tempfile.TemporaryDirectory(prefix="gpu_check_olmoe_") as tmp:
        data = arithmetic_rows(Path(tmp) / "train.jsonl")
        proc, rows = train(OLMOE_RECIPE.name, olmoe_sets(str(model_dir), str(data)), Path(tmp) / "runs", cap_s=420)
    if proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}, {len(rows)}/{STEPS} steps: {tail(proc)}")
    bound = mae_bound(OLMOE_SHAPE["num_hidden_layers"])
    fmt = lambda key, spec=".2e": ", ".join(format(r.get(key, math.nan), spec) for r in rows)  # noqa: E731
    figure = (f"OLMoE shape (64 experts, top-8, 4 layers), adapter sync, {len(rows)} steps: routing_unrouted "
              f"{fmt('parity/routing_unrouted', '.0f')}, routing_agree {fmt('parity/routing_agree', '.3f')}; "
              f"parity/mae {fmt('parity/mae')} replayed, {fmt('parity/unreplayed/mae')} unreplayed (bound {bound:.1e})")
    bad = olmoe_problems(rows, proc.stdout, bound)
    if bad:
        raise AssertionError(f"{figure}; " + "; ".join(bad[:5]))
    return figure

