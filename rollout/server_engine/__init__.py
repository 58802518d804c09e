"""Rollouts from a separate vLLM server process (``rollout.mode: server``).

The server is started by ``parityrl serve <recipe>`` (``trainer/commands/serve.py``): its own
processes and devices, tensor parallel size >= 1. This client implements the
``rollout.base.RolloutEngine`` interface with the conventions of the colocated
``rollout.vllm_engine.VLLMEngine``, so the trainer cannot tell them apart:

- Token ids in, token ids out: vLLM's token-in/token-out route ``POST
  /inference/v1/generate`` (``vllm/entrypoints/scale_out/token_in_token_out/``, enabled
  by ``--enable-scale-out``) takes ``token_ids`` and a full ``SamplingParams``; the
  server runs with ``--skip-tokenizer-init``, so no tokenizer is involved anywhere.
- One request per sample, seed ``sample_seed(spec.seed, i)``, ``stop_token_ids`` = the
  model's EOS ids, sent concurrently so the server batches them.
- Log-probs: the server runs with ``--logprobs-mode processed_logprobs`` (checked at
  start), i.e. log softmax(logits / T) of the distribution sampled from. JSON floats
  round-trip the engine's float32 values exactly.
- Top-k: the route returns, per position, a dict-ordered list ``[sampled, top1, ...]``
  deduplicated by token id and cut to ``logprobs`` entries
  (``serving.py: _create_tokens_logprobs``; ``vllm/logprobs.py:
  append_logprobs_for_next_position``). Asking for k + 1 guarantees the true top k are
  in it whether or not the sampled token is among them; they are re-sorted by
  log-prob. The values equal the colocated engine's bit for bit; among tokens with
  exactly equal log-probs (frequent in BF16) torch.topk(k + 1) may keep another id
  than torch.topk(k) (measured: 40 of 644 positions, identical values). The route's
  ``-9999.0`` floor for ``-inf`` is mapped back to ``-inf``.
- ``score`` (the parity probe): the same route with ``prompt_logprobs`` and one sampled
  token, as ``VLLMEngine.score`` -- one prefill per sequence, no decoding. Prompt log-probs
  are log_softmax of the raw logits whatever ``--logprobs-mode`` (vLLM skips the sampling
  processors for prompt tokens), i.e. at temperature 1; each position is a dict
  ``{token id: {logprob, rank}}`` of the actual token and the top ``prompt_logprobs`` by rank.
- Every response carries the weight version it was generated with (vLLM's
  ``weight_versions`` spans); each push sets a new version, and a sample generated
  with any other version is refused (a stale or shared server). A batch is checked
  against the version current when it was launched (one-step-off async generates it
  in a thread while the trainer updates; the sync waits for it).

LoRA adapter sync (``rollout.lora_sync: adapter``, ``load_adapter``): the server keeps the
model's own weights and runs the policy's adapter beside them, as the colocated engine does
(``rollout.vllm_adapters``). Each version is written as PEFT's files on the server's own
filesystem by the worker extension (``parityrl_put_adapter`` over ``/collective_rpc``:
``rollout.vllm_plugins.server_adapters``), loaded by vLLM's ``POST /v1/load_lora_adapter``
under a name of its own -- the weight version, ``parityrl-<tag>-<n>``, set with it -- and
the previous one unloaded (``/v1/unload_lora_adapter``) and its files deleted. Every
generate and score then names it in the request's ``model`` field (the token route's
``_maybe_get_adapters``), and the answer's ``model`` must name it back, as its weight
versions must be the one set: a sample of another adapter version is refused. A server
started without LoRA support (or for a smaller rank, or other LoRA targets) is refused at
connect when the recipe asks for ``adapter``; with ``auto`` the run takes merged weights
and says why (``adapter_unavailable``; ``trainer.precision.lora_sync``).

Truncated sampling (top-k, top-p, min-p; ``return_supports``): the server's worker extension records the set of
tokens its sampler kept at every sampled position of every truncated request
(``rollout.vllm_plugins.support_capture.serve_supports``, the V1 runner of vLLM's CPU build), and the client takes
its requests' sets by id after each batch (``parityrl_take_supports`` over ``/collective_rpc``), as it takes routes.
A CUDA server runs Model Runner V2, whose own sampling masks vLLM's HTTP answers do not carry: refused at connect.

Images (a vision-language recipe, ``max_images``): ``parityrl serve`` starts the server with the tokenizer (vLLM's
multimodal processor expands each placeholder with it) and the colocated engine's image settings. Each request
sends its prompt's images as PNG ``data:`` URLs (``content_parts``) beside the ids, one placeholder per image, and
asks for the prompt it consumed (``return_token_ids``): ``Rollouts.prompt_ids`` are the expanded ids. The workers
fingerprint each new request's pixel tensors (``rollout.vllm_plugins.image_capture``, at ``Worker.execute_model``)
and the client takes them by id after each batch, so the trainer's identity check compares the server's tensors
with its own processor's, as with the colocated engine (``images.py``). Every push also empties the server's
encoder cache (``/reset_encoder_cache``). In-flight updates are refused with images.

Weight sync (``load_weights``) uses vLLM's weight-transfer lifecycle over its RL HTTP
routes (``vllm/entrypoints/rl/online/api_router.py``, enabled by
``VLLM_SERVER_DEV_MODE=1``) with the backend the server was started with:
``parityrl_file`` (``rollout.vllm_plugins.server_transfer``; CPU, same host) or vLLM's ``nccl``
(``vllm/distributed/weight_transfer/nccl_engine.py``; CUDA; written against vLLM's
source but not run by the project's tests, which are CPU-only). Both sit
behind vLLM's ``TrainerWeightTransferEngine`` interface, driven by ``HTTPWeightSyncClient``.
Updates must hold whole fused groups (``check_fused_groups``); the prefix cache is
reset after each push (``POST /reset_prefix_cache``). A push may come in chunks of whole
layers (``load_weight_chunks``), each its own transfer round, under one weight version.

Failures: startup waits for ``GET /health`` up to ``timeout_s`` and then raises
``EngineUnavailable`` naming the URL; so does any connection failure or timeout later,
naming the action (generate, weight push step, ...). An HTTP error answer raises
``ServerEngineError`` with the status and the server's message. An answer whose body is not
JSON at all (cut short: a server or proxy that died mid-answer; or not a vLLM server) raises
``MalformedAnswer``, an ``EngineUnavailable`` too: nothing of it is usable and the way back is
the same, so the run stops with the engine's exit status (4), naming the URL and the route. At startup every
refusal (other settings, an answer of another shape) is ``UnusableServer``, an ``EngineUnavailable`` as well.

Files, one role each: ``engine.py`` the client (``ServerEngine``: start-up checks, generate, score, weight and
adapter pushes); ``answers.py`` reading the token route's answers (log-probs, top-k, weight version, adapter);
``captures.py`` routes and kept sets taken from the server's workers; ``images.py`` a prompt's images sent and
what the workers say each request consumed; ``weight_transfer.py`` vLLM's weight-transfer
lifecycle over HTTP and the NCCL hand-over; ``adapters.py`` whether the server can serve the policy's LoRA adapter,
and unloading old versions; ``http_channel.py`` JSON over HTTP with errors naming the server; ``health.py`` the
start-up wait; ``errors.py`` the errors; ``keys.py`` the recipe keys the errors name.
"""
from __future__ import annotations

from rollout.server_engine.captures import SERVER_ROUTES_ON_CUDA, SERVER_SUPPORTS_ON_CUDA
from rollout.server_engine.engine import ServerEngine
from rollout.server_engine.errors import MalformedAnswer, ServerEngineError, UnusableServer
from rollout.server_engine.health import wait_for_health
from rollout.server_engine.http_channel import parse_server_url
from rollout.server_engine.keys import ROLLOUT_SERVER, ServerKeys
from rollout.server_engine.weight_transfer import HTTPWeightSyncClient, nccl_ready

__all__ = [
    "HTTPWeightSyncClient",
    "MalformedAnswer",
    "ROLLOUT_SERVER",
    "SERVER_ROUTES_ON_CUDA",
    "SERVER_SUPPORTS_ON_CUDA",
    "ServerEngine",
    "ServerEngineError",
    "ServerKeys",
    "UnusableServer",
    "nccl_ready",
    "parse_server_url",
    "wait_for_health",
]
