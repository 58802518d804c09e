"""`parityrl compare`: the engine's and the trainer's log-probs of the same sampled tokens, as a report.

    engine.generate(prompts)                      -> tokens + engine log-probs lp_r
    trainer.measurement.scoring.score_batch(tokens)        -> trainer log-probs lp_t, entropy
    parity.metrics.compare / breakdowns           -> summary.json, tokens.jsonl, xlsx, plots

One tokenizer (the trainer's, ``trainer.data.datasets.encode_prompts``) encodes the prompts for
both sides: the engine receives token ids, never text. The trainer scores teacher-forced
with the engine's temperature, through the same chunked kernel and the same
``TokenBatch`` layout (left-padded prompts, explicit position ids) as a training step,
so the numbers are the ones a run's ``parity/*`` metrics would show for the same weights.

The inputs are checked and read by ``trainer.diagnostics.compare_inputs``; the trainer scores with the loop's
own ``trainer.measurement.scoring.score_batch``; the report's rows and the self-check (``self_check=True``:
both sides the trainer's scoring, every error metric exactly zero) are ``trainer.diagnostics.compare_report``'s.
A vision-language model's prompts run with their images (``image_column``) as a training step runs them, their
inputs checked identical on both sides first (``trainer.diagnostics.compare_images``); without it, as text.
"""
from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from parity.metrics import compare, error_by_position
from parity.report import check_out_dir, prepare_out_dir, require_report_deps, write_report
from rollout.hf_engine import HFEngine
from rollout.moe_config import moe_shape
from rollout.types import Rollouts, SamplingSpec
from trainer.diagnostics.compare_adapter import generate_both, resolve_adapter_dir, side_by_side, with_adapter
from trainer.diagnostics.compare_images import CompareImages, prompts_with_images, refuse_settings
from trainer.diagnostics.compare_inputs import (
    CompareError,
    chat_template_info,
    check_settings,
    context_len,
    encode_prompt_ids,
    load_prompts,
    resolve_model_dir,
)
from trainer.diagnostics.compare_report import (
    decoder,
    generation_stats,
    sample_rows,
    self_check_result,
    self_check_rollouts,
    token_rows,
    versions,
)
from trainer.distributed.data_parallel import DataParallel
from trainer.io import third_party_output
from trainer.measurement.parity_breakdown import step_breakdown
from trainer.measurement.routing_parity import pooled_routing_metrics, replay_paused
from trainer.measurement.scoring import score_batch
from trainer.models.architecture import decoder_depth
from trainer.models.batch import TokenBatch, batch_from_rollouts
from trainer.models.policy import load_base_model, load_tokenizer
from trainer.models.routing_replay import RoutingReplay
from trainer.precision import DEFAULT_RECIPE, recipe_for
from trainer.precision.levels import parity_level
from trainer.precision.verdict import MAE_WARN_FACTOR, verdict
from trainer.sampling.engines import start_vllm
from trainer.vision.batch import VisionBatch
from trainer.vision.support import vision_language_type

__all__ = ["run_compare"]

Progress = Optional[Callable[[str], None]]


# ----------------------------------------------------------------------------------
# Engines
# ----------------------------------------------------------------------------------


def _start_engine(kind: str, model_dir: str, model, *, dtype: str, max_model_len: int, seed: int,
                  kv_cache_bytes: Optional[int], work_dir, topk: int = 0, precision: str = DEFAULT_RECIPE,
                  return_routes: bool = False, adapter: Optional[dict] = None, truncated: bool = False,
                  images: Optional[CompareImages] = None):
    """``model``: the scoring model, which an "hf" engine runs itself (None: one of its own, loaded from
    ``model_dir``); ``adapter``: the adapter_config of a LoRA the engine is to serve (None: none); ``truncated``:
    the sampling is (the engine returns its kept sets); ``images``: the prompts hold images (a vLLM engine)."""
    if kind == "hf":
        if model is None:
            return HFEngine(model_dir, dtype=dtype, device="cuda" if torch.cuda.is_available() else "cpu",
                            return_routes=return_routes, serve_adapters=adapter is not None)
        # The scoring model itself: one copy of the weights, and identical weights by construction.
        return HFEngine(model, return_routes=return_routes)
    # started as training starts its engine (the FP8 export on CUDA included), so compare measures it
    return start_vllm(model_dir, precision=precision, dtype=dtype, max_model_len=max_model_len, seed=seed,
                      work_dir=work_dir, max_logprobs=max(20, topk), kv_cache_memory_bytes=kv_cache_bytes,
                      enforce_eager=None, return_routes=return_routes,
                      sampling_supports=truncated, max_lora_rank=None if adapter is None else int(adapter["r"]),
                      lora_target_modules=None if adapter is None else adapter["target_modules"],
                      **({} if images is None else images.engine_options()))


def _generate(engine, model_dir, model, prompt_ids, spec, *, dtype, max_model_len, seed, kv_cache_bytes, say,
              work_dir, precision=DEFAULT_RECIPE, return_routes=False, images: Optional[CompareImages] = None):
    """Rollouts from ``engine`` (an object: used as is; a name: started here and closed after); ``images``: the
    prompts' images, which the engine gets beside ``prompt_ids`` and whose consumption is checked against the
    trainer's processor's (``InputsDiffer`` where it differs)."""
    request = {} if images is None else {"images": images.encoded.images}
    if not isinstance(engine, str):
        engine_len = getattr(engine, "max_model_len", None)
        need = max(len(p) for p in (prompt_ids if images is None else images.expanded_ids)) + spec.max_new_tokens
        if engine_len is not None and need > engine_len:
            raise CompareError(f"the given engine's max_model_len = {engine_len}; the longest prompt + max_new_tokens "
                               f"= {need}; expected fewer new tokens or shorter prompts")
        rollouts = engine.generate(prompt_ids, spec, **request)
    else:
        say(f"starting the {engine} engine (max_model_len {max_model_len})")
        owned = _start_engine(engine, model_dir, model, dtype=dtype, max_model_len=max_model_len, seed=seed,
                              kv_cache_bytes=kv_cache_bytes, work_dir=work_dir, topk=spec.logprobs_topk,
                              precision=precision, return_routes=return_routes, truncated=spec.truncated, images=images)
        try:
            rollouts = owned.generate(prompt_ids, spec, **request)
        finally:
            owned.close()
    if images is not None:  # the model dtype the engine ran the pixels in: a given engine's own, else compare's
        images.check(rollouts, getattr(engine, "torch_dtype", None) or getattr(torch, dtype))
    return rollouts


# ----------------------------------------------------------------------------------
# Scoring
# ----------------------------------------------------------------------------------


def _score(model, batch: TokenBatch, *, temperature: float, batch_size: int, chunk_size: Optional[int],
           progress: Progress):
    """Trainer log-probs and entropies [S, C] (float32, CPU, 0 at masked positions) of ``batch``'s completions,
    when the batch carries the engine's top-k ids, the trainer's log-probs of those ids [S, C, k] (else None),
    and with routes the routing parity sums (``Scores.routing``, else None)."""
    scores = score_batch(model, batch, micro_batch_size=batch_size, temperature=temperature, chunk_size=chunk_size,
                         progress=progress)
    m = (batch.mask > 0).cpu()
    top = None if scores.topk is None else scores.topk.float().cpu() * m.unsqueeze(-1)
    return scores.logprobs.float().cpu() * m, scores.entropy.float().cpu() * m, top, scores.routing


def _score_sides(model, rollouts: Rollouts, pad_id: int, device, *, self_check: bool, say: Progress,
                 vision: Optional[VisionBatch] = None, **score_kw):
    """(rollouts, batch, trainer log-probs, entropy, trainer top-k log-probs or None, routing sums or None); with
    ``self_check`` the rollouts' engine log-probs (and top-k log-probs) are first replaced by a trainer scoring of
    the same tokens (``trainer.diagnostics.compare_report``). ``vision``: the samples' pixel tensors, which the
    trainer's forward runs (None: text prompts)."""
    batch = batch_from_rollouts(rollouts, pad_id, device)
    batch.vision = vision
    lp_t, ent, top, routing = _score(model, batch, progress=say, **score_kw)
    if self_check:
        rollouts = self_check_rollouts(rollouts, lp_t, top)
        batch = batch_from_rollouts(rollouts, pad_id, device)
        batch.vision = vision
        lp_t, ent, top, routing = _score(model, batch, progress=say, **score_kw)
    return rollouts, batch, lp_t, ent, top, routing


def _routing_report(model, batch: TokenBatch, lp_r: torch.Tensor, mask: torch.Tensor, routing: dict,
                    say: Progress, **score_kw) -> dict:
    """An MoE model's routing parity with replay (the report's metrics) and the same tokens scored without it:
    ``{"parity/routing_*": ..., "unreplayed": {parity metrics and routing agreement}}`` (docs/moe.md)."""
    say("scoring again without routing replay (the trainer's routers choosing)")
    with replay_paused(model):
        lp_u, _, top_u, own = _score(model, batch, progress=say, **score_kw)
    unreplayed = compare(lp_u, lp_r, mask > 0, train_topk_logprobs=top_u,
                         rollout_topk_logprobs=None if top_u is None else batch.topk_logprobs.cpu())
    one = DataParallel()  # one process: its sums are the totals
    return {**pooled_routing_metrics(routing, one),
            "unreplayed": {**unreplayed, **pooled_routing_metrics(own, one)}}


def expected_level(mae: float, recipe, dtype: str, num_layers: int) -> dict:
    """What a healthy setup reaches in this dtype and precision on a model this deep (``trainer.precision.levels``),
    and the verdict on the measured mae against it (``trainer.precision.verdict``: the doctor's own rule)."""
    level = parity_level(recipe, dtype, num_layers)
    return {"parity/mae": level, "num_layers": num_layers, "warn_factor": MAE_WARN_FACTOR,
            "verdict": verdict(mae, level, MAE_WARN_FACTOR)}


# ----------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------


def run_compare(
    model: str,
    prompts_path: str | Path,
    out_dir: str | Path,
    *,
    engine: Any = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    max_new_tokens: int = 64,
    n: int = 1,
    seed: int = 0,
    dtype: str = "bfloat16",
    num_prompts: Optional[int] = None,
    prompt_column: str = "prompt",
    use_chat_template: Optional[bool] = None,
    max_prompt_tokens: Optional[int] = None,
    max_model_len: Optional[int] = None,
    kv_cache_bytes: Optional[int] = None,
    batch_size: int = 16,
    chunk_size: Optional[int] = None,
    self_check: bool = False,
    topk: int = 0,
    precision: str = DEFAULT_RECIPE,
    system_prompt: Optional[str] = None,
    overwrite: bool = False,
    num_examples: int = 5,
    worst_k: int = 20,
    adapter: Optional[str | Path] = None,
    image_column: Optional[str] = None,
    progress: Progress = None,
) -> dict:
    """Generate with an engine, score the same tokens with the trainer, write the report; returns the summary.

    Args:
        model: local HF model directory, or ``builtin:tiny`` / ``builtin:tiny-base``.
        prompts_path: see ``load_prompts``.
        out_dir: the report directory; must be new or empty unless ``overwrite``.
        engine: "vllm" (None: the default) or "hf" (``rollout.hf_engine.HFEngine`` on the scoring
            model itself) to start one here and close it after; or an already started engine
            object (e.g. a test session's), used as is and left open. It must hold ``model``'s weights.
        temperature: sampling temperature; the trainer scores with the same one.
        top_p, top_k, min_p: truncated sampling (1.0 / 0 / 0.0: off): the engine reports the set it kept at each
            sampled position, and the trainer scores over exactly that set (``parity.fused_logprobs``'s ``support``).
        n: samples per prompt (sample i answers prompt i // n).
        dtype: trainer (and started engine) dtype, one of ``trainer.models.policy.DTYPES``.
        use_chat_template: None = use the tokenizer's chat template if it has one.
        system_prompt: the template's system turn, as a recipe's ``data.system_prompt`` (None = its default).
        max_model_len: engine context; None = longest prompt + max_new_tokens.
        kv_cache_bytes: vLLM's CPU KV cache size (None: the engine's default).
        batch_size, chunk_size: samples per scoring micro-batch; fused kernel rows per tile.
        precision: a precision recipe's name (``trainer.precision.compare_choices()``; docs/precision.md):
            the engine started here and the trainer's scoring model follow its record; a given engine object
            must have been started with it. ``dtype`` must be one the recipe runs in.
        topk: k > 0 asks the engine for its k most likely tokens per position and adds
            ``parity/topk_kl`` (a lower bound on the full KL, ``parity.metrics.topk_kl``).
        self_check: the engine side is the trainer's scoring too; every metric must then be exact
            (see module doc and ``SELF_CHECK_EXPECTED``); the summary's ``self_check_result`` says.
        num_examples: samples in each of the xlsx "longest" / "typical" sheets.
        worst_k: rows of the worst-tokens breakdown.
        adapter: a run's LoRA adapter (a checkpoint folder, or its ``adapter/``): the trainer scores with it, and
            the engine runs it both served as an adapter and merged, reported side by side in the summary's
            ``lora_sync`` (``trainer.diagnostics.compare_adapter``); the report's tokens are the served mode's.
        image_column: a vision-language model's prompts run with their images, read from this column of the prompts
            file (as a recipe's ``data.image_column``; ``trainer.diagnostics.compare_images``): the vLLM engine gets
            them, each sample's inputs are checked identical to the trainer's processor's, and the trainer's forward
            runs the pixels. None: the prompts run as text (a vision-language model's language model alone).
        progress: called with one-line progress messages (None: silent).

    Raises:
        CompareError: bad settings or input files (nothing has been written).
        InputsDiffer: with ``image_column``, a sample the engine consumed differs from the trainer's (the message
            names the sample, the image and the quantity; nothing but the engine's log has been written).
        FileExistsError: ``out_dir`` is not empty and ``overwrite`` is False.
        ImportError: matplotlib / openpyxl (the ``reports`` extra) missing.
    """
    say = progress or (lambda _msg: None)
    check_settings(engine=engine, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                   max_new_tokens=max_new_tokens,
                    n=n, dtype=dtype, batch_size=batch_size, num_prompts=num_prompts, max_model_len=max_model_len,
                    max_prompt_tokens=max_prompt_tokens, topk=topk, precision=precision)
    if image_column is not None:
        refuse_settings(engine=engine, adapter=adapter, use_chat_template=use_chat_template)
    require_report_deps()
    check_out_dir(out_dir, overwrite)
    model_dir = resolve_model_dir(model)
    adapter_dir = resolve_adapter_dir(adapter) if adapter is not None else None
    prompts = load_prompts(prompts_path, prompt_column=prompt_column, num_prompts=num_prompts)
    tokenizer = load_tokenizer(model_dir)
    template = chat_template_info(tokenizer, use_chat_template, model_dir)
    images = None if image_column is None else prompts_with_images(
        model_dir, prompts, prompts_path, image_column=image_column, prompt_column=prompt_column,
        num_prompts=num_prompts, system_prompt=system_prompt, max_prompt_tokens=max_prompt_tokens)
    # with images one placeholder per image, which the engine expands: the context holds the expanded ids
    prompt_ids = (encode_prompt_ids(tokenizer, prompts, template["used"], max_prompt_tokens, system_prompt)
                  if images is None else images.encoded.ids)
    context_ids = prompt_ids if images is None else images.expanded_ids

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = load_base_model(model_dir, dtype, device).eval()
    text_only = images is None and vision_language_type(hf.config.model_type)
    if text_only:
        say(f"{hf.config.model_type} is a vision-language model: compare runs its prompts as text (the language model "
            f"alone); --image-column COLUMN runs them with their images")
    if adapter_dir is not None:
        hf = with_adapter(hf, adapter_dir)
    kind = "vllm" if engine is None else engine
    context = context_len(context_ids, max_new_tokens, max_model_len,
                           getattr(hf.config, "max_position_embeddings", None))
    out = prepare_out_dir(out_dir, overwrite)
    third_party_output.attach(out)  # when the command line filters the console: the engines' lines to engine.log

    spec = SamplingSpec(n=n, temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), min_p=float(min_p),
                        max_new_tokens=max_new_tokens, seed=seed, logprobs_topk=topk)
    engine_name = kind if isinstance(kind, str) else type(kind).__name__
    say(f"generating: {len(prompts)} prompts x {n} with {engine_name}, up to {max_new_tokens} new tokens")
    t0 = time.monotonic()
    # a mixture-of-experts model of a replayed family: the engine returns its routes and the trainer replays them
    moe = moe_shape(hf.config) is not None
    served_mode, both = None, None
    if adapter_dir is not None:
        # the mode training would serve: the adapter, unless the precision recipe needs the merged weights
        served_mode = "merged" if recipe_for(precision).merged_sync else "adapter"

        def start(config: Optional[dict]):
            return _start_engine(kind, model_dir, None, dtype=dtype, max_model_len=context, seed=seed,
                                 kv_cache_bytes=kv_cache_bytes, work_dir=out, topk=topk, precision=precision,
                                 return_routes=moe, adapter=config, truncated=spec.truncated)

        say(f"generating with the adapter {'served and ' if served_mode == 'adapter' else ''}merged")
        both = generate_both(kind, hf, prompt_ids, spec, dtype=getattr(torch, dtype), start=start,
                             modes=("adapter", "merged") if served_mode == "adapter" else ("merged",))
        rollouts = both[served_mode]
    else:
        rollouts = _generate(kind, model_dir, hf, prompt_ids, spec, dtype=dtype, max_model_len=context, seed=seed,
                             kv_cache_bytes=kv_cache_bytes, say=say, work_dir=out, precision=precision,
                             return_routes=moe, images=images)
    # The scoring side is the recipe's trainer model (FP8 linears where both phases run the same FP8
    # forward), transformed after generation: an "hf" engine shares this model object, and the records
    # that transform it refuse the HF engine (check_settings).
    hf = recipe_for(precision).transform(hf)
    if rollouts.routes:
        RoutingReplay(hf)
    t_gen = time.monotonic() - t0

    say(f"scoring: {len(rollouts)} samples, {rollouts.num_completion_tokens} tokens with the trainer's forward")
    t0 = time.monotonic()
    score_kw = dict(temperature=spec.temperature, batch_size=batch_size, chunk_size=chunk_size)
    vision = None if images is None else images.vision_batch(rollouts, device)
    rollouts, batch, lp_t, ent, top_t, routing = _score_sides(hf, rollouts, tokenizer.pad_token_id, device,
                                                              self_check=self_check, say=say, vision=vision,
                                                              **score_kw)
    lp_r, mask, targets = batch.rollout_logprobs.cpu(), batch.mask.cpu(), batch.targets.cpu()
    routing = None if routing is None else _routing_report(hf, batch, lp_r, mask, routing, say, **score_kw)
    t_score = time.monotonic() - t0

    metrics = compare(lp_t, lp_r, mask > 0, train_topk_logprobs=top_t,
                      rollout_topk_logprobs=None if top_t is None else batch.topk_logprobs.cpu())
    breakdowns = step_breakdown(lp_t, lp_r, mask, targets, tokenizer, entropy=ent, k=worst_k)
    per_position = error_by_position(lp_t, lp_r, mask > 0, edges=list(range(mask.shape[1] + 1)))
    breakdowns["per_position"] = per_position
    tokens = token_rows(rollouts, batch, lp_t, ent, decoder(tokenizer))
    samples = sample_rows(rollouts, prompts, batch, lp_t, tokenizer)
    vl_line, vl_section = (None, None) if images is None else images.summary(rollouts, vision, lp_t, lp_r, mask)
    summary = {
        "command": "parityrl compare",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": str(model),
        "model_dir": str(model_dir),
        "prompts_path": str(Path(prompts_path).expanduser().resolve()),
        "num_prompts": len(prompts),
        "num_samples": len(rollouts),
        "num_tokens": len(tokens),
        **({"vision_language": "prompts run as text, without images"} if text_only else {}),
        **({"vision_language": vl_line, "images": vl_section} if images is not None else {}),
        "self_check": bool(self_check),
        **({"self_check_result": self_check_result(metrics)} if self_check else {}),
        "metrics": metrics,
        "expected_level": expected_level(metrics["parity/mae"], recipe_for(precision), dtype,
                                         decoder_depth(hf.config)),
        **({"routing": routing} if routing is not None else {}),
        **({"lora_sync": {"adapter_dir": str(adapter_dir), "served": served_mode,
                          **side_by_side(hf, both, tokenizer.pad_token_id, device, temperature=spec.temperature,
                                         batch_size=batch_size, dtype=getattr(torch, dtype))}}
           if adapter_dir is not None else {}),
        "settings": {
            "engine": engine_name, "temperature": spec.temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
            "max_new_tokens": max_new_tokens, "n": n, "seed": seed, "dtype": dtype, "device": device,
            "max_model_len": context, "kv_cache_bytes": kv_cache_bytes, "max_prompt_tokens": max_prompt_tokens,
            "prompt_column": prompt_column, "batch_size": batch_size, "chunk_size": chunk_size, "topk": topk,
            "precision": precision,
            "engine_logprobs": "trainer scoring (self-check)" if self_check else "engine",
            "trainer_logprobs": "trainer.models.policy.completion_logprobs (parity.logprobs.fused_logprobs), "
                                "teacher-forced, use_cache=False, no_grad",
        },
        "chat_template": template,
        "versions": versions(),
        "generation": generation_stats(rollouts, context_ids),
        "timing": {"generate_s": round(t_gen, 3), "score_s": round(t_score, 3),
                   "score_tokens_per_s": round(len(tokens) / t_score, 1) if t_score > 0 else None},
        "breakdowns": breakdowns,
    }
    say(f"writing the report to {out}")
    write_report(out, summary=summary, tokens=tokens, samples=samples, per_position=per_position,
                 num_examples=num_examples)
    return summary
