"""Chunked fused lm_head + log-softmax: per-token log-probs (and entropy) without [N, V] logits.

The trainer needs, for every sampled token, ``log softmax((h @ W.T + b) / T)[target]`` and
often the entropy of the same distribution. Materialising the [N, V] logits costs
N * V * (2 + 4 + 4) bytes in bf16 (logits, their float32 copy, the saved log-softmax),
e.g. 1.3 GB for 4096 tokens x 32k vocab, several GB for 128k vocabularies. This module
computes the same numbers in tiles:

* forward: row chunks of ``chunk`` tokens against the full vocabulary; only O(N)
  statistics survive the chunk (log-sum-exp, entropy);
* backward: tiles of ``chunk`` rows x ``vocab_block`` vocabulary entries; the logits
  are recomputed from ``hidden`` and ``weight`` and the softmax is rebuilt from the
  saved log-sum-exp, so each tile is independent. The weight gradient is accumulated
  in float32 for one vocabulary block at a time (``vocab_block x H`` floats) and cast
  to the weight's dtype when the block is done (or, when all rows fit one tile, written
  by a single matmul per block, with no accumulation to do).

Matmuls run in the input dtype (bf16 stays bf16: that is where AVX512-BF16/AMX units
and the GPU's tensor cores are); only the logits tile is upcast, to float32 (float64
for float64 inputs, which gradcheck uses), for log-sum-exp, softmax and entropy.

Cost, in units of one N x H x V matmul: the naive version does 1 forward and 2 backward
(1 backward with a frozen lm_head). Keeping only O(N) state costs one recomputation:
forward 1, backward 3 (recompute, d hidden, d weight) -- 4/3 of the naive matmul work
when the lm_head is trained, partly paid back by never touching [N, V] fresh memory.

Frozen lm_head (LoRA, this project's default): when only ``hidden`` needs a gradient
and no entropy is asked for, the forward also computes G = d logprob / d hidden per row
(one extra matmul while the softmax tile is still at hand; G is [N, H] float32) and the
backward is G scaled by the upstream gradient -- 2 matmuls in total, like the naive
version. This is exact for any upstream gradient because row i of d(hidden) depends only
on row i of the upstream gradient (unlike the weight gradient, which Liger-Kernel
precomputes under a scalar-loss assumption; see linkedin/Liger-Kernel issue #1298).
Callers that only want values should run under ``torch.no_grad()`` so that this extra
matmul is skipped.

Logit transform: some architectures post-process the lm_head output before the softmax
(Gemma2/3's final softcap ``cap * tanh(u / cap)``, Cohere's ``logit_scale``, Granite's
``1 / logits_scaling``). With u = h W^T + b the logits are
``z = scale * softcap(u) / T`` -- softcap first, then scale, the order of vLLM's
``LogitsProcessor._get_logits`` (vllm/model_executor/layers/logits_processor.py); no
architecture uses both. The caller passes the two numbers (``logit_softcap``,
``logit_scale``); this module does not know about model configs. The chain rule adds
dz/du = (scale / T) * (1 - tanh^2(u / cap)), recomputed with the logits in every tile;
with a softcap each pass holds one more float32 tile (the tanh derivative).

Formulas (z = (h W^T + b) / T, p = softmax(z), lse = log sum exp z; with a transform
read d/du = dz/du * d/dz):
  logprob_i   = z_{i,t_i} - lse_i
  entropy_i   = -sum_j p_ij log p_ij = lse_i - sum_j p_ij z_ij
  d logprob_i / d z_ij = 1[j = t_i] - p_ij
  d entropy_i / d z_ij = -p_ij (log p_ij + entropy_i)
  d / d logits = (d / d z) / T

References: Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models"
(arXiv:2411.09009) for the recompute-in-tiles idea; Liger-Kernel's
fused_linear_cross_entropy for the chunked CPU/GPU layout.

Entropy as a by-product: ``entropy_grad=False`` returns the entropy computed in the same
forward pass but detached, so a caller that only logs it keeps the log-prob-only backward
(and, with a frozen lm_head, the precomputed-G shortcut above); with ``entropy_grad=True``
the backward carries the entropy term and recomputes every tile.

Truncated sampling (``support``): with top-k / top-p / min-p the engine samples from the softmax over the set S of
tokens it kept, and reports log-probs normalised over S. Given the engine's S per row (a CSR pair), every
normaliser here is over S instead of the vocabulary: ``lse_S = log sum_{j in S} exp z_j``, ``logprob = z_t - lse_S``,
the entropy is the truncated distribution's, and the gradients replace p by p_S (0 outside S):
``d logprob / d z_j = 1[j = t] - p_S,j``. The logits tile is the one computed anyway; S enters as a boolean tile
of the same shape built from the CSR, so no tensor grows with N x V. The log of the trainer's mass inside S,
``lse_S - lse``, comes from the same tile (``return_kept_logmass``). The support path runs on the chunked torch
implementation on every device (the Triton kernels do not take S).

Backends: ``_backend_for`` (``dispatch.py``) picks the implementation from the inputs' device, in one place:
CUDA tensors in float32/bf16/fp16 go to the Triton kernels of ``parity.logprobs_triton``
(when triton imports, and once they have matched this path on a small problem on that device
and dtype: ``_triton_ready``, ``self_check.py``, checked in a child process so that a kernel's fault cannot poison
this process's CUDA context: ``self_check_process.py``; otherwise a warning says why and this path runs), everything
else to the chunked torch implementation (``torch_path.py``), which is also the reference the Triton kernels
are tested against. Both take the same
``apply()`` arguments and keep O(N) state between forward and backward. On CUDA the torch
path sizes its tiles from free GPU memory (``_memory_budget``), not the CPU budget.

Files, one role each: ``fused.py`` the entry points (``fused_logprobs``, ``fused_gather_logprobs``);
``reference.py`` the full-logits reference (``naive_logprobs``); ``inputs.py`` argument checks and the logit
transform; ``sizing.py`` tile sizes from the memory budget; ``oom_retry.py`` halving the tile on out of memory;
``supports.py`` a truncated sampler's kept sets; ``tiles.py`` one tile's forward and backward;
``torch_path.py`` the passes over the tiles and their autograd Function; ``dispatch.py`` which backend runs;
``self_check.py`` the Triton kernels' check against the torch path; ``self_check_process.py`` that check in a
child process; ``optional_triton.py`` the Triton module, or None without triton.
"""

from __future__ import annotations

from parity.logprobs.fused import fused_gather_logprobs, fused_logprobs
from parity.logprobs.inputs import IGNORE_INDEX
from parity.logprobs.reference import naive_logprobs
from parity.logprobs.sizing import DEFAULT_MEMORY_BUDGET_BYTES, MIN_CHUNK_ROWS

__all__ = [
    "IGNORE_INDEX",
    "DEFAULT_MEMORY_BUDGET_BYTES",
    "MIN_CHUNK_ROWS",
    "fused_logprobs",
    "fused_gather_logprobs",
    "naive_logprobs",
]
