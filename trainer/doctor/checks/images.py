"""For a vision-language recipe: do both sides see the same images, score prompts that hold them alike, and where does
the engine's vision tower first leave the trainer's?

Every other check of the battery runs the recipe's prompts as text, without their images: it examines the language
model alone. This one runs the recipe's first prompts as training runs them, each with its images:

1. **inputs**: the engine's expanded prompt ids, the number of images, each image's pixel tensor (by fingerprint) and
   its placeholder span against the trainer's processor's, for every sample (``trainer.vision.identity``: the check
   a training step makes before an update uses the batch). A difference is named by sample, image and quantity.
2. **parity with images**: the trainer's log-probs (its forward with the pixels) against the engine's, judged by the
   level a healthy setup reaches in this dtype and precision, as the recipes check judges the text prompts.
3. **the vision tower, point by point**: the patch embedding, each encoder layer's attention, MLP and output, the
   post-layernorm and the projector's output (the features written at the placeholders), engine against trainer on
   the same pixels, each judged by a band over the model's own noise floor at that point
   (``trainer.diagnostics.noise_floor``, as the layers check judges the decoder), the first point out of its band
   named with its likely cause. Engine side: forward hooks on the colocated vLLM engine's own modules, one request per
   prompt, after the engine has forgotten its cached image features (an image it has seen would otherwise not run
   through the encoder again). vLLM's encoder layer adds the residual into the attention's output in place, so every
   hook copies what it reads when it reads it.

Written for the vision-language models parityrl trains (``trainer.vision.support``: Idefics3, SmolVLM), whose tower
sits at ``model.vision_model`` and projector at ``model.connector`` in both vLLM and Transformers. On CUDA (read from
vLLM 0.32's source, not run): Model Runner V2 runs the vision encoder through ``EncoderRunner``
(``vllm/v1/worker/gpu/mm/encoder_runner.py``), as eager modules unless ``compilation_config.cudagraph_mm_encoder`` or
``compile_mm_encoder`` is set (both off by default), where hooks would not fire; the decoder's hooks need the eager
engine the battery starts for this check (``Check.hooks_engine``).
"""
from __future__ import annotations

from typing import Any

import torch

from rollout.vllm_engine import VLLMEngine
from trainer.diagnostics.noise_floor import FACTOR, WIDER, measure
from trainer.doctor.checks.layers import (
    Point,
    compare_points,
    engine_model,
    first_divergence,
    plot,
    precision_refusal,
    with_bands,
)
from trainer.doctor.context import Doctor
from trainer.doctor.records import FAIL, PASS, Check, CheckCannotRun, Finding, at_most, skipped
from trainer.models.architecture import split_model
from trainer.precision.verdict import MAE_WARN_FACTOR
from trainer.vision.embeddings import image_features
from trainer.vision.identity import differences_line, input_differences
from trainer.vision.pixels import PromptPixels

NAME = "images"
NUM_PROMPTS = 4  # prompts whose images the tower comparison runs, one request each

CAUSES = {
    "vision embedding": "the patch or position embedding differs: the pixels (resize, rescale, normalisation: the "
                        "inputs row says whether they are the same bits), the patch size, or the patch_embedding / "
                        "position_embedding weights",
    "vision attention": "the vision tower's attention differs: its kernel or scale, the patch attention mask (padded "
                        "patches masked on one side only), or the layer's q/k/v/out weights",
    "vision mlp": "the vision tower's MLP differs: its activation (gelu against gelu_tanh) or its fc1 / fc2 weights",
    "vision layer": "the stream after the vision layer differs while its attention and MLP agree: layer_norm1 / "
                    "layer_norm2 (eps, weights) or the residual add",
    "vision norm": "the tower's post-layernorm differs: its eps or weights",
    "projector": "the projector differs: the pixel shuffle (scale_factor) or the projection's weights; what the "
                 "language model reads at the image placeholders differs from here on",
}


def points(num_layers: int) -> list[Point]:
    """Every point of the vision tower compared, in forward order (depth in encoder layers)."""
    out = [Point("vision embedding", "vision embedding", 0.0)]
    for i in range(num_layers):
        out += [Point(f"vision layer {i}, attention", "vision attention", i + 1 / 3),
                Point(f"vision layer {i}, mlp", "vision mlp", i + 2 / 3),
                Point(f"vision layer {i}, output", "vision layer", i + 1.0)]
    return out + [Point("vision post-norm", "vision norm", num_layers + 0.5),
                  Point("projector", "projector", num_layers + 1.0)]


def vision_modules(model, side: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the vision tower, the projector) of a vLLM or Transformers Idefics3-family model (CheckCannotRun if absent)."""
    backbone = getattr(model, "model", None)
    tower, projector = getattr(backbone, "vision_model", None), getattr(backbone, "connector", None)
    if tower is None or projector is None or not hasattr(getattr(tower, "encoder", None), "layers"):
        raise CheckCannotRun(f"the {side} model ({type(model).__name__}) has no model.vision_model.encoder.layers and "
                             f"model.connector: its vision tower cannot be hooked as an Idefics3-family tower")
    return tower, projector


def _hooks(tower, projector, rec: dict[str, list]) -> list:
    """Recording hooks on every point of ``points`` (each call's output, copied at once: vLLM adds the residual into
    the attention's output in place)."""
    def put(key):
        def hook(_m, _a, o):
            t = o[0] if isinstance(o, tuple) else o  # Transformers' attention returns (output, weights)
            rec.setdefault(key, []).append(t.detach().to("cpu", dtype=torch.float32, copy=True))
        return hook

    handles = [tower.embeddings.register_forward_hook(put("vision embedding"))]
    for i, layer in enumerate(tower.encoder.layers):
        handles += [layer.self_attn.register_forward_hook(put(f"vision layer {i}, attention")),
                    layer.mlp.register_forward_hook(put(f"vision layer {i}, mlp")),
                    layer.register_forward_hook(put(f"vision layer {i}, output"))]
    handles += [tower.post_layernorm.register_forward_hook(put("vision post-norm")),
                projector.register_forward_hook(put("projector"))]
    return handles


def _one_run(rec: dict[str, list], names: list[str], where: str) -> dict[str, torch.Tensor]:
    """Each point's rows [images x positions, features] from exactly one run of the tower."""
    runs = {len(rec.get(n, [])) for n in names}
    if runs != {1}:
        raise RuntimeError(f"{where}: the vision tower ran {sorted(runs)} time(s) for one prompt's images; expected "
                           f"once")
    return {n: rec[n][0].reshape(-1, rec[n][0].shape[-1]) for n in names}


def engine_states(engine: VLLMEngine, ids: list[list[int]], images: list[list], spec, names: list[str]) -> list[dict]:
    """Per prompt, each point's value in the engine's tower: one request each (one new token), cache forgotten."""
    tower, projector = vision_modules(engine_model(engine), "engine's")
    rec: dict[str, list] = {}
    handles = _hooks(tower, projector, rec)
    out = []
    try:
        for i, (prompt, imgs) in enumerate(zip(ids, images)):
            engine.forget_images()  # else an image it has seen is served from its cache: no encoder run to hook
            rec.clear()
            engine.generate([prompt], spec, images=[imgs])
            out.append(_one_run(rec, names, f"the engine, prompt {i}"))
    finally:
        for h in handles:
            h.remove()
    return out


def trainer_states(model, pixels: list[PromptPixels], names: list[str]) -> list[dict]:
    """Per prompt, each point's value in the trainer's tower, as its forward runs it (``image_features``)."""
    backbone, _ = split_model(model)
    tower, projector = vision_modules(model, "trainer's")
    dtype, device = next(tower.parameters()).dtype, next(tower.parameters()).device
    rec: dict[str, list] = {}
    handles = _hooks(tower, projector, rec)
    out = []
    try:
        with torch.no_grad():
            for i, p in enumerate(pixels):
                rec.clear()
                image_features(backbone, p.values.to(device), None if p.mask is None else p.mask.to(device), dtype)
                out.append(_one_run(rec, names, f"the trainer, prompt {i}"))
    finally:
        for h in handles:
            h.remove()
    return out


def _inputs_finding(problems: list[str], samples: int) -> Finding:
    return at_most(NAME, "inputs: samples whose ids, images or pixels differ", float(len(problems)), 0.0,
                   f"the engine consumed another prompt than the trainer scores: {differences_line(problems)}",
                   details={"samples": samples, "problems": problems[:20]})


def _tower_findings(doc: Doctor, ids, images, pixels) -> list[Finding]:
    why = precision_refusal(doc.precision, doc.dtype)
    if why is not None:
        return [skipped(NAME, "vision tower", why)]
    if not doc.engine.llm.model_config.enforce_eager:
        return [skipped(NAME, "vision tower", "the engine runs CUDA graphs / torch.compile, where module hooks do not "
                                              "fire: start it with enforce_eager to compare the tower point by point")]
    model = doc.model
    tower, _ = vision_modules(model, "trainer's")
    pts = points(len(tower.encoder.layers))
    names = [p.name for p in pts]
    trainer = trainer_states(model, pixels, names)
    floor = measure(model, doc.dtype, pixels, names, trainer_states, low=trainer)
    engine = engine_states(doc.engine, ids, images, doc.spec(max_new_tokens=1), names)
    rows = with_bands(compare_points(pts, engine, trainer), floor, doc.dtype)
    for r in rows:
        doc.say(f"  {r['point']:<28} rel {r['rel_error']:.3e}  floor {r['floor']:.3e}")
    details: dict[str, Any] = {"factor": FACTOR, "dtype": doc.dtype, "images": sum(len(x) for x in images),
                               "floor_against": str(WIDER[doc.dtype]).replace("torch.", ""), "points": rows}
    if plot(doc.out_dir / "vision_tower.png", rows, f"vision tower, engine vs trainer, {doc.dtype}",
            xlabel="depth (vision encoder layers)"):
        details["plot"] = "vision_tower.png"
    first = first_divergence(rows)

    def expected(r):
        return f"<= {r['band']:.2g} ({FACTOR:g} x floor)"

    if first is None:
        worst = max(rows, key=lambda r: r["rel_error"] / r["band"])
        found = Finding(NAME, "vision tower: first divergence", worst["rel_error"], expected(worst), PASS,
                        details={**details, "largest": worst["point"]})
    else:
        found = Finding(NAME, f"vision tower: first divergence: {first['point']}", first["rel_error"],
                        expected(first), FAIL, f"{first['point']} leaves its band first "
                        f"({first['rel_error'] / max(first['floor'], 1e-30):.3g} x its noise floor): "
                        f"{CAUSES[first['kind']]}", details)
    return [found]


def run(doc: Doctor) -> list[Finding]:
    vision = doc.vision
    if vision is None:
        raise CheckCannotRun("the recipe's prompts hold no images (no data.image_column)")
    engine = doc.engine
    if not isinstance(engine, VLLMEngine):
        raise CheckCannotRun(f"the {type(engine).__name__} takes no images: a vision-language recipe runs the "
                             f"colocated vLLM engine (rollout.engine: vllm)")
    encoded = vision.encode(doc.rows)
    rollouts = engine.generate(encoded.ids, doc.spec(), images=encoded.images)
    problems = input_differences(rollouts, encoded.expected, vision.image_token_id, engine.torch_dtype)
    findings = [_inputs_finding(problems, len(rollouts.prompt_ids))]
    if problems:
        why = "the two sides ran other inputs (the inputs row): their scores would compare other prompts"
        return findings + [skipped(NAME, "prompts with images: mae", why), skipped(NAME, "vision tower", why)]
    pixels = [e.pixels for e in encoded.expected]
    mae = doc.parity(rollouts, pixels=pixels)["parity/mae"]
    level = doc.mae_level()
    findings.append(at_most(NAME, "prompts with images: mae", mae, level,
                            "the log-probs of prompts with images leave this dtype's level: the vision tower row "
                            "says whether the image features already differ", warn_factor=MAE_WARN_FACTOR))
    n = min(NUM_PROMPTS, len(encoded.ids))
    return findings + _tower_findings(doc, encoded.ids[:n], encoded.images[:n], pixels[:n])


CHECK = Check(NAME, "do both sides see the same images, and where does the vision tower first part?", run,
              hooks_engine=True)
