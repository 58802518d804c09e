"""Prefix cache on vs off, after ``reset_prefix_cache``, and across a weight sync: the engine's log-probs of the
tokens it samples must not depend on whether a prompt's KV was computed now or read from the cache.

Every leg samples the same requests with the same seeds (8 prompts x a group of ``GROUP`` samples sharing each, T = 1,
no truncation), so identical KV gives identical tokens and log-probs:

- ``off``: the requests skip the cache (vLLM's ``skip_reading_prefix_cache``): the reference every leg is compared to;
- ``cold``: after a reset, reading the cache: within a group the later samples read the first one's prompt blocks
  (the shared-prefix case of GRPO groups);
- ``cached``: the same again: every prompt's full blocks are hits;
- ``after reset``: ``reset_prefix_cache`` then the same;
- ``after a sync``: the engine's own weight sync (``load_weights``) of changed weights right after the prompts were
  cached, then cached vs off: a sync that leaves the cache in place reuses KV computed with the old weights. The
  changed weights go in the form a training sync sends them (``sync_update``: to vLLM's block-FP8 layers on CUDA as
  FP8 values and scales, ``rollout.fp8_weights.fp8_block_weights``; a float weight alone would be cast into the FP8
  parameter unscaled, beside a scale nothing loaded: vLLM's in-place reload, ``reload/layerwise.py``).

vLLM reads the cache only for whole KV blocks and never for requests with prompt log-probs (``SamplingParams``:
``skip_reading_prefix_cache`` defaults on with ``prompt_logprobs``), so the legs generate, and each leg's hits are
counted from vLLM's ``num_cached_tokens``; a check where nothing was read from the cache cannot run. The prompts are
two-turn histories (a prompt, its sampled answer, the next prompt): the multi-turn case where caching pays, and long
enough to fill a block. vLLM's CPU attention takes blocks of multiples of 32 tokens and defaults to 128
(``platforms/cpu.py``), more than a demo recipe's whole sequence: there the check starts its own engine on the
recipe's model and dtype with 32-token blocks, closed after it. An engine with the cache off (the CPU engine
returning an MoE model's routes: ``rollout.vllm_engine.route_options``) or other than the colocated vLLM engine cannot
run it.

Levels (measured on CPU, tiny model, bf16 and float32, 2026-11-27): every leg equals ``off`` bit for bit (a cache hit
replays the KV a recomputation computes; the CPU forward is batch-invariant, ``rollout/engine_forward.py``), while a
sync without the reset moved the sampled tokens' log-probs by 2.7e-2 on average (max 0.63) in bf16 on the tiny
model built on an AMX host, and by 6.1e-3 (max 0.11) on the one built on an AVX2-only host. The first three legs'
band is the dtype's parity level (``Doctor.mae_level``): on CUDA a cached context runs other attention splits and may
round differently, never by more than what a healthy engine-vs-trainer pair differs by. The sync leg is judged
against what the cache itself does on this engine instead: a healthy sync leaves "cached vs off" where the legs
before it read (``SYNC_MARGIN`` times their largest mean; 0 where they are bit for bit), while stale prompt KV
moves it by however much the pushed weights moved the model, which a fixed level cannot bound from below.
"""
from __future__ import annotations

import torch

from rollout.fp8_weights import fp8_block_weights
from rollout.requests import sample_seed
from rollout.vllm_engine import VLLMEngine
from rollout.weight_export import full_weights
from trainer.doctor.context import Doctor
from trainer.doctor.records import Check, CheckCannotRun, Finding, at_most
from trainer.models.policy import load_base_model
from trainer.precision.verdict import MAE_WARN_FACTOR

NAME = "prefix_cache"
GROUP = 4  # samples per prompt (a GRPO group sharing its prompt's KV blocks)
NEW_TOKENS = 8  # every sampled token attends to the whole prompt: a few show a stale or wrong prompt KV
CPU_BLOCK = 32  # the smallest block vLLM's CPU attention takes (CPU_ATTN: MultipleOf(32))
PROBE_KV_BYTES = 64 * 1024**2
# The sync leg's weights: every decoder matrix scaled by (1 + 0.1 N(0, 1)), far enough from the current ones that a
# prompt KV computed with either is told apart above any dtype's rounding (a training step moves weights far less,
# which is why a sync that forgets the reset goes unseen in a run's parity).
SYNC_NOISE = 0.1
SYNC_SEED = 0
# The sync leg's limit over the largest mean of the legs before it: rounding of the same cached-context kernels
# (two roundings of one computation are about sqrt(2) apart, at most 2: trainer/diagnostics/noise_floor.py).
SYNC_MARGIN = 2.0
SYNC_LEG = "after a weight sync"


def _block_size(engine: VLLMEngine) -> int:
    return int(engine.llm.llm_engine.vllm_config.cache_config.block_size)


def _caching(engine) -> VLLMEngine:
    if not isinstance(engine, VLLMEngine):
        raise CheckCannotRun(f"the engine is {type(engine).__name__}, not the colocated vLLM engine: its prefix "
                             "cache cannot be read or reset from here")
    if not engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching:
        raise CheckCannotRun("prefix caching is off on this engine (on CPU an engine returning an MoE model's routes "
                             "turns it off: rollout.vllm_engine.route_options): nothing to compare")
    return engine


def _prompts(doc: Doctor, limit: int) -> list[list[int]]:
    """Two-turn histories: prompt i, its sampled completion, prompt i + 1; cut to ``limit`` tokens."""
    b, p = doc.batch(), doc.prompt_ids
    return [(b.prompt_ids[i] + b.completion_ids[i] + p[(i + 1) % len(p)])[:limit] for i in range(len(p))]


def _probe_engine(doc: Doctor, engine: VLLMEngine) -> VLLMEngine:
    """The recipe's model and dtype on a vLLM engine whose KV blocks these prompts can fill (CPU: 32 tokens)."""
    doc.say(f"  the engine's KV blocks ({_block_size(engine)} tokens) are longer than these prompts: starting "
            f"one with {CPU_BLOCK}-token blocks on the same model and dtype")
    return VLLMEngine(engine.model, dtype=engine.dtype, max_model_len=engine.max_model_len, seed=doc.cfg.train.seed,
                      kv_cache_memory_bytes=PROBE_KV_BYTES, block_size=CPU_BLOCK)


def _generate(engine: VLLMEngine, prompts: list[list[int]], seed: int, *, read_cache: bool):
    """Each prompt's ``GROUP`` samples: [(token ids, their log-probs)] and the prompt tokens read from the cache."""
    # late: vLLM's own request types, imported where the engine is known to be vLLM's
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    requests = [(TokensPrompt(prompt_token_ids=list(p)), SamplingParams(
        n=1, temperature=1.0, top_k=engine.request_top_k(0), max_tokens=NEW_TOKENS, logprobs=0,
        seed=sample_seed(seed, i * GROUP + j), stop_token_ids=list(engine.eos_ids), detokenize=False,
        skip_reading_prefix_cache=not read_cache))
        for i, p in enumerate(prompts) for j in range(GROUP)]
    outs = engine.llm.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)
    samples = []
    for o in outs:
        c = o.outputs[0]
        samples.append((list(c.token_ids), [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids)]))
    return samples, sum(int(o.num_cached_tokens or 0) for o in outs)


def _difference(a, b) -> dict:
    """|Δ log-prob| of two legs over each sample's tokens up to where their tokens part (mean, max), and how many
    samples parted."""
    diffs, parted = [], 0
    for (ids_a, lp_a), (ids_b, lp_b) in zip(a, b):
        same = 0
        while same < min(len(ids_a), len(ids_b)) and ids_a[same] == ids_b[same]:
            same += 1
        parted += same != len(ids_a) or same != len(ids_b)
        diffs.append((torch.tensor(lp_a[:same], dtype=torch.float64) - torch.tensor(lp_b[:same],
                                                                                     dtype=torch.float64)).abs())
    d = torch.cat(diffs)
    return {"mean": float(d.mean()) if d.numel() else 0.0, "max": float(d.max()) if d.numel() else 0.0,
            "samples_parted": parted, "tokens": int(d.numel())}


def _changed_weights(doc: Doctor) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(SYNC_SEED)
    out = []
    for name, t in full_weights(load_base_model(doc.model_dir, "float32", "cpu"), dtype=torch.float32):
        if ".layers." in name and t.dim() == 2:
            t = t * (1 + SYNC_NOISE * torch.randn(t.shape, generator=g))
        out.append((name, t))
    return out


def sync_update(doc: Doctor, engine) -> list[tuple[str, torch.Tensor]]:
    """The sync leg's update (``_changed_weights``) as the engine takes a training sync's (module docstring)."""
    named = _changed_weights(doc)
    return list(fp8_block_weights(named)) if engine.fp8_block_weights else named


def _restore(engine: VLLMEngine) -> None:
    """The weights the engine started from, reloaded from its model files (as ``VLLMEngine.load_adapter`` restores
    its base), and an empty cache."""
    engine.reload_weights()
    engine.llm.reset_prefix_cache()


def _legs(doc: Doctor, engine: VLLMEngine, prompts: list[list[int]]) -> dict:
    seed = doc.cfg.train.seed
    engine.llm.reset_prefix_cache()
    cold, hits_cold = _generate(engine, prompts, seed, read_cache=True)
    cached, hits_cached = _generate(engine, prompts, seed, read_cache=True)
    off, _ = _generate(engine, prompts, seed, read_cache=False)
    if not hits_cached:
        raise CheckCannotRun(f"nothing was read from the prefix cache (prompts of {min(map(len, prompts))} to "
                             f"{max(map(len, prompts))} tokens, KV blocks of {_block_size(engine)})")
    engine.llm.reset_prefix_cache()
    after_reset, hits_reset = _generate(engine, prompts, seed, read_cache=True)
    # the prompts are cached now: the sync must not let the next requests read them
    engine.load_weights(sync_update(doc, engine))
    try:
        synced, hits_synced = _generate(engine, prompts, seed, read_cache=True)
        synced_off, _ = _generate(engine, prompts, seed, read_cache=False)
    finally:
        _restore(engine)
    return {"cold (a group's samples share its prompt)": (cold, off, hits_cold),
            "cached": (cached, off, hits_cached),
            "after reset_prefix_cache": (after_reset, off, hits_reset),
            SYNC_LEG: (synced, synced_off, hits_synced)}


CAUSES = {SYNC_LEG: "prefix cache changes log-probs after a weight sync: the sync leaves the cache in "
                                 "place and prompt KV computed with the old weights is reused (reset_prefix_cache "
                                 "after every weight load)"}
CAUSE = ("prefix cache changes log-probs: a prompt's KV read from the cache is not what recomputing it gives (KV "
         "cache dtype or quantization, the cached-context attention kernel, blocks hashed without what changed them)")


def run(doc: Doctor) -> list[Finding]:
    engine = _caching(doc.engine)
    prompts = _prompts(doc, engine.max_model_len - NEW_TOKENS)
    needs_probe = min(map(len, prompts)) <= _block_size(engine)  # vLLM caches whole blocks only
    if needs_probe and engine.cuda:  # the smallest CUDA block (16) is the default: no other engine would fill one
        raise CheckCannotRun(f"the prompts ({min(map(len, prompts))} tokens) fill no KV block of "
                             f"{_block_size(engine)} tokens: nothing would be read from the cache")
    probe = _probe_engine(doc, engine) if needs_probe else engine
    try:
        block = _block_size(probe)
        legs = _legs(doc, probe, prompts)
    finally:
        if probe is not engine:  # closing one in-process engine leaves the others working (VLLMEngine.close)
            probe.close()
    level = doc.mae_level()
    out, before_sync = [], 0.0
    for leg, (a, b, hits) in legs.items():
        d = _difference(a, b)
        doc.say(f"  {leg}: {hits} prompt tokens read from the cache; vs off: mean |dlp| {d['mean']:.3g}, max "
                f"{d['max']:.3g}, {d['samples_parted']} samples parted")
        details = {**d, "cached_prompt_tokens": hits, "block_size": block}
        if leg == SYNC_LEG:  # dict order: the legs before the sync are measured first
            out.append(at_most(NAME, f"{leg} vs cache off: mean |dlp|", d["mean"], SYNC_MARGIN * before_sync,
                               CAUSES[leg], details={**details, "legs_before_sync_max_mean": before_sync}))
            continue
        before_sync = max(before_sync, d["mean"])
        out.append(at_most(NAME, f"{leg} vs cache off: mean |dlp|", d["mean"], level, CAUSE,
                           warn_factor=MAE_WARN_FACTOR, details=details))
    return out


CHECK = Check(NAME, "does reading a prompt's KV from the prefix cache (and resetting it) change the log-probs?", run)
