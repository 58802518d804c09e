"""Hugging Face ``generate`` as a rollout engine: the reference and the fallback.

Same interface and conventions as ``rollout.vllm_engine.VLLMEngine``: token ids
in, group-contiguous ``Rollouts`` out, and for every sampled token the log-prob
under the distribution it was sampled from:

    log_softmax(mask_{top-k, top-p}(mask_{min-p}(logits / temperature)))[token]

i.e. vLLM's ``logprobs_mode="processed_logprobs"``: temperature, then min-p, then
top-k and top-p, masked tokens at -inf and the kept ones renormalised, in vLLM's
order rather than Transformers' own (temperature, top-k, top-p, min-p), which
keeps another set when min-p and top-p are both on (``rollout.hf_sampling``).
With truncation off both are log_softmax(logits / T).

Prompts are left-padded into one batch (chunked by ``max_batch_size``); the
model's own generation_config is set aside during the call so that defaults
such as a repetition penalty cannot change the distribution silently.
Reproducible: the global torch RNG is seeded per chunk from ``spec.seed`` inside
``torch.random.fork_rng``, leaving the caller's RNG state untouched.
"""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

import torch

from rollout.adapters import LoraAdapter
from rollout.base import InProcessEngine
from rollout.hf_routes import RouterTap, generation_routes
from rollout.hf_sampling import VLLMOrderWarper
from rollout.moe_config import route_shape
from rollout.requests import sample_seed, validate_request
from rollout.support import Support
from rollout.types import Rollouts, SamplingSpec, Scored


def attention_implementation(config) -> str | None:
    """The Transformers attention implementation that computes what the model defines, or None for the default.

    Gemma2's ``attn_logit_softcapping`` is applied by the ``eager`` attention only
    (SDPA has no score hook; ``sdpa_attention_forward`` ignores ``softcap``), while
    vLLM's attention applies it (``logits_soft_cap``): eager makes both the same function. Used
    by the trainer's ``load_base_model`` and by this engine.
    """
    get_text = getattr(config, "get_text_config", None)  # multimodal configs nest the decoder's
    text = get_text() if callable(get_text) else config
    return "eager" if getattr(text, "attn_logit_softcapping", None) else None


class HFEngine(InProcessEngine):
    """A ``transformers`` causal LM behind the ``rollout.base.RolloutEngine`` interface.

    model: a loaded ``PreTrainedModel`` (used as is, e.g. the trainer's own policy)
        or a local HF directory / hub id to load.
    dtype: dtype to load a model from a path with (ignored for a loaded model).
    device: where to load it ("cpu", "cuda").
    eos_ids: stop tokens; default: the model's generation_config / config EOS ids.
    max_batch_size: sequences per ``generate`` call.
    return_routes: an MoE model's routes in every ``Rollouts.routes``, read from its routers during
        generation (``rollout.hf_routes``).
    serve_adapters: run LoRA adapters (``load_adapter``) as the trainer does: the model becomes a PEFT model at
        the first one, its adapter weights in float32 as PEFT keeps the trainer's (``autocast_adapter_dtype``),
        so both sides compute the same function.
    """

    def __init__(self, model, *, dtype: str = "bfloat16", device: str = "cpu",
                 eos_ids: Sequence[int] | None = None, max_batch_size: int = 256, return_routes: bool = False,
                 serve_adapters: bool = False) -> None:
        if isinstance(model, (str, Path)):
            from transformers import AutoConfig, AutoModelForCausalLM

            torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else None
            if not isinstance(torch_dtype, torch.dtype):
                raise ValueError(f"dtype = {dtype!r}: expected a torch dtype name such as 'bfloat16'")
            attn = attention_implementation(AutoConfig.from_pretrained(str(model)))
            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch_dtype,
                                                         **({"attn_implementation": attn} if attn else {})).to(device)
        if not hasattr(model, "generate"):
            raise TypeError(f"model: expected a transformers PreTrainedModel or a path, got {type(model).__name__}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size = {max_batch_size!r}: expected an integer >= 1")
        self.model = model.eval()
        self.max_batch_size = max_batch_size
        self.return_routes = bool(return_routes)
        self.route_shape = None
        if self.return_routes:  # a model without routers is refused now, not at the first generate
            routers = RouterTap(model).routers
            self.route_shape = route_shape(len(routers), routers[0].top_k, routers[0].num_experts)
        gen, cfg = getattr(model, "generation_config", None), model.config
        if eos_ids is None:
            eos = getattr(gen, "eos_token_id", None)
            eos = cfg.eos_token_id if eos is None else eos
            eos_ids = [] if eos is None else (eos if isinstance(eos, (list, tuple)) else [eos])
        self.eos_ids = [int(e) for e in eos_ids]
        pad = getattr(gen, "pad_token_id", None)
        pad = getattr(cfg, "pad_token_id", None) if pad is None else pad
        self.pad_id = int(pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0))
        self.max_model_len = getattr(cfg, "max_position_embeddings", None)
        # PEFT runs an adapter in its own dtype, float32 unless told otherwise (peft/tuners/lora/layer.py)
        self.adapter_dtype = torch.float32 if serve_adapters else None
        self.adapter_version: int | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ---- generation -------------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec) -> Rollouts:
        """Sample ``spec.n`` completions per prompt; sample i answers prompt i // n."""
        validate_request(prompt_ids, spec, self.max_model_len)
        rows = [list(p) for p in prompt_ids for _ in range(spec.n)]
        completion_ids, logprobs, finish, top_ids, top_lps, routes, support = [], [], [], [], [], [], []
        for chunk, start in enumerate(range(0, len(rows), self.max_batch_size)):
            c, lp, f, ti, tl, r, sup = self._generate_chunk(rows[start:start + self.max_batch_size], spec,
                                                            seed=sample_seed(spec.seed, chunk))
            routes += r
            support += sup
            completion_ids += c
            logprobs += lp
            finish += f
            top_ids += ti
            top_lps += tl
        return Rollouts(prompt_ids=rows, completion_ids=completion_ids, rollout_logprobs=logprobs,
                        finish_reasons=finish, group_size=spec.n, topk_ids=top_ids, topk_logprobs=top_lps,
                        routes=routes, support=support)

    @torch.no_grad()
    def score(self, sequences: list[list[int]], topk: int = 0) -> Scored:
        """log p(x_t | x_<t) at temperature 1 of every token t >= 1 of each sequence (one forward each),
        and with ``topk`` the k most likely tokens at those positions (``rollout.base``)."""
        routes = []

        def row(seq: list[int]):
            ids = torch.tensor([seq], device=self.device)
            with RouterTap(self.model) if self.return_routes else contextlib.nullcontext() as tap:
                logits = self.model(input_ids=ids).logits
            if tap is not None:
                routes.append(torch.stack([calls[0] for calls in tap.calls], 1))  # [len(seq), L, k]
            logp = torch.log_softmax(logits[0, :-1].float(), dim=-1)
            top = logp.topk(topk, dim=-1) if topk else None
            return (logp.gather(-1, ids[0, 1:, None])[:, 0].tolist(), top.indices.tolist() if topk else [],
                    top.values.tolist() if topk else [])

        scored = Scored.from_rows(map(row, sequences))
        scored.routes = routes
        return scored

    def _generation_config(self, spec: SamplingSpec):
        """Sampling with Transformers' own warpers off: ``VLLMOrderWarper`` (given to ``generate``) applies the
        temperature and the truncation, in vLLM's order."""
        from transformers import GenerationConfig

        return GenerationConfig(
            do_sample=True, num_beams=1, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
            max_new_tokens=spec.max_new_tokens, min_new_tokens=0, eos_token_id=self.eos_ids or None,
            pad_token_id=self.pad_id, output_scores=True, return_dict_in_generate=True, use_cache=True,
        )

    @torch.no_grad()
    def _generate_chunk(self, rows: list[list[int]], spec: SamplingSpec, seed: int):
        """rows: [B][P_b] prompts (already repeated n times).

        Returns completions, log-probs, finish reasons, (if ``spec.logprobs_topk``) top-k ids and log-probs,
        (if ``return_routes``) the routes of every row, and (if ``spec.truncated``) each row's kept sets: the finite
        entries of the processed scores its token was sampled from.
        """
        from transformers import LogitsProcessorList

        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):  # left padding: the next token is always at position -1
            input_ids[b, width - len(r):] = torch.tensor(r)
            attention_mask[b, width - len(r):] = 1
        saved_config = self.model.generation_config
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            self.model.generation_config = self._generation_config(spec)
            with torch.random.fork_rng(devices=devices), (RouterTap(self.model) if self.return_routes
                                                           else contextlib.nullcontext()) as tap:
                torch.manual_seed(seed)
                warper = VLLMOrderWarper(temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p,
                                         min_p=spec.min_p)
                out = self.model.generate(input_ids=input_ids.to(self.device),
                                          attention_mask=attention_mask.to(self.device),
                                          logits_processor=LogitsProcessorList([warper]))
        finally:
            self.model.generation_config = saved_config
        new = out.sequences[:, width:]                            # [B, T]
        # out.scores: T x [B, V] processed logits; reduce step by step rather than stacking [B, T, V].
        k = spec.logprobs_topk
        lp, top_v, top_i, kept = [], [], [], []
        for t, s in enumerate(out.scores):
            logp = torch.log_softmax(s.float(), dim=-1)
            if spec.truncated:
                kept.append(torch.isfinite(logp).cpu())
            lp.append(logp.gather(-1, new[:, t:t + 1]).squeeze(-1))
            if k:
                v, i = torch.topk(logp, k, dim=-1)
                top_v.append(v)
                top_i.append(i)
        lp = torch.stack(lp, dim=1).cpu()  # [B, T]
        if k:
            top_v, top_i = torch.stack(top_v, dim=1).cpu(), torch.stack(top_i, dim=1).cpu()  # [B, T, k]
        new = new.cpu()
        eos = torch.tensor(self.eos_ids, dtype=torch.long)
        completions, logprobs, finish, top_ids, top_lps = [], [], [], [], []
        for b in range(len(rows)):
            hits = torch.isin(new[b], eos).nonzero()
            end = int(hits[0]) + 1 if len(hits) else new.shape[1]  # keep the EOS token itself
            completions.append(new[b, :end].tolist())
            logprobs.append(lp[b, :end].tolist())
            finish.append("stop" if len(hits) else "length")
            if k:
                top_ids.append(top_i[b, :end].tolist())
                top_lps.append(top_v[b, :end].tolist())
        routes = (generation_routes(tap, [len(r) for r in rows], width, [len(c) for c in completions])
                  if self.return_routes else [])
        support = ([Support.from_lists([kept[t][b].nonzero().squeeze(1).tolist() for t in range(len(c))])
                    for b, c in enumerate(completions)] if spec.truncated else [])
        return completions, logprobs, finish, top_ids, top_lps, routes, support

    # ---- weights ----------------------------------------------------------------------------
    def load_adapter(self, adapter: LoraAdapter) -> None:
        """Run ``adapter`` from now on: the first one wraps the model in PEFT (from PEFT's own files), a later
        one replaces the adapter's weights in place."""
        if self.adapter_dtype is None:
            raise RuntimeError("load_adapter(): this engine was started without adapters; construct "
                               "HFEngine(..., serve_adapters=True)")
        from peft import PeftModel, set_peft_model_state_dict

        if self.adapter_version is None:
            with tempfile.TemporaryDirectory(prefix="parityrl-adapter-") as d:
                self.model = PeftModel.from_pretrained(self.model, adapter.write(d), is_trainable=False).eval()
        else:
            result = set_peft_model_state_dict(self.model, adapter.tensors)
            if result.unexpected_keys:
                raise ValueError(f"adapter version {adapter.version}: weights the engine's adapter does not have: "
                                 f"{result.unexpected_keys[:4]}")
        self.adapter_version = adapter.version

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the model's parameters by HF name (cast to each parameter's dtype)."""
        if self.adapter_version is not None:
            raise RuntimeError("load_weights(): this engine runs a LoRA adapter; merged weights would add the "
                               "update a second time (rollout.lora_sync chooses one of the two per run)")
        params = dict(self.model.named_parameters(remove_duplicate=False))
        updates = list(named_tensors)
        unknown = [n for n, _ in updates if n not in params]
        if unknown:
            raise ValueError(f"named_tensors: unknown parameter names {unknown[:6]} (expected HF names such as "
                             f"{next(iter(params))!r})")
        bad = [(n, tuple(t.shape), tuple(params[n].shape)) for n, t in updates if t.shape != params[n].shape]
        if bad:
            raise ValueError(f"named_tensors: shape mismatch (name, given, expected): {bad[:4]}")
        with torch.no_grad():
            for name, tensor in updates:
                params[name].copy_(tensor.detach().to(device=params[name].device, dtype=params[name].dtype))

    def sleep(self, level: int = 1) -> None:
        """Nothing to free: the model is the caller's."""

    def wake_up(self) -> None:
        """See ``sleep``."""

    def close(self) -> None:
        """Drop the reference to the model."""
        self.model = None
