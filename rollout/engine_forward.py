"""The engine's forward, re-run outside the engine: vLLM 0.32's CPU numerics for Llama-family decoders.

Exact mode (``precision.recipe: exact``) needs the trainer's log-probs to be the engine's, bit
for bit. Measured with vLLM 0.32 on CPU (``tests/rollout/test_engine_forward.py``): vLLM's CPU forward is
already invariant to how tokens are batched — a token's log-prob from a decode step among
other sequences equals its log-prob from a one-pass prefill of the whole sequence, float32 and
bfloat16, on the tiny model and on SmolLM2-135M. What differs is the trainer's forward: HF's
modules round at other points (RMSNorm, RoPE's cos/sin table, SDPA, separate q/k/v GEMMs, the
chunked log-softmax). So this module computes a prefill with the engine's own kernels, in the
engine's op order (``vllm/model_executor/models/llama.py``), on weights the caller gives:

- linear layers: ``dispatch_cpu_unquantized_gemm`` — vLLM's own choice of GEMM (oneDNN on x86 CPUs),
  on the fused ``qkv_proj`` / ``gate_up_proj`` matrices the engine holds;
- RMSNorm with the residual add fused: ``vllm.ir.ops`` (the dispatcher the engine's layers use);
- RoPE: the engine's rotary module itself (its cos/sin cache, its ``_C.rotary_embedding``);
- attention: ``_C.cpu_attention_with_kv_cache`` over a paged KV cache laid out as the engine's;
- logits: the same GEMM on lm_head, then float32, ``div`` by the temperature and
  ``log_softmax`` as the sampler does (``vllm/v1/sample/sampler.py``).

No autograd: the trainer takes these values and routes gradients through its differentiable HF
forward (``trainer.models.exact``). On CUDA vLLM's batch-invariant mode is the route instead
(``VLLM_BATCH_INVARIANT=1``); that path is written in ``trainer.models.exact`` and unrun here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from rollout.moe_config import is_moe
from rollout.support import Support

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# What this forward implements; anything else in a config is refused by ``check_supported``.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
HEAD_ROWS = 1024  # positions per lm_head + log_softmax chunk: 1024 x 152k vocab x 4 B = 0.6 GB at most


def check_supported(config) -> None:
    """Refuse (ValueError naming the op) a model this forward does not reproduce."""
    mt = getattr(config, "model_type", None)
    if is_moe(config):
        raise ValueError(f"model_type {mt!r} is a mixture-of-experts model: exact mode does not re-implement vLLM's "
                         f"fused MoE kernel (its top-k and expert GEMMs); parity.routing_replay makes the two sides "
                         f"route alike without it (docs/moe.md)")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {mt!r}: exact mode reproduces the engine's forward for "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} only (its ops are not re-implemented for {mt!r})")
    checks = [
        ("hidden_act", getattr(config, "hidden_act", "silu") == "silu", "the SiLU-and-mul MLP"),
        ("sliding_window", not _sliding(config), "full attention (no sliding window)"),
        ("mlp_bias", not getattr(config, "mlp_bias", False), "MLP without biases"),
        ("attention_bias (o_proj)", not (mt == "llama" and getattr(config, "attention_bias", False)),
         "no o_proj bias"),
        ("rope_parameters", _plain_rope(config), "plain RoPE (no scaling)"),
    ]
    for key, ok, what in checks:
        if not ok:
            raise ValueError(f"{mt} config {key}: exact mode covers {what}; this op is not re-implemented")


def _sliding(config) -> bool:
    # Qwen2/3 carry a window size that applies only with use_sliding_window; Llama/Mistral apply theirs.
    if hasattr(config, "use_sliding_window"):
        return bool(config.use_sliding_window)
    return getattr(config, "sliding_window", None) is not None


def _plain_rope(config) -> bool:
    rp = getattr(config, "rope_parameters", None) or {}
    kind = rp.get("rope_type", "default") if isinstance(rp, dict) else "default"
    return kind == "default"


@dataclass
class _Linear:
    """A holder vLLM's GEMM dispatch can prepare (it reads ``weight`` and sets ``cpu_linear``)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    cpu_linear: Callable | None = None

    def cpu_linear_fn(self, rows: torch.Tensor) -> torch.Tensor:
        return self.cpu_linear(rows, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # late: the plug-in imports vLLM; this module is imported by recipe checks that run without it
        from rollout.vllm_plugins.exact_quant import invariant_linear

        return invariant_linear(self.cpu_linear_fn, x)


def _prepared(weight: torch.Tensor, bias: torch.Tensor | None) -> _Linear:
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    holder = _Linear(weight.contiguous(), None if bias is None else bias.contiguous())
    dispatch_cpu_unquantized_gemm(holder, remove_weight=False)
    return holder


class EngineForward:
    """Log-probs of token sequences computed as the colocated vLLM engine computes them.

    ``engine``: a live ``rollout.vllm_engine.VLLMEngine`` (its rotary module, block size and
    attention ISA are read from it, so both sides run the same kernels with the same tables).
    ``config``: the HF config of the model. Weights are given per call, HF-named, already in the
    engine's dtype and with LoRA merged as the weight export merges it.
    """

    def __init__(self, engine, config) -> None:
        check_supported(config)
        self.config = config
        self.dtype = engine.torch_dtype
        # late: the plug-in imports vLLM (see _Linear.__call__)
        from rollout.vllm_plugins.exact_quant import kv_split

        probe = engine.llm.apply_model(_engine_layout)[0]
        vllm_config = engine.llm.llm_engine.vllm_config
        self.rotary = probe["rotary"]
        self.block_size = int(vllm_config.cache_config.block_size)
        self.isa = probe["isa"]
        self.scale = probe["scale"]
        self.split_kv = kv_split(vllm_config)
        self.eps = float(config.rms_norm_eps)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.vocab = config.vocab_size
        self.qk_norm = getattr(config, "model_type", "") == "qwen3"
        self._prepared: dict[str, _Linear] = {}
        self._version = None

    # ---- weights ----------------------------------------------------------------------------
    def set_weights(self, named: dict[str, torch.Tensor], version=None) -> None:
        """Take a full HF-named state dict (engine dtype); fused matrices built as vLLM loads them."""
        w = {k.removeprefix("model."): v for k, v in named.items()}
        layers = self.config.num_hidden_layers
        self.embed = w["embed_tokens.weight"]
        self.norms = {}
        lin = {}
        for i in range(layers):
            p = f"layers.{i}."
            self.norms[p + "in"] = w[p + "input_layernorm.weight"]
            self.norms[p + "post"] = w[p + "post_attention_layernorm.weight"]
            if self.qk_norm:
                self.norms[p + "q"] = w[p + "self_attn.q_norm.weight"]
                self.norms[p + "k"] = w[p + "self_attn.k_norm.weight"]
            for fused, parts in FUSED.items():
                mod = "self_attn." if fused == "qkv_proj" else "mlp."
                weight = torch.cat([w[f"{p}{mod}{s}.weight"] for s in parts], 0)
                biases = [w.get(f"{p}{mod}{s}.bias") for s in parts]
                bias = torch.cat(biases, 0) if all(b is not None for b in biases) else None
                lin[p + fused] = (weight, bias)
            lin[p + "o_proj"] = (w[p + "self_attn.o_proj.weight"], w.get(p + "self_attn.o_proj.bias"))
            lin[p + "down_proj"] = (w[p + "mlp.down_proj.weight"], None)
        self.final_norm = w["norm.weight"]
        head = named.get("lm_head.weight", self.embed)
        lin["lm_head"] = (head, None)
        self._prepared = {k: _prepared(wt, b) for k, (wt, b) in lin.items()}
        self._version = version

    @property
    def version(self):
        return self._version

    # ---- forward ----------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, sequences: Sequence[Sequence[int]], starts: Sequence[int], temperature: float = 1.0,
                 topk_ids: Sequence[torch.Tensor] | None = None, supports: Sequence[Support] | None = None):
        """Per sequence k, log p(x_t | x_<t) for t in [starts[k], len): float32 1-D tensors.

        With ``topk_ids`` (per sequence a [len - start, k] id tensor) also their log-probs, and the
        entropy of each position's distribution: returns (logprobs, entropies, topk_logprobs).
        ``supports``: per sequence the kept sets of a truncated sampler over the same positions
        (``rollout.support``): every distribution is then the engine sampler's, the logits outside the set
        at -inf before the same log-softmax (``vllm/v1/sample/ops/topk_topp_sampler.py``).
        """
        if not self._prepared:
            raise RuntimeError("EngineForward: set_weights() first")
        lens = [len(s) for s in sequences]
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
        positions = torch.cat([torch.arange(n, dtype=torch.long) for n in lens])
        meta = self._attention_metadata(lens)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim

        h = torch.nn.functional.embedding(ids, self.embed)
        residual = None
        for i in range(self.config.num_hidden_layers):
            p = f"layers.{i}."
            if residual is None:
                residual = h
                h = self._norm(h, self.norms[p + "in"])
            else:
                h, residual = self._add_norm(h, residual, self.norms[p + "in"])
            qkv = self._linear(p + "qkv_proj", h)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            if self.qk_norm:  # Qwen3: per-head RMSNorm before RoPE, as vllm/model_executor/models/qwen3.py
                q = self._norm(q.reshape(-1, self.head_dim), self.norms[p + "q"]).view(q.shape)
                k = self._norm(k.reshape(-1, self.head_dim), self.norms[p + "k"]).view(k.shape)
            q, k = self._rope(positions, q, k)
            h = self._linear(p + "o_proj", self._attention(q, k, v, meta))
            h, residual = self._add_norm(h, residual, self.norms[p + "post"])
            gu = self._linear(p + "gate_up_proj", h)
            d = gu.shape[-1] // 2
            h = self._linear(p + "down_proj", torch.nn.functional.silu(gu[..., :d]) * gu[..., d:])
        h, _ = self._add_norm(h, residual, self.final_norm)

        # Only the positions asked for reach the lm_head (the engine computes logits for those rows only).
        rows = torch.cat([int(meta["qsl"][k]) - 1 + torch.arange(s, n, dtype=torch.long)
                          for k, (s, n) in enumerate(zip(starts, lens))])
        targets = torch.cat([torch.as_tensor(list(seq[s:]), dtype=torch.long) for seq, s in zip(sequences, starts)])
        counts = [n - s for s, n in zip(starts, lens)]
        tops = None if topk_ids is None else torch.cat(list(topk_ids)).long()
        keep = None if supports is None else torch.cat([s.mask(self.vocab) for s in supports])
        picked, ent, top = [], [], []
        # [rows x vocab] float32 logits a chunk at a time (a row's log_softmax does not depend on the others')
        for c in range(0, rows.numel(), HEAD_ROWS):
            sl = slice(c, c + HEAD_ROWS)
            p_c, lsm = self._head(h[rows[sl]], targets[sl], temperature, None if keep is None else keep[sl])
            picked.append(p_c)
            if tops is not None:
                ent.append(-(lsm.exp() * lsm.nan_to_num(neginf=0.0)).sum(-1))
                top.append(lsm.gather(1, tops[sl]))
        lps = list(torch.cat(picked).split(counts))
        if tops is None:
            return lps
        return lps, list(torch.cat(ent).split(counts)), list(torch.cat(top).split(counts))

    # ---- the engine's ops (bench/parity/exact_staircase.py swaps them for HF's, one piece at a time) ----
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        from vllm import ir

        return ir.ops.rms_norm(x, w, self.eps, None)

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor):
        from vllm import ir

        return ir.ops.fused_add_rms_norm.maybe_inplace(x, residual, w, self.eps, None)

    def _linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self._prepared[name](x)

    def _rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.rotary(positions, q, k)

    def _attention_metadata(self, lens: list[int]) -> dict:
        """A paged KV cache laid out as the engine's, one run of blocks per sequence."""
        from vllm import _custom_ops as ops

        qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        bs = self.block_size
        blocks = [(n + bs - 1) // bs for n in lens]
        first = [0]
        for b in blocks[:-1]:
            first.append(first[-1] + b)
        block_table = torch.zeros((len(lens), max(blocks)), dtype=torch.int32)
        for k, (f, b) in enumerate(zip(first, blocks)):
            block_table[k, :b] = torch.arange(f, f + b, dtype=torch.int32)
        slot = torch.cat([first[k] * bs + torch.arange(n, dtype=torch.long) for k, n in enumerate(lens)])
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(lens), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            seq_lens=seq_lens, dtype=self.dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1,
            isa=self.isa, enable_kv_split=self.split_kv, dynamic_causal=None, kv_cache_dtype="auto")
        kv = torch.zeros((sum(blocks), self.num_kv_heads, bs, 2 * self.head_dim), dtype=self.dtype)
        key_cache, value_cache = kv.view((sum(blocks), self.num_kv_heads, bs * 2, -1)).chunk(2, dim=2)
        return {"lens": lens, "qsl": qsl, "seq_lens": seq_lens, "block_table": block_table, "slot": slot,
                "sched": sched, "key_cache": key_cache, "value_cache": value_cache}

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: dict) -> torch.Tensor:
        from vllm import _custom_ops as ops

        out = torch.empty((q.shape[0], self.num_heads * self.head_dim), dtype=self.dtype)
        ops.cpu_attn_reshape_and_cache(k.reshape(-1, self.num_kv_heads, self.head_dim),
                                       v.reshape(-1, self.num_kv_heads, self.head_dim),
                                       meta["key_cache"], meta["value_cache"], meta["slot"], self.isa)
        ops.cpu_attention_with_kv_cache(
            query=q.reshape(-1, self.num_heads, self.head_dim), key_cache=meta["key_cache"],
            value_cache=meta["value_cache"], output=out.view(-1, self.num_heads, self.head_dim),
            query_start_loc=meta["qsl"], seq_lens=meta["seq_lens"], scale=self.scale, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=meta["block_table"], softcap=0, scheduler_metadata=meta["sched"],
            s_aux=None)
        return out

    def _head(self, h: torch.Tensor, targets: torch.Tensor, temperature: float, keep: torch.Tensor | None = None):
        """(log-probs of ``targets``, the full log-softmax) as vLLM's LogitsProcessor + Sampler compute them
        (``keep``: the kept sets of a truncated sampler, -inf outside them, as its sampler masks)."""
        logits = self._prepared["lm_head"](h)[..., : self.vocab].to(torch.float32)
        if temperature != 1.0:
            logits.div_(torch.full((logits.shape[0], 1), temperature, dtype=torch.float32))
        if keep is not None:  # a position with no set is context (an episode's reply): nothing was sampled there
            logits.masked_fill_(~(keep | ~keep.any(1, keepdim=True)), -float("inf"))
        lsm = logits.log_softmax(dim=-1, dtype=torch.float32)
        return lsm.gather(1, targets[:, None])[:, 0], lsm


def _engine_layout(model) -> dict:
    """What the engine's model decided at load, read in its process (``LLM.apply_model``)."""
    layer = model.model.layers[0].self_attn
    attn = layer.attn
    return {"rotary": layer.rotary_emb, "isa": getattr(attn, "isa", None), "scale": float(attn.impl.scale)}
