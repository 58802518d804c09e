"""Recipe -> rollout engine, and the weight sync into it.

The only place where ``trainer/`` touches ``rollout/``'s constructors; the
loop itself sees the ``RolloutEngine`` interface and ``Rollouts`` only.
"""
from __future__ import annotations

import secrets
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from rollout.adapters import export_lora_adapter
from rollout.base import RolloutEngine
from rollout.fp8_weights import fp8_block_weights, write_fp8_checkpoint
from rollout.hf_engine import HFEngine
from rollout.server_engine import ServerEngine
from rollout.types import SamplingSpec
from rollout.vllm_engine import VLLMEngine, image_options
from rollout.weight_export import iter_merged_lora_weights, layer_chunks, payload_bytes
from trainer.config import RolloutConfig, RunConfig
from trainer.distributed.data_parallel import DataParallel
from trainer.lifecycle.preflight import local_model_config, meta_model
from trainer.models.architecture import ALL_LINEAR, resolve_lora_targets
from trainer.precision import PrecisionRecipe, recipe_for
from trainer.precision.lora_sync import ADAPTER, lora_sync_mode


def block_fp8_engine(recipe: PrecisionRecipe) -> bool:
    """Whether this process's engine runs vLLM's block-FP8 layers: the recipe's on CUDA."""
    return recipe.block_fp8_on_cuda and torch.cuda.is_available()


def engine_model_dir(recipe: PrecisionRecipe, model_dir: str, work_dir) -> str:
    """The directory a vLLM engine starts from: the model's, or a block-FP8 copy (``block_fp8_engine``).

    vLLM's CUDA ``fp8`` method loads FP8 weights + scales from a checkpoint whose
    config.json says so (``rollout.fp8_weights.write_fp8_checkpoint``); written once
    into ``<work_dir>/engine_fp8`` (the run directory, or compare's report directory),
    quantized by ``parity.precision``.
    """
    if not block_fp8_engine(recipe):
        return model_dir
    out = Path(work_dir) / "engine_fp8"
    return str(out if (out / "config.json").is_file() else write_fp8_checkpoint(model_dir, out))


def start_vllm(model_dir: str, *, precision: str, dtype: str, max_model_len: int, seed: int, work_dir,
               max_logprobs: int = 20, **engine_kwargs) -> RolloutEngine:
    """A colocated vLLM engine for the precision recipe named ``precision``: how training (``make_engine``) and
    ``parityrl compare`` both start one, so that compare measures the engine training runs.

    ``engine_kwargs``: VLLMEngine's memory and scheduling options (kv_cache_memory_bytes, ...); without a
    ``gpu_memory_utilization`` (compare has no recipe's), the recipe schema's default.
    """
    engine_kwargs.setdefault("gpu_memory_utilization", RolloutConfig.gpu_memory_utilization)
    recipe = recipe_for(precision)
    return VLLMEngine(engine_model_dir(recipe, model_dir, work_dir), dtype=dtype, max_model_len=max_model_len,
                      seed=seed, max_logprobs=max_logprobs, **engine_kwargs,
                      **recipe.engine_options(torch.cuda.is_available()))


def lora_target_leaves(cfg: RunConfig, model_dir: str) -> list[str]:
    """The leaf names the recipe's LoRA wraps (``all-linear`` resolved on the model built on the meta device, as
    training resolves it)."""
    model = meta_model(model_dir)
    if model is None:  # not local: the targets as the recipe names them, all-linear left to vLLM's own rule
        return [t for t in cfg.model.lora.target_modules if t != ALL_LINEAR]
    return resolve_lora_targets(model, cfg.model.lora.target_modules)


def make_engine(cfg: RunConfig, model_dir: str, *, max_model_len: int, dp=None,
                return_routes: bool = False, lora_targets: Optional[Sequence[str]] = None) -> RolloutEngine:
    """The rollout engine of this process. ``dp``: the data-parallel group (server mode: see ``_server_engine``).
    ``return_routes``: an MoE model's routes with every rollout (``trainer.models.routing_mode``).

    The recipe was validated at load: its precision recipe's record refused the engines it cannot run on. With
    ``rollout.lora_sync`` resolving to ``adapter`` (``trainer.precision.lora_sync``) the engine is started to serve
    the recipe's LoRA adapter on ``lora_targets`` (the policy's resolved LoRA leaf names; default: resolved here).
    """
    r = cfg.rollout
    adapter = lora_sync_mode(cfg, model_config=local_model_config(model_dir))[0] == ADAPTER
    if adapter and lora_targets is None and r.engine != "hf":
        lora_targets = lora_target_leaves(cfg, model_dir)
    if r.mode == "server":
        # A separate vLLM server (`parityrl serve`); weights pushed through vLLM's weight transfer, an adapter
        # through vLLM's adapter loading (rollout.server_engine).
        return _server_engine(cfg, model_dir, max_model_len, dp, return_routes, lora_targets if adapter else None,
                              return_supports=sampling_spec(cfg, 0).truncated)
    if r.engine == "hf":
        return HFEngine(model_dir, dtype=cfg.model.dtype, device="cuda" if torch.cuda.is_available() else "cpu",
                        return_routes=return_routes, serve_adapters=adapter)
    return start_vllm(model_dir, precision=cfg.precision.recipe, dtype=cfg.model.dtype, max_model_len=max_model_len,
                      seed=cfg.train.seed, work_dir=cfg.run_dir,
                      # vLLM refuses requests for more log-probs than max_logprobs (default 20).
                      max_logprobs=max(20, cfg.parity.topk),
                      kv_cache_memory_bytes=r.kv_cache_memory_bytes, gpu_memory_utilization=r.gpu_memory_utilization,
                      enforce_eager=r.enforce_eager, max_num_seqs=r.max_num_seqs, return_routes=return_routes,
                      enable_sleep_mode=r.sleep_mode, max_lora_rank=cfg.model.lora.r if adapter else None,
                      lora_target_modules=lora_targets if adapter else None,
                      sampling_supports=sampling_spec(cfg, 0).truncated,
                      **(image_options(cfg.data.max_images_per_prompt, cfg.data.image_processor) if cfg.data.image_column is not None else {}))


def sampling_spec(cfg: RunConfig, step: int) -> SamplingSpec:
    r = cfg.rollout
    # A per-step seed makes a resumed run sample exactly what an uninterrupted one would.
    return SamplingSpec(n=cfg.algorithm.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                        max_new_tokens=r.max_new_tokens, seed=cfg.train.seed * 1_000_003 + step,
                        logprobs_topk=cfg.parity.topk)


def connect_shared_server(dp, connect: Callable[[bool], ServerEngine]) -> ServerEngine:
    """This rank's client of a server every data-parallel rank shares (the student's, a teacher's): rank 0 connects
    first (``connect(True)``: the health wait, the checks, and whatever is set up on the server once), the others
    after it (``connect(False)``). A failure on any rank stops every rank (``DataParallel.raise_together``) instead of
    leaving the others waiting in their next collective; the clients already made are closed."""
    dp = dp or DataParallel()
    engine, error = None, None
    for first in (True, False):
        if (dp.rank == 0) == first:
            try:
                engine = connect(first)
            except Exception as e:  # noqa: BLE001 - re-raised on this rank by raise_together
                error = e
        try:
            dp.raise_together(error)
        except BaseException:
            if engine is not None:
                engine.close()
            raise
    return engine


def _server_engine(cfg: RunConfig, model_dir: str, max_model_len: int, dp, return_routes: bool = False,
                   lora_targets: Optional[Sequence[str]] = None, return_supports: bool = False):
    """One server shared by every data-parallel rank: rank 0 owns the weight transfer and pushes.

    Every rank sends its own shard's generate requests (the server batches them). Rank 0
    connects first (health wait, checks, transfer channel, first weight version); the
    others then connect without a transfer channel and share rank 0's version tag, so
    every rank refuses samples from another weight version (``connect_shared_server``).
    ``lora_targets``: the run serves its adapter on these (``rollout.lora_sync`` resolved to ``adapter``): the
    server must run LoRA for them (refused at connect for an explicit ``adapter``, else merged weights).
    ``return_supports``: the recipe truncates its sampling; the server returns the kept sets (a CUDA server cannot).
    """
    dp = dp or DataParallel()
    r = cfg.rollout
    tag = dp.broadcast_object(secrets.token_hex(4) if dp.rank == 0 else None)

    def connect(pushes: bool):
        return ServerEngine(r.server_url, model_dir=model_dir, timeout_s=r.server_timeout_s, dtype=cfg.model.dtype,
                            max_model_len=max_model_len, pushes_weights=pushes, version_tag=tag,
                            connect_timeout_s=r.server_connect_timeout_s, return_routes=return_routes,
                            adapter_rank=None if lora_targets is None else cfg.model.lora.r,
                            adapter_targets=lora_targets, adapter_required=r.lora_sync == ADAPTER,
                            return_supports=return_supports, in_flight=r.in_flight,
                            max_images=cfg.data.max_images_per_prompt if cfg.data.image_column is not None else 0)

    return connect_shared_server(dp, connect)


def sync_adapter(engine: RolloutEngine, policy, *, version: int, gather=None) -> dict[str, float]:
    """Serve the policy's current LoRA adapter as version ``version`` (``rollout.lora_sync: adapter``): its
    weights in the engine's ``adapter_dtype``, the base weights untouched. ``gather``: as in ``sync_weights`` (every
    rank takes part under ZeRO-3). An engine that does not push its own weights only follows the push."""
    adapter = export_lora_adapter(policy, version=version, dtype=engine.adapter_dtype or torch.float32, gather=gather)
    if not engine.pushes_weights:
        engine.follow_push(adapter=True)
        return {}
    engine.load_adapter(adapter)
    return {"perf/sync_bytes": float(adapter.nbytes), "perf/sync_tensors": float(len(adapter.tensors)),
            "perf/sync_chunks": 1.0}


def sync_weights(engine: RolloutEngine, policy, *, block_fp8: bool = False, gather=None,
                 dtype: torch.dtype = torch.bfloat16, chunk_bytes: int | None = None) -> dict[str, float]:
    """Push the policy's current weights (LoRA merged, changed modules only) into the engine.

    ``dtype``: the engine's (``model.dtype``): the merge is computed in float32 and rounded
    to it once, so an FP16 or FP32 engine gets the weights the trainer's model holds, not a
    BF16 rounding of them.
    ``gather``: ``trainer.distributed.deepspeed.zero3_gather(policy)`` under ZeRO-3 (one module's
    shards gathered at a time; every rank must call this then).
    What the engine takes is what it says (``rollout.base.RolloutEngine``). An engine that
    ``streams_weights`` gets the update in chunks of whole decoder layers of at most
    ``chunk_bytes`` (``rollout.sync_chunk_bytes``; None: one layer per chunk), each made only
    when the engine has taken the previous one, so at most one chunk of merged weights exists
    at once: the colocated vLLM and HF engines take each chunk as an update of its own
    (``rollout.base.InProcessEngine``); a server takes them all as one weight version
    (``ServerEngine.load_weight_chunks``). Any other engine gets the whole update in one
    ``load_weights``. An engine that does not push its own weights (``pushes_weights`` False)
    only follows the push of the rank that does.
    ``block_fp8`` (``block_fp8_engine`` of the run's precision recipe): push the block-FP8 weights + scales
    computed by the trainer's own quantizer (``rollout.fp8_weights.fp8_block_weights``) to an engine
    running vLLM's block-FP8 layers (``fp8_block_weights``); on CPU an emulating FP8 engine quantizes the
    merged BF16 weights with the same function (``rollout.vllm_plugins.fp8_quant``).
    """
    merged = iter_merged_lora_weights(policy, gather=gather, dtype=dtype)
    if not engine.pushes_weights:
        # A data-parallel rank > 0 sharing rank 0's server: rank 0 pushes. Under ZeRO-3 this
        # rank must still take part in every module's gather (a collective); the merged
        # tensors are dropped one by one.
        if gather is not None:
            for _ in merged:
                pass
        engine.follow_push()
        return {}
    fp8_cuda = block_fp8 and engine.fp8_block_weights
    streams = engine.streams_weights
    totals = {"perf/sync_bytes": 0.0, "perf/sync_tensors": 0.0, "perf/sync_chunks": 0.0}

    def prepared():
        for named in (layer_chunks(merged, chunk_bytes) if streams else [list(merged)]):
            if fp8_cuda:
                named = list(fp8_block_weights(named))
            totals["perf/sync_bytes"] += payload_bytes(named)
            totals["perf/sync_tensors"] += len(named)
            totals["perf/sync_chunks"] += 1
            yield named

    if streams:
        engine.load_weight_chunks(prepared())
    else:
        for named in prepared():
            engine.load_weights(named)
    return totals
