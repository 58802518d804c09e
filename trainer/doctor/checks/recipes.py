"""Every precision recipe the model allows, on one fixed batch: the parity each would run at, side by side, judged
against that recipe's own level (``trainer.precision.levels``) — what a user needs to choose a recipe.

Each recipe's engine is started as training starts it (``start_vllm``: FP8 export, exact mode's plugin) and samples
the same prompts with the same seed; the trainer's model is the recipe's (``PrecisionRecipe.transform``), and in
exact mode its log-probs are the engine's own kernels rerun by the trainer (``trainer.models.exact``), as a
training step computes them, so its row reads 0 when exact mode holds. The recipe the doctor runs reuses the
doctor's engine. A recipe the model, dtype or device does not allow is a SKIP naming the record's reason; an MoE
model's rows add the routing agreement with replay (``parity/routing_agree``).
"""
from __future__ import annotations

import torch

from parity.metrics import compare
from rollout.moe_config import moe_shape
from trainer.config import RecipeError
from trainer.config.validate import sequence_length
from trainer.distributed.data_parallel import DataParallel
from trainer.doctor.checks.layers import precision_refusal
from trainer.doctor.context import Doctor, engine_reason
from trainer.doctor.records import Check, CheckCannotRun, Finding, at_most, skipped
from trainer.measurement.routing_parity import pooled_routing_metrics
from trainer.measurement.scoring import score_batch
from trainer.models.batch import batch_from_rollouts
from trainer.models.exact import ExactLogprobs
from trainer.models.policy import add_lora, load_base_model
from trainer.models.routing_replay import RoutingReplay
from trainer.precision.checks import check_model_config, cuda_rule, dtype_rule, hf_engine_rule
from trainer.precision.levels import parity_level
from trainer.precision.record import PrecisionRecipe
from trainer.precision.registry import RECIPES
from trainer.precision.verdict import MAE_WARN_FACTOR
from trainer.sampling.engines import start_vllm

NAME = "recipes"


def _refusal(doc: Doctor, recipe: PrecisionRecipe) -> str | None:
    """Why ``recipe`` cannot run this model in this dtype on this engine and device (the record's own rules)."""
    cuda = torch.cuda.is_available()
    for ok, key, value, expected in (dtype_rule(recipe, doc.dtype), hf_engine_rule(recipe, doc.cfg.rollout.engine),
                                     cuda_rule(recipe, cuda)):
        if not ok:
            return f"{key} = {value!r}: expected {expected}"
    try:
        check_model_config(recipe, doc.model.config)
    except RecipeError as e:
        return str(e)
    return None


def _row(doc: Doctor, recipe: PrecisionRecipe) -> Finding:
    moe = moe_shape(doc.model.config) is not None
    own = recipe.name == doc.precision.name and not moe  # an MoE row needs an engine that returns routes
    spec = doc.spec()
    if own:
        engine, model = doc.engine, doc.model
    else:
        doc.say(f"starting the engine for precision recipe {recipe.name}")
        try:
            engine = start_vllm(doc.model_dir, precision=recipe.name, dtype=doc.dtype,
                                max_model_len=sequence_length(doc.cfg), seed=doc.cfg.train.seed, work_dir=doc.out_dir,
                                kv_cache_memory_bytes=doc.cfg.rollout.kv_cache_memory_bytes, enforce_eager=None,
                                sampling_supports=spec.truncated, return_routes=moe)
        except Exception as e:  # noqa: BLE001 - this recipe's engine alone; the other rows still run
            return skipped(NAME, recipe.name, f"its engine cannot start: {engine_reason(e)}")
        model = load_base_model(doc.model_dir, doc.dtype, doc.device)
        if recipe.engine_logprobs:  # exact mode reruns the engine's kernels on the policy's merged weights (its
            model = add_lora(model, doc.cfg.model.lora)  # LoRA starts at B = 0: the base model's own numbers)
        model = recipe.transform(model).eval()
    try:
        rollouts = engine.generate(doc.prompt_ids, spec)
        if rollouts.routes:  # the trainer replays the engine's routes, as training does (docs/moe.md)
            RoutingReplay(model)
        batch = batch_from_rollouts(rollouts, doc.tokenizer.pad_token_id, doc.device)
        exact = ExactLogprobs(engine, model, getattr(torch, doc.dtype)) if recipe.engine_logprobs else None
        with torch.no_grad():
            scores = score_batch(model, batch, micro_batch_size=16, temperature=spec.temperature, exact=exact)
    finally:
        if not own:
            engine.close()
    mask = (batch.mask > 0).cpu()
    m = compare(scores.logprobs.float().cpu() * mask, batch.rollout_logprobs.float().cpu() * mask, mask)
    level = parity_level(recipe, doc.dtype, doc.num_layers)
    details = {k: m[k] for k in ("parity/mae", "parity/kl_k3", "parity/max_abs", "parity/frac_rho_outside_0.9_1.1")}
    if scores.routing is not None:
        details.update(pooled_routing_metrics(scores.routing, DataParallel()))
    return at_most(NAME, f"{recipe.name}: mae", m["parity/mae"], level,
                   f"precision recipe {recipe.name} runs above its own level on this model: {follow_up(doc, recipe)}",
                   warn_factor=MAE_WARN_FACTOR, details=details)


def follow_up(doc: Doctor, recipe: PrecisionRecipe) -> str:
    """The doctor run that says where a recipe's gap comes from, as one that runs with it: the layers check where it
    can judge the recipe, else prefill_decode (the recipe's own engine, decode vs prefill vs the trainer)."""
    why = precision_refusal(recipe, doc.dtype)
    if why is None:
        return f"rerun with `--set precision.recipe={recipe.name} --only layers` (where it leaves its noise floor)"
    return (f"rerun with `--set precision.recipe={recipe.name} --only prefill_decode` (its engine's decode and "
            f"prefill against the trainer; the layers check does not run it: {why})")


def run(doc: Doctor) -> list[Finding]:
    if doc.cfg.rollout.engine != "vllm" or doc.cfg.rollout.mode != "colocate":
        raise CheckCannotRun("each recipe's engine is a colocated vLLM engine started here; this recipe runs "
                             f"rollout.engine {doc.cfg.rollout.engine!r} in mode {doc.cfg.rollout.mode!r}")
    doc.engine  # noqa: B018 - an engine that cannot load the model skips the whole check with its reason
    out = []
    for recipe in RECIPES.values():
        why = _refusal(doc, recipe)
        if why is not None:
            out.append(skipped(NAME, recipe.name, why))
            continue
        out.append(_row(doc, recipe))
    return out


CHECK = Check(NAME, "how far apart would each precision recipe run on this model?", run)
