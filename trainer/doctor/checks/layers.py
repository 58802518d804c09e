"""Where it diverges, layer by layer: the hidden states of the engine's model and of the trainer's on the same token
ids, one prefill each, compared point by point in forward order (embedding; for each decoder layer its attention
output, its MLP output and the residual stream after it; the final norm; the logits before and after the
architecture's transform). The first point whose relative error leaves its band (a factor over the model's own noise
floor at that point, ``trainer.diagnostics.noise_floor``) is named, with the likely cause of a divergence that starts there.

Engine side: forward hooks on the colocated vLLM engine's own ``nn.Module`` (``LLM.apply_model``, in this process),
recording while ``engine.score`` runs one sequence's prefill (one request per call, so the engine's flattened rows
are that sequence's positions, in order; rows past its length would be padding). What the hooks read, from
``vllm/model_executor/models/llama.py`` (Qwen2, Qwen3, Mistral and Gemma2 have the same layout):

- a decoder layer returns ``(mlp output, residual)`` and the residual add is fused into the next RMSNorm
  (``fused_add_rms_norm``, in place on CPU: every hook copies what it reads). The residual stream after layer i is
  therefore read where the engine itself computes it: the second output of the next norm
  (``layers[i + 1].input_layernorm(hidden, residual)``, or the final ``norm`` after the last layer), in the
  engine's dtype. Where a norm returns no residual, the layer's ``hidden + residual`` is summed in float32.
- attention: ``self_attn``'s output (after ``o_proj``, before the residual add), as HF's ``self_attn`` returns it;
  MLP: ``mlp``'s output (after ``down_proj``).
- logits: the ``logits_processor``'s output (lm_head GEMM, softcap, scale: what the sampler and the prompt log-probs
  read), captured on every call with its input rows; each input row is matched, bit for bit, to the final norm's
  output row it came from (the prompt log-probs call covers positions 0..n-2, the sampling call position n-1). Where
  the processor transforms the logits (``soft_cap``, ``scale``), the raw logits are the processor's own
  ``_get_logits`` re-run in the hook on the same input.

Trainer side: ``doc.model`` (HF, the recipe's dtype and precision; an MoE model with the recipe's routing replay,
``routing.trainer_routing``, and a divergence at or after a layer whose experts differ from the engine's named as
routing's) with hooks on the same points, one sequence per forward (no padding): the embedding, ``self_attn`` (its
first output), ``mlp``, each decoder layer's output, the final norm, ``lm_head``'s output (raw logits) and the model's
logits (after ``final_logit_softcapping`` or a logit scale).

On CUDA (written against vLLM 0.32's source, not run here): forward hooks do not fire inside a replayed CUDA graph,
nor inside vLLM's ``torch.compile``d forward, so the engine must run eagerly (``enforce_eager``): the battery starts
its engine eagerly when this check is asked (``Check.hooks_engine``, ``context.engine_config``), and the check
refuses an engine that is not (one passed in). The copies then live on the GPU and are moved to the CPU per
sequence.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rollout.vllm_engine import VLLMEngine
from trainer.diagnostics.noise_floor import FACTOR, WIDER, bands, measure
from trainer.doctor.checks.routing import trainer_routing
from trainer.doctor.context import Doctor, relative_error
from trainer.doctor.records import FAIL, PASS, Check, CheckCannotRun, Finding, at_most
from trainer.models.architecture import LANGUAGE_MODELS

NAME = "layers"
NUM_SEQUENCES = 4  # the first sequences of the fixed batch: ~25 positions each on the tiny model

# A point is healthy within its band: ``noise_floor.FACTOR`` times the model's own noise floor there (the trainer's
# forward in the run's dtype against the same weights in a wider dtype, ``trainer.diagnostics.noise_floor``), so the band
# grows with depth and width as the two sides' rounding does, on every model.
CAUSES = {
    "embedding": "the token ids or the embedding weights differ (a sync that left embed_tokens out, a resized "
                 "vocabulary, an embedding scale one side applies)",
    "attention": "the attention differs: the attention kernel, the RoPE variant or theta, q/k norms, q/k/v/o biases, "
                 "a sliding window or an attention softcap one side does not apply, or the layer's q/k/v/o weights",
    "mlp": "the MLP differs: its activation (hidden_act), its weights (gate/up/down), or an MLP bias",
    "layer": "the residual stream after the layer differs while its attention and MLP agree: the residual add or "
             "the norms around them (eps, a (1 + w) weight offset, extra pre/post norms)",
    "final norm": "the final norm differs: its eps or weight, or a (1 + w) weight offset one side applies",
    "logits (raw)": "the lm_head differs: tied vs untied embeddings, or the lm_head weights",
    "logits": "the logits' transform differs: final_logit_softcapping or a logit scale one side applies",
}


@dataclass(frozen=True)
class Point:
    name: str  # "layer 0, attention"
    kind: str  # a key of CAUSES
    depth: float  # x of the plot: 0 the embedding, i + 1/3, i + 2/3, i + 1 inside layer i


def points(num_layers: int, transformed: bool) -> list[Point]:
    """Every point compared, in forward order."""
    out = [Point("embedding", "embedding", 0.0)]
    for i in range(num_layers):
        out += [Point(f"layer {i}, attention", "attention", i + 1 / 3), Point(f"layer {i}, mlp", "mlp", i + 2 / 3),
                Point(f"layer {i}, output", "layer", i + 1.0)]
    out.append(Point("final norm", "final norm", num_layers + 0.5))
    if transformed:
        out.append(Point("logits (raw)", "logits (raw)", num_layers + 0.75))
    out.append(Point("logits", "logits", num_layers + 1.0))
    return out


# ---- the engine's side --------------------------------------------------------------------------
def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def engine_model(engine: VLLMEngine):
    """vLLM's model object (in-process: ``apply_model`` returns the module itself)."""
    return engine.llm.apply_model(lambda m: m)[0]


def _engine_module(engine: VLLMEngine):
    """vLLM's model object, checked to hold a Llama-family decoder (``_engine_decoder``) and its logits."""
    model = engine_model(engine)
    missing = [a for a in ("model", "logits_processor", "lm_head") if not hasattr(model, a)]
    if missing or _engine_decoder(model) is None:
        missing += [f"model.{a}" for a in ("embed_tokens", "layers", "norm")]
        raise CheckCannotRun(f"the engine's model ({type(model).__name__}) has no {', '.join(missing)}: its layers "
                             f"cannot be hooked as a Llama-family decoder's")
    return model


def _engine_decoder(model):
    """The module holding the decoder's ``embed_tokens``, ``layers`` and ``norm``: ``model.model`` for a causal LM,
    its language model (``trainer.models.architecture.LANGUAGE_MODELS``) for a vision-language model, whose text
    prompts the check runs (the vision tower is the images check's); None if neither holds them."""
    backbone = getattr(model, "model", None)
    for holder in (backbone, *(getattr(backbone, name, None) for name in LANGUAGE_MODELS)):
        if holder is not None and all(hasattr(holder, a) for a in ("embed_tokens", "layers", "norm")):
            return holder
    return None


def _engine_hooks(model, rec: dict[str, Any]) -> list:
    """Register the recording hooks on vLLM's model; ``rec`` receives each point's output rows (every call)."""
    inner = _engine_decoder(model)
    layers = inner.layers
    n = len(layers)

    def put(key, value):
        rec.setdefault(key, []).append(value)

    def out_hook(key, pick=lambda o: o):
        return lambda _m, _a, o: put(key, _copy(pick(o)))

    def layer_hook(i):
        def hook(_m, _a, o):
            if isinstance(o, tuple) and len(o) == 2 and o[1] is not None:  # (mlp output, residual before the add)
                put(f"sum {i}", o[0].detach().float().cpu() + o[1].detach().float().cpu())
            else:
                put(f"sum {i}", _copy(o[0] if isinstance(o, tuple) else o))
        return hook

    def norm_hook(i, is_final):  # the next norm after layer i: (normed, residual stream after layer i)
        def hook(_m, _a, o):
            if isinstance(o, tuple):
                put(f"stream {i}", _copy(o[1]))
                if is_final:
                    put("final norm", _copy(o[0]))
            elif is_final:
                put("final norm", _copy(o))
        return hook

    lp = model.logits_processor
    transformed = getattr(lp, "soft_cap", None) is not None or getattr(lp, "scale", 1.0) != 1.0

    def logits_hook(m, args, o):
        hidden = args[1]
        put("logits calls", (_copy(hidden), _copy(o)))
        if transformed:
            with torch.no_grad():
                put("logits raw calls", _copy(m._get_logits(hidden, args[0], None)))

    handles = [inner.embed_tokens.register_forward_hook(out_hook("embedding"))]
    for i, layer in enumerate(layers):
        handles += [layer.self_attn.register_forward_hook(out_hook(f"layer {i}, attention",
                                                                   lambda o: o[0] if isinstance(o, tuple) else o)),
                    layer.mlp.register_forward_hook(out_hook(f"layer {i}, mlp")),
                    layer.register_forward_hook(layer_hook(i))]
        nxt = layers[i + 1].input_layernorm if i + 1 < n else inner.norm
        handles.append(nxt.register_forward_hook(norm_hook(i, i + 1 == n)))
    handles.append(lp.register_forward_hook(logits_hook))
    return handles


def _place_logits(calls, raw_calls, normed: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The logits [n, V] of each position: every call's input row matched, bit for bit, to the final norm's row."""
    n = normed.shape[0]
    logits, raw = [None] * n, [None] * n
    for k, (hidden, out) in enumerate(calls):
        same = (hidden[:, None, :] == normed[None, :, :]).all(-1)  # [rows, n]
        for r in range(hidden.shape[0]):
            hit = torch.nonzero(same[r]).flatten()
            if hit.numel():
                logits[int(hit[0])] = out[r]
                if raw_calls:
                    raw[int(hit[0])] = raw_calls[k][r]
    lost = [p for p in range(n) if logits[p] is None]
    if lost:
        raise RuntimeError(f"the engine computed no logits for positions {lost[:8]} of a {n}-token sequence (its "
                           f"logits processor's inputs matched no final-norm row there)")
    return torch.stack(logits), (torch.stack(raw) if raw_calls else None)


def engine_states(engine: VLLMEngine, seqs: list[list[int]], names: list[str]) -> list[dict[str, torch.Tensor]]:
    """Per sequence, each point's engine value [positions, features] (float32), from one prefill each."""
    model = _engine_module(engine)
    n_layers = len(_engine_decoder(model).layers)
    out = []
    rec: dict[str, Any] = {}
    handles = _engine_hooks(model, rec)
    try:
        for seq in seqs:
            rec.clear()
            engine.score([seq])
            n = len(seq)
            one = {}
            for key in ("embedding", *(f"layer {i}, {p}" for i in range(n_layers) for p in ("attention", "mlp"))):
                one[key] = rec[key][0][:n]
            for i in range(n_layers):
                stream = rec.get(f"stream {i}")
                one[f"layer {i}, output"] = (stream or rec[f"sum {i}"])[0][:n]
            one["final norm"] = rec["final norm"][0][:n]
            logits, raw = _place_logits(rec["logits calls"], rec.get("logits raw calls", []), one["final norm"])
            one["logits"] = logits
            if raw is not None:
                one["logits (raw)"] = raw
            if len(rec["embedding"]) != 1:
                raise RuntimeError(f"one score() call ran {len(rec['embedding'])} forwards; expected one prefill")
            out.append({k: v.float() for k, v in one.items() if k in names})
    finally:
        for h in handles:
            h.remove()
    return out


# ---- the trainer's side -------------------------------------------------------------------------
def trainer_states(model, seqs: list[list[int]], names: list[str]) -> list[dict[str, torch.Tensor]]:
    """Per sequence, each point's value in the trainer's HF model [positions, features] (float32), one forward each."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    rec: dict[str, torch.Tensor] = {}

    def hook(key):
        def fn(_m, _a, o):
            rec[key] = _copy((o[0] if isinstance(o, tuple) else o)[0])  # batch of one: [positions, features]
        return fn

    handles = [model.get_input_embeddings().register_forward_hook(hook("embedding")),
               decoder.norm.register_forward_hook(hook("final norm")),
               model.get_output_embeddings().register_forward_hook(hook("logits (raw)"))]
    for i, layer in enumerate(decoder.layers):
        handles += [layer.self_attn.register_forward_hook(hook(f"layer {i}, attention")),
                    layer.mlp.register_forward_hook(hook(f"layer {i}, mlp")),
                    layer.register_forward_hook(hook(f"layer {i}, output"))]
    device = next(model.parameters()).device
    out = []
    try:
        with torch.no_grad():
            for seq in seqs:
                rec.clear()
                logits = model(input_ids=torch.tensor([seq], device=device)).logits
                rec["logits"] = _copy(logits[0])
                out.append({k: v.float() for k, v in rec.items() if k in names})
    finally:
        for h in handles:
            h.remove()
    return out


def _transformed(model, engine_model) -> bool:
    """Whether either side transforms the logits after lm_head (softcap, scale)."""
    c = model.config
    lp = engine_model.logits_processor
    return bool(getattr(c, "final_logit_softcapping", None) or getattr(c, "logit_scale", 1.0) not in (None, 1.0)
                or getattr(c, "logits_scaling", 1.0) not in (None, 1.0) or getattr(lp, "soft_cap", None) is not None
                or getattr(lp, "scale", 1.0) != 1.0)


# ---- comparison ---------------------------------------------------------------------------------
def compare_points(pts: list[Point], engine: list[dict], trainer: list[dict]) -> list[dict[str, Any]]:
    """One row per point: the overall relative error, the worst position's, where it is, and the mean per position."""
    rows = []
    for p in pts:
        e = torch.cat([s[p.name] for s in engine])
        t = torch.cat([s[p.name] for s in trainer])
        if e.shape != t.shape:
            raise RuntimeError(f"{p.name}: the engine's values have shape {tuple(e.shape)}, the trainer's "
                               f"{tuple(t.shape)} (a vocabulary or hidden size the two sides read differently)")
        per_pos = [((a.double() - b.double()).norm(dim=-1) / b.double().norm(dim=-1).clamp_min(1e-30))
                   for a, b in zip((s[p.name] for s in engine), (s[p.name] for s in trainer))]
        worst = max(((float(v.max()), k, int(v.argmax())) for k, v in enumerate(per_pos)))
        longest = max(len(v) for v in per_pos)
        profile = [float(torch.stack([v[j] for v in per_pos if len(v) > j]).mean()) for j in range(longest)]
        rows.append({"point": p.name, "kind": p.kind, "depth": p.depth, "rel_error": relative_error(e, t),
                     "max_position_error": worst[0], "worst": {"sequence": worst[1], "position": worst[2]},
                     "per_position_mean": [float(f"{x:.3g}") for x in profile]})
    return rows


def first_divergence(rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The first row (in forward order) whose relative error leaves its own band, ``row["band"]`` (a NaN leaves it)."""
    for r in rows:
        if not r["rel_error"] <= r["band"]:
            return r
    return None


MARKERS = {"embedding": "s", "attention": "^", "mlp": "v", "layer": "o", "final norm": "D", "logits (raw)": "x",
           "logits": "*"}


def plot(path, rows: list[dict[str, Any]], title: str, xlabel: str = "depth (decoder layers)") -> bool:
    """Relative error against depth (log scale), one marker per kind of point, the model's noise floor and the band
    over it as lines. False: matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # late: optional (the `reports` extra)
        from matplotlib.figure import Figure  # late: optional
    except ImportError:
        return False
    fig = Figure(figsize=(7.0, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    floor = 1e-12  # a point that agrees bit for bit, drawn at the bottom of the log axis
    for kind in dict.fromkeys(r["kind"] for r in rows):  # in forward order
        sel = [r for r in rows if r["kind"] == kind]
        ax.scatter([r["depth"] for r in sel], [max(r["rel_error"], floor) for r in sel],
                   marker=MARKERS.get(kind, MARKERS.get(kind.split()[-1], "o")), label=kind)
    ax.plot([r["depth"] for r in rows], [max(r["rel_error"], floor) for r in rows], color="grey", lw=0.8)
    depth = [r["depth"] for r in rows]
    ax.plot(depth, [max(r["floor"], floor) for r in rows], color="black", ls=":", lw=1, label="noise floor")
    ax.plot(depth, [r["band"] for r in rows], color="red", ls="--", lw=1, label=f"band ({FACTOR:g} x floor)")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("‖engine − trainer‖ / ‖trainer‖")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return True


# ---- the check ----------------------------------------------------------------------------------
def precision_refusal(precision, dtype: str) -> Optional[str]:
    """Why this check cannot judge a precision recipe (a ``PrecisionRecipe``) in ``dtype``; None: it can. The
    recipes check asks it before suggesting this check as the follow-up of a recipe above its level."""
    if dtype not in WIDER:
        return f"model.dtype {dtype!r}: the noise floor is measured for {', '.join(WIDER)}"
    if precision.block_fp8_on_cuda:  # the records whose engine runs FP8 GEMMs (emulated on CPU)
        return (f"precision {precision.name!r}: the engine's FP8 GEMMs leave the {dtype} band at the first quantized "
                f"layer by design; the noise floor is an un-quantized forward's")
    return None


def _refuse(doc: Doctor) -> None:
    why = precision_refusal(doc.precision, doc.dtype)
    if why is not None:
        raise CheckCannotRun(why)
    engine = doc.engine
    if not isinstance(engine, VLLMEngine):
        if type(engine).__name__ == "HFEngine":
            raise CheckCannotRun("the HF engine runs Transformers' own model: engine vs trainer layer by layer would "
                                 "compare the trainer with itself")
        raise CheckCannotRun(f"the {type(engine).__name__} runs its model in another process: the layer hooks need "
                             f"the colocated vLLM engine (rollout.engine: vllm)")
    if not engine.llm.model_config.enforce_eager:
        raise CheckCannotRun("the engine runs CUDA graphs / torch.compile, where module hooks do not fire: start it "
                             "with enforce_eager to compare layer by layer")


def with_bands(rows: list[dict[str, Any]], floor: dict[str, float], dtype: str) -> list[dict[str, Any]]:
    """Each row with the model's noise floor at its point and the band over it (``trainer.diagnostics.noise_floor``)."""
    band = bands(floor, dtype)
    return [{**r, "floor": floor[r["point"]], "band": band[r["point"]]} for r in rows]


def run(doc: Doctor) -> list[Finding]:
    _refuse(doc)
    batch = doc.batch()
    seqs = [list(p) + list(c) for p, c in zip(batch.prompt_ids[:NUM_SEQUENCES], batch.completion_ids[:NUM_SEQUENCES])]
    model = doc.model
    pts = points(len((model.get_decoder() if hasattr(model, "get_decoder") else model.model).layers),
                 _transformed(model, _engine_module(doc.engine)))
    names = [p.name for p in pts]
    with trainer_routing(doc, seqs) as routes:  # an MoE model: the recipe's routing replay, the experts used read
        trainer = trainer_states(model, seqs, names)
    floor = measure(model, doc.dtype, seqs, names, trainer_states, low=trainer)
    rows = with_bands(compare_points(pts, engine_states(doc.engine, seqs, names), trainer), floor, doc.dtype)
    for r in rows:
        doc.say(f"  {r['point']:<22} rel {r['rel_error']:.3e}  floor {r['floor']:.3e}  "
                f"worst position {r['max_position_error']:.3e}")
    first = first_divergence(rows)
    details = {"factor": FACTOR, "dtype": doc.dtype, "floor_against": str(WIDER[doc.dtype]).replace("torch.", ""),
               "sequences": len(seqs), "positions": sum(len(s) for s in seqs), "points": rows}
    if plot(doc.out_dir / "layers.png", rows, f"engine vs trainer, {doc.dtype}, {len(seqs)} sequences"):
        details["plot"] = "layers.png"

    def expected(r):
        return f"<= {r['band']:.2g} ({FACTOR:g} x floor)"

    if first is None:  # the figure shown: the point nearest its band
        worst = max(rows, key=lambda r: r["rel_error"] / r["band"])
        found = Finding(NAME, "first divergence", worst["rel_error"], expected(worst), PASS,
                        details={**details, "largest": worst["point"]})
    else:
        found = Finding(NAME, f"first divergence: {first['point']}", first["rel_error"], expected(first), FAIL,
                        f"{first['point']} leaves its band first ({first['rel_error'] / first['floor']:.3g} x its "
                        f"noise floor): {(routes and routes.cause(first['depth'])) or CAUSES[first['kind']]}", details)
    logits = rows[-1]
    last = at_most(NAME, "logits: relative error", logits["rel_error"], logits["band"],
                   CAUSES["logits"] if first is None else f"carried from {first['point']}",
                   details={"max_position_error": logits["max_position_error"], "floor": logits["floor"]})
    return [found, dataclasses.replace(last, expected=expected(logits))]


CHECK = Check(NAME, "where do the engine's hidden states first leave the trainer's, layer by layer?", run,
              hooks_engine=True)

