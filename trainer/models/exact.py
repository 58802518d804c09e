"""Exact mode (``precision.recipe: exact``): the trainer's log-probs are the engine's, bit for bit.

Values and gradients take two routes, as in the vLLM + TorchTitan bitwise RL work (vLLM blog,
2025-11-10: the engine's batch-invariant forward kernels on both sides, simple backward passes):

- the **values** the loss and the parity metrics read (log-probs of the sampled tokens, entropy,
  top-k log-probs) come from ``rollout.engine_forward.EngineForward``: the engine's own CPU kernels,
  in its op order, on the weights the engine holds — base weights in the engine dtype and every
  LoRA module merged with the sync's arithmetic (``rollout.weight_export.effective_state``);
- the **gradients** flow through the trainer's usual HF + PEFT forward at the same weights
  (``straight_through``): its log-probs differ from the values by rounding only (float32 ~1e-6,
  bf16 ~1e-2), so the gradient is that of the same function up to rounding, as a simple
  backward pass is in the reference work.

The merged weights are rebuilt when a trainable parameter changed (tensor version counters),
i.e. once per optimizer step. Cost: one more no-grad forward per micro-batch (bench/RESULTS.md
"Exact mode" has the measured step-time ratio).

Scope (refused at load and setup otherwise, by the recipe's record in ``trainer/precision/exact.py``):
the colocated vLLM engine on CPU, one process, Llama-family decoders
(``rollout.engine_forward.SUPPORTED_MODEL_TYPES``), float32 or bfloat16. CUDA: vLLM's route there is its batch-invariant mode (``VLLM_BATCH_INVARIANT=1``,
Triton kernels for mm/log_softmax/RMSNorm); the trainer would have to call those kernels and
the GPU attention backend in the same way this module calls the CPU ones. That path is not
written: exact mode refuses CUDA with that reason rather than ship an unrun copy.
"""
from __future__ import annotations

import torch

from rollout.engine_forward import EngineForward
from rollout.support import Support
from rollout.weight_export import effective_state
from trainer.models.batch import TokenBatch


class _Value(torch.autograd.Function):
    """Forward: ``value`` exactly. Backward: the gradient goes to ``differentiable``."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, differentiable: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad


def straight_through(value: torch.Tensor, differentiable: torch.Tensor) -> torch.Tensor:
    """``value``'s numbers with ``differentiable``'s gradient (shapes must match)."""
    if value.shape != differentiable.shape:
        raise ValueError(f"straight_through: value {tuple(value.shape)} vs differentiable "
                         f"{tuple(differentiable.shape)}")
    if not differentiable.requires_grad:
        return value
    return _Value.apply(value.to(differentiable.dtype), differentiable)


class ExactLogprobs:
    """The engine's numbers for a micro-batch's completion tokens, with the trainer's gradients."""

    def __init__(self, engine, model, dtype: torch.dtype) -> None:
        self.forward = EngineForward(engine, _hf_config(model))
        self.model = model
        self.dtype = dtype
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        self._key = None
        self._engine = engine
        self._base = None  # the reference policy's forward (adapter off), built on first use

    def _refresh(self) -> None:
        # In-place updates (the optimizer's) bump a tensor's version counter: a cheap "has it changed".
        key = tuple(p._version for p in self._trainable)
        if key != self._key:
            self.forward.set_weights(effective_state(self.model, dtype=self.dtype))
            self._key = key

    def reference(self, micro: TokenBatch, lp: torch.Tensor, temperature: float) -> torch.Tensor:
        """The base model's (adapter off) log-probs of the micro-batch in the engine's numerics: the reference
        policy of KL-regularised losses, so that log pi - log pi_ref compares like with like. No gradient."""
        if self._base is None:  # frozen base weights: built once, held beside the policy's
            self._base = EngineForward(self._engine, _hf_config(self.model))
            with self.model.disable_adapter():
                self._base.set_weights(effective_state(self.model, dtype=self.dtype))
        seqs, starts, counts = sequences_of(micro)
        return _pad(self._base.logprobs(seqs, starts, temperature, supports=_support_rows(micro, counts)), lp)

    def __call__(self, micro: TokenBatch, lp: torch.Tensor, ent: torch.Tensor | None, top: torch.Tensor | None,
                 temperature: float):
        """(lp, ent, top) with the engine's values; ``lp`` and ``ent`` keep their gradients."""
        self._refresh()
        seqs, starts, counts = sequences_of(micro)
        out = self.forward.logprobs(seqs, starts, temperature,
                                    topk_ids=None if top is None and ent is None else _topk_rows(micro, counts),
                                    supports=_support_rows(micro, counts))
        if ent is None and top is None:
            lps, ents, tops = out, None, None
        else:
            lps, ents, tops = out
        lp_x = _pad(lps, lp)
        lp = straight_through(lp_x, lp)
        if ent is not None:
            ent = straight_through(_pad(ents, ent), ent)
        if top is not None:
            top = _pad(tops, top)
        return lp, ent, top


def sequences_of(micro: TokenBatch) -> tuple[list[list[int]], list[int], list[int]]:
    """Per row: its real tokens (prompt + completion, an episode's replies included), where the completion starts,
    its length."""
    seqs, starts, counts = [], [], []
    p = micro.prompt_len
    for i in range(len(micro)):
        am = micro.attention_mask[i].bool()
        prompt = micro.input_ids[i, :p][am[:p]].tolist()
        # the completion's real columns: an episode's replies are inside it (mask 0) and are read all the same
        n = int(am[p:].sum().item())
        seqs.append(prompt + micro.input_ids[i, p:p + n].tolist())
        starts.append(len(prompt))
        counts.append(n)
    return seqs, starts, counts


def _support_rows(micro: TokenBatch, counts: list[int]):
    """Each row's kept sets over its ``counts`` completion positions (a truncated sampler's), or None."""
    if micro.support is None:
        return None
    return [Support.concat([s.positions(0, min(n, len(s))), Support.empty(max(0, n - len(s)))])
            for s, n in zip(micro.support, counts)]


def _topk_rows(micro: TokenBatch, counts: list[int]) -> list[torch.Tensor]:
    if micro.topk_ids is None:
        return [torch.zeros((n, 0), dtype=torch.long) for n in counts]
    return [micro.topk_ids[i, :n] for i, n in enumerate(counts)]


def _pad(rows: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(like.shape, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def _hf_config(model):
    get_base = getattr(model, "get_base_model", None)
    return (get_base() if get_base is not None else model).config
