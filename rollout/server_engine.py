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
"""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import math
import secrets
import socket
import time
import urllib.parse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from rollout.adapters import LoraAdapter
from rollout.base import EngineUnavailable
from rollout.model_files import checkpoint_shapes, eos_token_ids
from rollout.prompt_logprobs import read_prompt_logprobs
from rollout.requests import sample_seed, validate_request, validate_score_request
from rollout.routes import NO_ROUTE, decode_routes
from rollout.support import Support, decode_supports
from rollout.types import Rollouts, SamplingSpec, Scored
from rollout.weight_export import payload_bytes
from rollout.weight_updates import DEFAULT_PACKED_MODULES, check_update, engine_named_tensors


@dataclass(frozen=True)
class ServerKeys:
    """The recipe keys a server client's errors name, and how its server is started: the student's server
    (``rollout.mode: server``) by default; the teacher's name ``teacher.*`` (trainer/teacher/teacher.py)."""

    url: str = "rollout.server_url"
    timeout: str = "rollout.server_timeout_s"
    connect_timeout: str = "rollout.server_connect_timeout_s"
    start: str = "`parityrl serve <recipe>`"

    def restart_hint(self) -> str:
        return (f"the server process may have died or never started; start it with {self.start} (listening on "
                f"{self.url}) and continue the run with `parityrl train <recipe> --resume`")


ROLLOUT_SERVER = ServerKeys()
_ENGINE_DEAD = "EngineCore encountered an issue"  # vLLM EngineDeadError's message, in its HTTP 500 body
_CLAMPED = -9999.0  # the route's floor for -inf / NaN log-probs (serving.py: _clamp_logprob)
# Why a CUDA server cannot return routes, and what to do (said by the client and by `parityrl serve`).
SERVER_ROUTES_ON_CUDA = (
    "on CUDA vLLM runs Model Runner V2, which lacks the V1-runner internals the project's capture hooks "
    "(rollout/vllm_plugins/route_capture.py), and vLLM's own routes (enable_return_routed_experts) are not in "
    "its HTTP answers; train with rollout.mode: colocate (routes from vLLM's own capture) or set "
    "parity.routing_replay: off")


def _check_version(choice: dict, version: str, bad) -> None:
    stale = sorted({v.get("version") for v in choice.get("weight_versions") or []} - {version})
    if stale:
        raise bad(f"generated with weight version(s) {stale}, but this trainer's last push is {version!r} "
                  "(is another trainer pushing weights to the same server?)")


def _check_adapter(resp: dict, adapter: str | None, bad) -> None:
    """The answer names the adapter the request asked for (the token route answers ``model`` = the adapter's
    name, ``serving.py: serve_tokens``); without an adapter, the base model."""
    if adapter is not None and resp.get("model") != adapter:
        raise bad(f"generated with {resp.get('model')!r}, but this trainer serves the adapter {adapter!r} "
                  "(is another trainer loading adapters on the same server?)")


class ServerEngineError(RuntimeError):
    """The vLLM server answered, but with an error or an unusable response. One that cannot be reached
    (not started, died, or not answering in time) raises ``rollout.base.EngineUnavailable`` instead."""


# Why a CUDA server cannot return the kept sets of truncated sampling, and what to do.
SERVER_SUPPORTS_ON_CUDA = (
    "the sets of tokens top-p / top-k / min-p kept come from a server on CPU only: on CUDA vLLM runs Model Runner V2, "
    "which the project's capture (rollout/vllm_plugins/support_capture.py) cannot hook, and vLLM's own sampling "
    "masks (return_sampling_mask) are not in its HTTP answers; train with rollout.mode: colocate (the masks from "
    "vLLM itself) or without truncation (rollout.top_p 1, top_k 0, min_p 0)")


class MalformedAnswer(ServerEngineError, EngineUnavailable):
    """The server answered with a body that is not JSON (truncated, or not from a vLLM server)."""


class UnusableServer(ServerEngineError, EngineUnavailable):
    """At startup the server answered, but it is not one this run can use: not started by `parityrl serve`, other
    settings (dtype, context, model), or an answer of another shape. The run cannot start, as with no server."""


def _json(url: str, r, action: str, method: str, path: str, keys: ServerKeys = ROLLOUT_SERVER) -> Any:
    """The body of ``r`` parsed, or ``MalformedAnswer`` naming the server, the route and what came."""
    try:
        return r.json()
    except ValueError as e:  # json.JSONDecodeError, or bytes that are not UTF-8
        body = r.content
        raise MalformedAnswer(
            f"vLLM server at {url} answered {method} {path} ({action}) with HTTP {r.status_code} but a body that is "
            f"not JSON ({len(body)} bytes, {type(e).__name__}: {e}; it ends {body[-60:]!r}): cut short, or not a vLLM "
            f"server; {keys.restart_hint()}") from None


def parse_server_url(url: str) -> tuple[str, int]:
    """``http://host:port`` -> (host, port); anything else is refused with the expected form."""
    parts = urllib.parse.urlsplit(url or "")
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(f"rollout.server_url = {url!r}: expected http://HOST:PORT, e.g. http://127.0.0.1:8000 "
                         "(no path; the vLLM routes are fixed)")
    return parts.hostname, port


NCCL_DEVICE = "cuda"


def nccl_ready(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The chunk on the trainer's GPU, with every kernel that wrote it finished.

    vLLM's packed NCCL producer packs the tensors on streams of its own
    (``weight_transfer/packed_tensor.py: packed_nccl_broadcast_producer``, ``with torch.cuda.stream(...)``), which
    do not wait for this one; the merged weights (and the host-to-device copy here) are queued on the current
    stream just before, so without this wait the broadcast could read them half written."""
    named = [(n, t.to(NCCL_DEVICE, non_blocking=True)) for n, t in named]
    torch.cuda.current_stream().synchronize()
    return named


def _unclamp(x: float) -> float:
    return -math.inf if x == _CLAMPED else float(x)


class _Http:
    """JSON over HTTP to one server, every failure turned into an error naming URL and action."""

    def __init__(self, url: str, timeout_s: float, keys: ServerKeys = ROLLOUT_SERVER) -> None:
        import httpx

        self.url, self.timeout_s, self.keys = url.rstrip("/"), float(timeout_s), keys
        self._client = httpx.Client(base_url=self.url, timeout=self.timeout_s)

    def unavailable(self, action: str, method: str, path: str, e: BaseException) -> EngineUnavailable:
        import httpx

        what = (f"did not answer within {self.timeout_s:g} s ({self.keys.timeout})"
                if isinstance(e, httpx.TimeoutException)
                else f"is unreachable ({type(e).__name__}: {str(e) or 'connection closed by the server'})")
        return EngineUnavailable(f"vLLM server at {self.url} {what} during {action} ({method} {path}); "
                                 f"{self.keys.restart_hint()}")

    def error(self, action: str, method: str, path: str, status: int, text: str) -> ServerEngineError | EngineUnavailable:
        if status >= 500 and _ENGINE_DEAD in text:
            # The API server still answers but its engine core is gone (killed, OOM): vLLM's EngineDeadError,
            # "Unrecoverable" (vllm/v1/engine/exceptions.py). As unusable as a dead server: the run stops with the
            # same status and the same way back (seen when a kill reached the engine core before the front end).
            return EngineUnavailable(f"vLLM server at {self.url}: its engine core died (HTTP {status} during "
                                     f"{action}, {method} {path}: vLLM's EngineDeadError); {self.keys.restart_hint()}")
        if status == 404 and "does not exist" in text:  # the token route's answer for an unknown `model`
            text += (" -- the LoRA adapter this trainer asked for is not loaded on the server: another trainer "
                     "replaced it, a data-parallel rank missed rank 0's push, or the server restarted")
        elif status == 404 and path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            text += (" -- route missing: the server must run with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, which "
                     "`parityrl serve` sets for a recipe that serves its adapter")
        elif status == 404:
            text += (" -- route missing: the server must run with VLLM_SERVER_DEV_MODE=1 and --enable-scale-out, "
                     "which `parityrl serve` sets")
        return ServerEngineError(f"vLLM server at {self.url}: {method} {path} ({action}) failed with HTTP {status}: "
                                 f"{text[:800]}")

    def call(self, method: str, path: str, action: str, *, json: Any = None, timeout: float | None = None) -> Any:
        import httpx

        try:
            r = self._client.request(method, path, json=json, timeout=timeout or self.timeout_s)
        except httpx.TransportError as e:
            raise self.unavailable(action, method, path, e) from None
        if r.status_code >= 400:
            raise self.error(action, method, path, r.status_code, r.text)
        if not (r.content and "json" in r.headers.get("content-type", "")):
            return None
        return _json(self.url, r, action, method, path, self.keys)

    def close(self) -> None:
        self._client.close()


class HTTPWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol (``weight_transfer/base.py``) over the RL routes.

    The same four calls as vLLM's ``HTTPVLLMWeightSyncClient`` (``clients.py``), with
    errors that name the server and the step of the push that failed.
    """

    def __init__(self, http: _Http) -> None:
        self.http = http

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.http.call("POST", "/init_weight_transfer_engine", "weight-transfer init", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.http.call("POST", "/start_weight_update", "weight push (start_weight_update)")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.http.call("POST", "/update_weights", "weight push (update_weights)", json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self.http.call("POST", "/finish_weight_update", "weight push (finish_weight_update)", json=body)

    def shutdown_weight_transfer_engine(self) -> None:
        self.http.call("POST", "/shutdown_weight_transfer_engine", "weight-transfer shutdown", timeout=10.0)


def wait_for_health(url: str, timeout_s: float, *, poll_s: float = 0.5, connect_timeout_s: float | None = None,
                    keys: ServerKeys = ROLLOUT_SERVER) -> float:
    """Poll ``GET {url}/health`` until it answers 200; seconds waited. EngineUnavailable after ``timeout_s``, or
    after ``connect_timeout_s`` if no attempt has connected by then (nothing listens: no point waiting for a
    loading server; a loading vLLM server already accepts connections). The errors name ``keys``' recipe keys."""
    import httpx

    t0 = time.monotonic()
    deadline = t0 + float(timeout_s)
    last = "no answer"
    connected = False
    while True:
        left = deadline - time.monotonic()
        if connect_timeout_s is not None and not connected and time.monotonic() - t0 >= connect_timeout_s:
            raise EngineUnavailable(
                f"nothing is listening at {url}: no connection accepted within {connect_timeout_s:g} s "
                f"({keys.connect_timeout}; last attempt: {last}). Start the server with {keys.start} (listening on "
                f"{keys.url}), or check the URL")
        try:
            r = httpx.get(f"{url.rstrip('/')}/health", timeout=max(0.5, min(5.0, left)))
            connected = True
            if r.status_code == 200:
                return time.monotonic() - t0
            last = f"HTTP {r.status_code}" + (" (engine dead)" if r.status_code == 503 else "")
        except httpx.TransportError as e:
            last = f"{type(e).__name__}: {e}"
            connected = connected or not isinstance(e, httpx.ConnectError)  # e.g. a read timeout: it accepted
        if time.monotonic() + poll_s > deadline:
            raise EngineUnavailable(
                f"vLLM server at {url} did not become healthy within {timeout_s:g} s ({keys.timeout}); "
                f"last attempt: {last}. Start it with {keys.start} (listening on {keys.url}), "
                f"or raise {keys.timeout} if it is still loading")
        time.sleep(poll_s)


def _local_address_towards(host: str) -> str:
    """The address of this machine that ``host`` can reach (no packet is sent: UDP connect)."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _run_coroutine(coro):
    """asyncio.run, also from a thread when the caller already runs an event loop (notebooks)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


class ServerEngine:
    """A vLLM server behind the ``rollout.base.RolloutEngine`` interface (see the module docstring).

    url: ``http://HOST:PORT`` of ``parityrl serve`` (rollout.server_url).
    model_dir: the trainer's model directory: EOS ids and parameter shapes come from it,
        and the server must serve the same model.
    timeout_s: start-up health wait and the limit for every request.
    dtype: must equal the server's dtype.
    max_model_len: the trainer's need (prompt + completion tokens); the server's must be >= it.
    eos_ids: stop tokens; default the model dir's generation_config / config EOS ids.
    transfer_root: where the ``parityrl_file`` backend writes updates (default /dev/shm).
    max_concurrency: requests in flight at once.
    pushes_weights: False for the data-parallel ranks other than 0 when several trainer
        processes share one server: rank 0 alone owns the weight transfer (one NCCL group
        with the server, one push per step); the others generate from the server and, at
        each sync, only advance to the version rank 0 sets (``follow_push``).
    version_tag: the weight-version tag; the same on every trainer rank sharing the server
        (rank 0 draws it, the loop broadcasts it), a fresh random one by default.
    return_routes: an MoE model's routes with every answer (``Rollouts.routes``, ``Scored.routes``), read from the
        server's workers after each batch (``parityrl_take_routes`` over ``/collective_rpc``); the server must run
        without prefix caching (``parityrl serve`` starts it so for a recipe that replays or measures routes).
    adapter_rank: the rank of the policy's LoRA adapter when the run serves it (``rollout.lora_sync`` resolved to
        ``adapter``), None: merged weights only. The server must then run vLLM's LoRA for that rank on
        ``adapter_targets`` (the policy's LoRA leaf names), with its runtime adapter routes; if it does,
        ``adapter_dtype`` is the dtype its LoRA runs in, else None and ``adapter_unavailable`` says why.
    adapter_required: the recipe asked for ``adapter`` explicitly: a server that cannot serve it is refused here.
    return_supports: with truncated sampling, the set of tokens the server kept at every sampled position
        (``Rollouts.support``), read from its workers after each batch (``parityrl_take_supports``); a server on CUDA
        is refused (see the module docstring).
    keys: the recipe keys its errors name (``ServerKeys``: the student's server's by default).
    """

    # A push may come as chunks of whole layers, all under one weight version (load_weight_chunks).
    streams_weights = True
    # The server runs vLLM in BF16/FP16 (the recipe check refuses FP8 recipes in server mode).
    fp8_block_weights = False

    def __init__(self, url: str, *, model_dir: str | Path, timeout_s: float = 300.0, dtype: str = "bfloat16",
                 max_model_len: int | None = None, eos_ids: Sequence[int] | None = None,
                 transfer_root: str | Path | None = None, max_concurrency: int = 256, pushes_weights: bool = True,
                 version_tag: str | None = None, connect_timeout_s: float | None = None,
                 return_routes: bool = False, adapter_rank: int | None = None,
                 adapter_targets: Sequence[str] | None = None, adapter_required: bool = False,
                 return_supports: bool = False, keys: ServerKeys = ROLLOUT_SERVER) -> None:
        self.host, self.port = parse_server_url(url)
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"{keys.timeout} = {timeout_s!r}: expected a number of seconds > 0")
        if not (isinstance(max_concurrency, int) and max_concurrency >= 1):
            raise ValueError(f"max_concurrency = {max_concurrency!r}: expected an integer >= 1")
        self.url = url.rstrip("/")
        self.model = str(model_dir)
        self.timeout_s = float(timeout_s)
        self.torch_dtype = getattr(torch, dtype, None)
        if not isinstance(self.torch_dtype, torch.dtype):
            raise ValueError(f"dtype = {dtype!r}: expected a torch dtype name such as 'bfloat16'")
        self.eos_ids = [int(e) for e in (eos_ids if eos_ids is not None else eos_token_ids(self.model))]
        self.max_concurrency = max_concurrency
        self._shapes = checkpoint_shapes(self.model)
        self._http: _Http | None = None
        self._transfer = None
        self.last_push: dict[str, float] = {}
        self.pushes_weights = bool(pushes_weights)
        self.return_routes = bool(return_routes)
        self.route_shape = None
        self.return_supports = bool(return_supports)
        self.adapter_dtype: torch.dtype | None = None  # None: merged weights only (RolloutEngine.adapter_dtype)
        self.adapter_unavailable: str | None = None  # why not, when an adapter was asked for
        self._lora: dict[str, Any] | None = None  # the server's LoRA settings (None: started without LoRA)
        self._adapter: str | None = None  # the adapter every request names (its version's name), None: the base
        self._loaded_adapters = False  # this client loaded adapters on the server (close() unloads them)

        self.startup_wait_s = wait_for_health(self.url, self.timeout_s, connect_timeout_s=connect_timeout_s, keys=keys)
        self._http = _Http(self.url, self.timeout_s, keys)
        try:
            info = self._server_info()
            try:
                self._check_server(info, dtype, max_model_len)
                self.max_model_len = int(info["max_model_len"])
                self.max_logprobs = int(info["max_logprobs"])
                self.backend = info["weight_transfer_backend"]
                self.tensor_parallel_size = int(info["tensor_parallel_size"])
                self.packed_modules = {k: list(v)
                                       for k, v in (info["packed_modules"] or DEFAULT_PACKED_MODULES).items()}
                self._lora = info["lora"]
                if adapter_rank is not None:
                    self._adapter_support(adapter_rank, adapter_targets, adapter_required)
            except (KeyError, TypeError, ValueError, AttributeError) as e:  # an answer of another shape
                raise UnusableServer(
                    f"vLLM server at {self.url}: its parityrl_server_info answer is not what this parityrl reads "
                    f"({type(e).__name__}: {e}; it answered {info!r:.300}); restart it with `parityrl serve <recipe>` "
                    "from the same parityrl as the trainer") from None
            if self.return_routes:
                self.route_shape = self._start_routes(info)
            if self.return_supports:
                self._start_supports(info)
            # A version of our own: responses generated with anything else are refused.
            self._version_tag, self._version_n = version_tag or secrets.token_hex(4), 0
            if self.pushes_weights:
                self._start_transfer(transfer_root)
                self._set_version()
        except ServerEngineError as e:
            self.close()
            if isinstance(e, EngineUnavailable):
                raise
            raise UnusableServer(str(e)) from None  # any refusal at startup: the run cannot start with this server
        except BaseException:
            self.close()
            raise

    # ---- start-up ---------------------------------------------------------------------------
    def _server_info(self) -> dict[str, Any]:
        try:
            out = self.http.call("POST", "/collective_rpc", "server check",
                                 json={"method": "parityrl_server_info"})
        except MalformedAnswer:
            raise
        except ServerEngineError as e:
            raise ServerEngineError(f"{e}\n-> the server at {self.url} was not started by `parityrl serve` (it needs "
                                    "--worker-extension-cls rollout.vllm_plugins.server_transfer.ParityrlWorkerExtension)") from None
        results = out.get("results") if isinstance(out, dict) else None
        if not isinstance(results, list) or not results or not isinstance(results[0], dict):
            raise ServerEngineError(f"vLLM server at {self.url}: parityrl_server_info returned {out!r:.300}")
        return results[0]

    def _adapter_support(self, rank: int, targets: Sequence[str] | None, required: bool) -> None:
        """``adapter_dtype`` from the server's LoRA settings, or ``adapter_unavailable`` (a ServerEngineError for
        an explicit ``rollout.lora_sync: adapter``)."""
        lora, where = self._lora, f"the vLLM server at {self.url}"
        targets = sorted(targets or [])
        why = None
        if lora is None:
            why = f"{where} was started without LoRA support (vLLM's --enable-lora)"
        elif not lora["runtime_updating"]:
            why = (f"{where} runs without VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, so it cannot load a new adapter "
                   "version (vLLM's /v1/load_lora_adapter)")
        elif int(lora["max_lora_rank"]) < rank:
            why = f"{where} serves LoRA adapters of rank <= {lora['max_lora_rank']}, the recipe's model.lora.r is {rank}"
        elif lora["target_modules"] is None:
            # vLLM's LoRA logits wrapper then breaks prompt log-probs (rollout.vllm_adapters.lora_options)
            why = f"{where} runs LoRA on every supported layer, the output layer included (no --lora-target-modules)"
        else:
            missing = [t for t in targets if not self._lora_covers(t, lora["target_modules"])]
            if missing:
                why = (f"{where} runs LoRA on {lora['target_modules']}, not on the recipe's "
                       f"model.lora.target_modules {missing}")
        if why is None:
            self.max_lora_rank = int(lora["max_lora_rank"])
            self.adapter_dtype = getattr(torch, lora["dtype"])
            return
        if required:
            raise ServerEngineError(f"rollout.lora_sync = 'adapter': {why}; expected a server started for this "
                                    "recipe: restart it with `parityrl serve <recipe>` (it starts vLLM with LoRA for "
                                    "a recipe that serves its adapter), or set rollout.lora_sync to 'auto' or "
                                    "'merged' to train with merged weights")
        self.adapter_unavailable = f"{why}; `parityrl serve <recipe>` starts it to serve the adapter"

    def _lora_covers(self, target: str, served: Sequence[str]) -> bool:
        """vLLM's rule (``vllm/lora/utils.py: is_in_target_modules``): a leaf name, or its fused parent's."""
        return target in served or any(target in children and parent in served
                                       for parent, children in self.packed_modules.items())

    def _start_routes(self, info: dict[str, Any]) -> dict[str, int]:
        """Hook the server's MoE routers (``parityrl_install_route_capture``): the routes' shape."""
        if info.get("device", "cpu") != "cpu":
            raise ServerEngineError(f"vLLM server at {self.url} runs on {info.get('device')!r}: routes "
                                    f"(parity.routing_replay on or measure) come from a server on CPU only; "
                                    f"{SERVER_ROUTES_ON_CUDA}")
        if info.get("prefix_caching") is not False:
            raise ServerEngineError(f"vLLM server at {self.url}: prefix caching is {info.get('prefix_caching')!r}; "
                                    "routing replay needs it off (a cached token is never routed): restart it with "
                                    "`parityrl serve <recipe>` for a recipe whose parity.routing_replay is on or "
                                    "measure")
        out = self.http.call("POST", "/collective_rpc", "route capture",
                             json={"method": "parityrl_install_route_capture"})
        results = out.get("results") if isinstance(out, dict) else None
        if not isinstance(results, list) or not results or not isinstance(results[0], dict):
            raise ServerEngineError(f"vLLM server at {self.url}: parityrl_install_route_capture returned {out!r:.300}")
        return results[0]

    def _start_supports(self, info: dict[str, Any]) -> None:
        """Have the server's workers record the kept sets of truncated requests (``parityrl_serve_supports``)."""
        if info.get("device") != "cpu":
            raise ServerEngineError(f"vLLM server at {self.url} runs on {info.get('device')!r}: {SERVER_SUPPORTS_ON_CUDA}")
        out = self.http.call("POST", "/collective_rpc", "sampling supports",
                             # the weight-pushing rank connects first: it alone forgets what others left
                             json={"method": "parityrl_serve_supports", "args": ["1" if self.pushes_weights else "0"]})
        if not (isinstance(out, dict) and out.get("results")
                and all(r == {"recording": True} for r in out["results"])):
            raise ServerEngineError(f"vLLM server at {self.url}: parityrl_serve_supports returned {out!r:.300}")

    def _supports(self, requests: list[tuple[str, int]]) -> list[Support]:
        """The kept sets of each (request id, completion length) from the server's workers (rank 0's: every rank
        of a tensor-parallel group samples the same tokens); a missing or malformed answer is an error."""
        out = self.http.call("POST", "/collective_rpc", "sampling supports of samples",
                             json={"method": "parityrl_take_supports", "args": [json.dumps(requests)]})
        try:
            supports = decode_supports(out["results"][0])
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ServerEngineError(f"vLLM server at {self.url}: asked for the kept sets of {len(requests)} samples, "
                                    f"it answered {out!r:.300} ({type(e).__name__}: {e})") from None
        if [s.offsets.numel() - 1 for s in supports] != [n for _, n in requests]:
            raise ServerEngineError(f"vLLM server at {self.url}: kept sets for {len(supports)} samples of lengths "
                                    f"{[s.offsets.numel() - 1 for s in supports][:8]}, expected {len(requests)} of "
                                    f"{[n for _, n in requests][:8]}")
        return supports

    def _routes(self, requests: list[tuple[str, int]], what: str) -> list[torch.Tensor]:
        """The routes of each (request id, sequence length) from the server's workers (rank 0's: every rank of a
        tensor-parallel group routes the same tokens); an answer without them is an error, never a fallback."""
        out = self.http.call("POST", "/collective_rpc", f"routes of {what}",
                             json={"method": "parityrl_take_routes", "args": [json.dumps(requests)]})
        results = out.get("results") if isinstance(out, dict) else None
        got = results[0] if isinstance(results, list) and results else None
        if not isinstance(got, list) or len(got) != len(requests):
            raise ServerEngineError(f"vLLM server at {self.url}: asked for the routes of {len(requests)} {what}, it "
                                    f"answered {out!r:.300}")
        shape = (self.route_shape["layers"], self.route_shape["top_k"])
        routes = []
        for (rid, n), enc in zip(requests, got):
            r = decode_routes(enc, f"vLLM server at {self.url}, routes of request {rid}")
            if tuple(r.shape) != (n, *shape):
                raise ServerEngineError(f"vLLM server at {self.url}: routes of request {rid} have shape "
                                        f"{tuple(r.shape)}, expected ({n}, {shape[0]}, {shape[1]})")
            if n > 1 and bool((r[:n - 1] == NO_ROUTE).all()):
                raise ServerEngineError(f"vLLM server at {self.url}: request {rid} came back without routes (the "
                                        "server's route capture saw none of its tokens)")
            routes.append(r)
        return routes

    def _check_server(self, info: dict[str, Any], dtype: str, need_len: int | None) -> None:
        def need(ok: bool, what: str, value: Any, expected: str) -> None:
            if not ok:
                raise ServerEngineError(f"vLLM server at {self.url}: {what} = {value!r}, expected {expected}; restart "
                                        "it with `parityrl serve <recipe>` for this recipe")

        need(info["logprobs_mode"] == "processed_logprobs", "logprobs_mode", info["logprobs_mode"],
             "'processed_logprobs' (the log-probs of the distribution actually sampled from, as the trainer scores)")
        need(info["dtype"] == dtype, "dtype", info["dtype"], f"{dtype!r} (model.dtype)")
        need(need_len is None or info["max_model_len"] >= need_len, "max_model_len", info["max_model_len"],
             f">= {need_len} (data.max_prompt_tokens + rollout.max_new_tokens, or env.max_tokens)")
        need(info["weight_transfer_backend"] in ("parityrl_file", "nccl"), "weight transfer backend",
             info["weight_transfer_backend"], "'parityrl_file' (CPU) or 'nccl' (CUDA): --weight-transfer-config")
        self._check_model(info["model"])

    def _check_model(self, served: str) -> None:
        mine, theirs = Path(self.model).resolve(), Path(served)
        if theirs.is_dir() and theirs.resolve() == mine:
            return
        if theirs.is_dir():
            if checkpoint_shapes(theirs) != self._shapes:
                raise ServerEngineError(f"vLLM server at {self.url} serves {served}, whose parameters differ from the "
                                        f"trainer's model {self.model}; start the server for this recipe")
            return
        # Another host (or path): nothing to compare locally; the first probe's parity would show a mismatch.
        warnings.warn(f"vLLM server at {self.url} serves {served!r}, not visible here; cannot check that it is the "
                      f"trainer's model {self.model}", stacklevel=3)

    def _start_transfer(self, transfer_root) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        # late: the plug-in imports vLLM, only needed when this trainer pushes weights
        from rollout.vllm_plugins import server_transfer

        self._source = server_transfer.ListWeightSource()
        client = HTTPWeightSyncClient(self.http)
        if self.backend == server_transfer.BACKEND:
            info = server_transfer.FileTrainerInitInfo(rank=0, root=str(transfer_root or ""))
        else:  # nccl -- not run by the CPU-only tests: follows vllm/distributed/weight_transfer/nccl_engine.py
            if not torch.cuda.is_available():
                raise ServerEngineError(f"vLLM server at {self.url} uses the nccl weight-transfer backend, which needs "
                                        "CUDA in the trainer too; on CPU start it with --transfer-backend parityrl_file")
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            world = int(self.http.call("GET", "/get_world_size", "weight-transfer init")["world_size"])
            address = _local_address_towards(self.host)
            # The trainer is NCCL rank 0 and hosts the rendezvous; the server's workers join as 1..world.
            info = NCCLTrainerInitInfo(master_address=address, master_port=_free_port(address),
                                       world_size=1 + world, rank=0)
        self._transfer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self._source)

    @property
    def http(self) -> _Http:
        if self._http is None:
            raise RuntimeError(f"ServerEngine({self.url}) is closed")
        return self._http

    def _version(self) -> str:
        return f"parityrl-{self._version_tag}-{self._version_n}"

    def _set_version(self, version: str | None = None) -> None:
        self.http.call("POST", "/update_weight_version", "weight push (update_weight_version)",
                       json={"new_version": version or self._version()})

    # ---- generation -------------------------------------------------------------------------
    def _check_max_logprobs(self, asked: int, what: str) -> None:
        if asked > self.max_logprobs:
            raise ValueError(f"{what}, but the server at {self.url} allows max_logprobs = {self.max_logprobs}; "
                             "restart it with `parityrl serve` (it sets max_logprobs from parity.topk)")

    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec) -> Rollouts:
        """Sample ``spec.n`` completions per prompt; sample i answers prompt i // n (VLLMEngine's conventions)."""
        validate_request(prompt_ids, spec, self.max_model_len)
        k = spec.logprobs_topk
        if k:  # k + 1: see the module docstring
            self._check_max_logprobs(k + 1, f"spec.logprobs_topk = {k}: this client asks for k + 1")
        tag = secrets.token_hex(4)
        version, adapter = self._version(), self._adapter  # as at launch: the batch must come from these
        bodies = []
        for i, p in enumerate(prompt_ids):
            for j in range(spec.n):
                s = i * spec.n + j
                bodies.append({
                    "request_id": f"parityrl-{tag}-{s}", "token_ids": list(p), "output_mode": "tokens",
                    **self._model_field(adapter),
                    "sampling_params": {
                        "n": 1, "temperature": spec.temperature, "top_p": spec.top_p, "top_k": spec.top_k,
                        "min_p": spec.min_p,
                        "max_tokens": spec.max_new_tokens, "seed": sample_seed(spec.seed, spec.sample_index(s)),
                        "stop_token_ids": list(self.eos_ids), "detokenize": False,
                        # k + 1: see the module docstring (the route cuts [sampled, top...] to this many).
                        "logprobs": k + 1 if k else 0}})
        responses = _run_coroutine(self._post_all(bodies, action=f"generate ({len(bodies)} requests)"))
        completion_ids, logprobs, finish, top_ids, top_lps = [], [], [], [], []
        for s, resp in enumerate(responses):
            ids, lps, reason, t_ids, t_lps = self._parse(s, resp, k, version, adapter)
            completion_ids.append(ids)
            logprobs.append(lps)
            finish.append(reason)
            top_ids.append(t_ids)
            top_lps.append(t_lps)
        prompts = [list(prompt_ids[s // spec.n]) for s in range(len(bodies))]
        routes = (self._routes([(b["request_id"], len(p) + len(c)) for b, p, c in zip(bodies, prompts, completion_ids)],
                               "samples") if self.return_routes else [])
        support = (self._supports([(b["request_id"], len(c)) for b, c in zip(bodies, completion_ids)])
                   if spec.truncated and self.return_supports else [])
        return Rollouts(prompt_ids=prompts, completion_ids=completion_ids, rollout_logprobs=logprobs,
                        finish_reasons=finish, group_size=spec.n, topk_ids=top_ids if k else [],
                        topk_logprobs=top_lps if k else [], routes=routes, support=support)

    def score(self, sequences: list[list[int]], topk: int = 0) -> Scored:
        """log p(x_t | x_<t) at temperature 1 of every token t >= 1 of each sequence (``VLLMEngine.score``)."""
        validate_score_request(sequences, self.max_model_len)
        self._check_max_logprobs(topk, f"score: topk = {topk}")
        tag = secrets.token_hex(4)
        version, adapter = self._version(), self._adapter
        bodies = [{"request_id": f"parityrl-score-{tag}-{k}", "token_ids": list(seq), "output_mode": "tokens",
                   **self._model_field(adapter),
                   "sampling_params": {"n": 1, "temperature": 1.0, "max_tokens": 1, "seed": sample_seed(0, k),
                                       "detokenize": False, "prompt_logprobs": topk}}
                  for k, seq in enumerate(sequences)]
        responses = _run_coroutine(self._post_all(bodies, action=f"score ({len(bodies)} sequences)"))
        scored = Scored.from_rows(self._parse_prompt_logprobs(k, seq, resp, topk, version, adapter)
                                  for k, (seq, resp) in enumerate(zip(sequences, responses)))
        if self.return_routes:  # the prefill's routes of the whole sequence (+1: the one token sampled after it)
            scored.routes = [r[:len(seq)] for r, seq in zip(
                self._routes([(b["request_id"], len(seq) + 1) for b, seq in zip(bodies, sequences)], "sequences"),
                sequences)]
        return scored

    @staticmethod
    def _model_field(adapter: str | None) -> dict:
        """A request's ``model``: the adapter it runs with (the token route's ``_maybe_get_adapters``), or none."""
        return {} if adapter is None else {"model": adapter}

    def _parse_prompt_logprobs(self, k: int, seq: list[int], resp: dict, topk: int, version: str,
                               adapter: str | None = None):
        def bad(msg: str) -> ServerEngineError:
            return ServerEngineError(f"vLLM server at {self.url}, scored sequence {k}: {msg}")

        _check_version((resp.get("choices") or [{}])[0], version, bad)
        _check_adapter(resp, adapter, bad)
        plp = resp.get("prompt_logprobs")
        # JSON: token ids as string keys, the route's -9999 floor for -inf
        positions = [None if pos is None else {int(tid): (_unclamp(e["logprob"]), e["rank"]) for tid, e in pos.items()}
                     for pos in plp] if isinstance(plp, list) else None
        return read_prompt_logprobs(seq, positions, topk, bad)

    async def _post_all(self, bodies: list[dict], action: str) -> list[dict]:
        import httpx

        http = self.http
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        gate = asyncio.Semaphore(self.max_concurrency)
        path = "/inference/v1/generate"
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout_s, limits=limits) as client:
            async def one(body: dict) -> dict:
                async with gate:
                    try:
                        r = await client.post(path, json=body)
                    except httpx.TransportError as e:
                        raise http.unavailable(action, "POST", path, e) from None
                if r.status_code != 200:
                    raise http.error(action, "POST", path, r.status_code, r.text)
                return _json(http.url, r, action, "POST", path, http.keys)

            tasks = [asyncio.ensure_future(one(b)) for b in bodies]
            try:
                return await asyncio.gather(*tasks)
            except BaseException:
                # Closing the other connections makes the server abort their requests.
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

    def _parse(self, s: int, resp: dict, k: int, version: str, adapter: str | None = None):
        def bad(msg: str) -> ServerEngineError:
            return ServerEngineError(f"vLLM server at {self.url}, sample {s}: {msg}")

        choices = resp.get("choices") or []
        if len(choices) != 1:
            raise bad(f"expected 1 choice, got {len(choices)}")
        c = choices[0]
        if c.get("finish_reason") not in ("stop", "length"):
            raise bad(f"finished with reason {c.get('finish_reason')!r} (expected 'stop' or 'length')")
        _check_version(c, version, bad)
        _check_adapter(resp, adapter, bad)
        ids = [int(t) for t in c.get("token_ids") or []]
        content = (c.get("logprobs") or {}).get("content")
        if not ids or content is None or len(content) != len(ids):
            raise bad(f"{len(ids)} tokens but {None if content is None else len(content)} log-prob positions")
        lps, t_ids, t_lps = [], [], []
        for pos, (tok, e) in enumerate(zip(ids, content)):
            if e["token_id"] != tok:
                raise bad(f"log-prob position {pos} is for token {e['token_id']}, the sampled token is {tok}")
            lps.append(_unclamp(e["logprob"]))
            if k:
                cands = sorted(e.get("top_logprobs") or [],
                               key=lambda x: (-x["logprob"], x.get("rank") or math.inf))[:k]
                if len(cands) != k:
                    raise bad(f"position {pos}: {len(cands)} top log-probs, expected {k}")
                t_ids.append([int(x["token_id"]) for x in cands])
                t_lps.append([_unclamp(x["logprob"]) for x in cands])
        return ids, lps, c["finish_reason"], t_ids, t_lps

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push the named parameters (HF names) to the server as one weight version; names not given keep
        their values. ``load_weight_chunks`` with a single chunk."""
        self.load_weight_chunks([named_tensors])

    def load_weight_chunks(self, chunks: Iterable[Iterable[tuple[str, torch.Tensor]]]) -> None:
        """Push an update made of several chunks (``rollout.weight_export.layer_chunks``) as ONE weight version.

        Each chunk is checked (whole fused groups, ``check_fused_groups``), cast to the
        engine dtype, sent with one round of vLLM's transfer lifecycle and released before
        the next chunk is taken from ``chunks``: when ``chunks`` is a generator (the merge
        of a ZeRO-3 trainer is), the trainer holds one chunk, not the whole update. While
        chunks arrive, the server's weight version is ``<last>-partial``: if the push fails
        part-way the server holds a mix of old and new weights, and every later generate
        refuses its samples (their version is not this trainer's) until a complete push.
        After the last chunk: a new weight version and a reset prefix cache.
        ``last_push`` records the payload bytes, bytes on the wire/file, tensors, chunks and seconds.
        """
        if not self.pushes_weights:
            raise RuntimeError(f"ServerEngine({self.url}) was created with pushes_weights=False (a data-parallel rank "
                               "other than 0): rank 0 pushes; call follow_push after it")
        t0 = time.perf_counter()
        totals = {"bytes": 0.0, "tensors": 0.0, "file_bytes": 0.0, "chunks": 0.0}
        for chunk in chunks:
            named = engine_named_tensors(chunk, self.torch_dtype)
            if not named:
                continue
            self._check_update(named)
            if not totals["chunks"]:
                self._set_version(f"{self._version()}-partial")
                if self._lora is not None:  # an adapter later must run over the model's own weights again
                    self._rpc("parityrl_base_changed", "weight push (base weights replaced)")
            if self.backend == "nccl":  # broadcast from the trainer's GPU
                named = nccl_ready(named)
            self._source.set(named)
            try:
                self._transfer.send_weights()
            finally:
                self._source.set([])  # do not keep the chunk's tensors alive
            payload = payload_bytes(named)
            totals["bytes"] += payload
            totals["tensors"] += len(named)
            totals["file_bytes"] += getattr(self._transfer, "last_file_bytes", payload)
            totals["chunks"] += 1
        if not totals["chunks"]:
            return
        self._version_n += 1
        self._set_version()
        self._adapter = None  # the merged weights alone from now on, as the colocated engine after a merged update
        self._reset_prefix_cache("weight push")
        self.last_push = {**totals, "seconds": time.perf_counter() - t0}

    def _reset_prefix_cache(self, action: str) -> None:
        out = self.http.call("POST", "/reset_prefix_cache", f"{action} (reset_prefix_cache)")
        if not (out or {}).get("success"):
            raise ServerEngineError(f"vLLM server at {self.url} refused to reset its prefix cache after a {action} "
                                    "(requests still running?); KV blocks of the old weights would be reused")

    def _rpc(self, method: str, action: str, *args: str, timeout: float | None = None) -> list:
        """The worker extension's ``method`` in every worker of the server (``/collective_rpc``): their answers."""
        out = self.http.call("POST", "/collective_rpc", action, json={"method": method, "args": list(args)},
                             timeout=timeout)
        results = out.get("results") if isinstance(out, dict) else None
        if not isinstance(results, list) or not results:
            raise ServerEngineError(f"vLLM server at {self.url}: {method} returned {out!r:.300}")
        return results

    # ---- LoRA adapter -----------------------------------------------------------------------
    def load_adapter(self, adapter: LoraAdapter) -> None:
        """Serve ``adapter`` (one version of the policy's LoRA) over the model's own weights for every generate and
        score from now on, as a new weight version (module docstring). Only when ``adapter_dtype`` (the server
        serves adapters). ``last_push`` records the adapter's bytes, the bytes sent and the seconds."""
        if self.adapter_dtype is None:
            raise RuntimeError(f"load_adapter(): the server at {self.url} does not serve adapters for this client "
                               f"({self.adapter_unavailable or 'construct ServerEngine(..., adapter_rank=r)'})")
        if not self.pushes_weights:
            raise RuntimeError(f"ServerEngine({self.url}) was created with pushes_weights=False (a data-parallel rank "
                               "other than 0): rank 0 pushes; call follow_push(adapter=True) after it")
        if adapter.rank > self.max_lora_rank:
            raise ValueError(f"adapter rank {adapter.rank}: the server at {self.url} was started with max_lora_rank "
                             f"{self.max_lora_rank}; restart it with `parityrl serve <recipe>` for model.lora.r")
        from safetensors.torch import save

        t0 = time.perf_counter()
        name = f"parityrl-{self._version_tag}-{self._version_n + 1}"  # the version it becomes
        weights = save({k: v.contiguous() for k, v in adapter.tensors.items()})
        action = f"adapter push of {name}"
        written = self._rpc("parityrl_put_adapter", f"{action} (write its files)", name,
                            json.dumps(adapter.config, sort_keys=True), base64.b64encode(weights).decode("ascii"))
        paths = {r.get("path") if isinstance(r, dict) else None for r in written}
        if len(paths) != 1 or None in paths:
            raise ServerEngineError(f"vLLM server at {self.url}: its workers wrote adapter {name} to {sorted(map(str, paths))}; "
                                    "expected one path that every worker reads (the same temporary directory on "
                                    "every host of the server)")
        path = paths.pop()
        self._loaded_adapters = True
        self.http.call("POST", "/v1/load_lora_adapter", f"{action} (load_lora_adapter)",
                       json={"lora_name": name, "lora_path": path})
        self._adapter = name
        self._version_n += 1
        self._set_version()
        self._unload_adapters(keep=name, action=action)
        self._reset_prefix_cache("adapter push")
        self.last_push = {"bytes": float(adapter.nbytes), "tensors": float(len(adapter.tensors)),
                          "file_bytes": float(len(weights)), "chunks": 1.0, "base_restored": float(any(
                              isinstance(r, dict) and r.get("restored") for r in written)),
                          "seconds": time.perf_counter() - t0}

    def _unload_adapters(self, keep: str, action: str, timeout: float | None = None) -> None:
        """Unload every parityrl adapter the server lists but ``keep`` (this client's older versions, and any a
        killed trainer left), then delete their files. In that order: a request naming a listed adapter whose
        files are gone kills vLLM's engine core (the worker's ``LoRAAdapterNotFoundError`` is fatal there,
        ``vllm/lora/worker_manager.py``), while one naming an unlisted adapter is an HTTP 404."""
        listed = self.http.call("GET", "/v1/models", f"{action} (list adapters)", timeout=timeout) or {}
        for card in listed.get("data") or []:
            name = card.get("id") if isinstance(card, dict) else None
            if isinstance(name, str) and name.startswith("parityrl-") and name != keep:
                try:
                    self.http.call("POST", "/v1/unload_lora_adapter", f"{action} (unload {name})",
                                   json={"lora_name": name}, timeout=timeout)
                except ServerEngineError as e:
                    if "cannot be found" not in str(e):  # unloaded meanwhile: nothing to do
                        raise
        self._rpc("parityrl_drop_adapters", f"{action} (delete older adapter files)", keep, timeout=timeout)

    @property
    def adapter_version(self) -> str | None:
        """The name of the adapter version the requests run with (None: the base or merged weights)."""
        return self._adapter

    def follow_push(self, adapter: bool = False) -> None:
        """On a rank that does not push (``pushes_weights=False``): the pushing rank has just pushed (the
        caller synchronises the ranks around it); from now on expect its new weight version, and with ``adapter``
        name its adapter (the version's name) in every request."""
        if self.pushes_weights:
            raise RuntimeError(f"ServerEngine({self.url}) pushes its own weights: call load_weights, not follow_push")
        if adapter and self.adapter_dtype is None:
            raise RuntimeError(f"follow_push(adapter=True): the server at {self.url} does not serve adapters for "
                               f"this client ({self.adapter_unavailable or 'no adapter_rank'})")
        self._version_n += 1
        self._adapter = self._version() if adapter else None

    def release_memory(self) -> None:
        """Nothing to free: the server holds its own devices (``RolloutEngine.release_memory``)."""

    def _check_update(self, named: list[tuple[str, torch.Tensor]]) -> None:
        check_update(named, self._shapes, self.model, self.packed_modules)

    # ---- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Release the transfer channel and the HTTP client; the server keeps running. Safe to call twice,
        and never raises (it runs in the trainer's ``finally`` while another error may be on its way)."""
        if self._loaded_adapters and self._http is not None:
            try:  # this trainer's adapters are of no use to any other: unloaded, their files deleted
                self._unload_adapters(keep="", action="close", timeout=10.0)
            except Exception:  # noqa: BLE001 - a dead server has nothing to release
                pass
            self._adapter, self._loaded_adapters = None, False
        if self._transfer is not None:
            try:
                if self._http is not None:
                    HTTPWeightSyncClient(self._http).shutdown_weight_transfer_engine()
            except Exception:  # noqa: BLE001 - a dead server has nothing to release
                pass
            try:
                self._transfer.shutdown()  # parityrl_file: removes its directory; nccl: destroys the communicator
            except Exception:  # noqa: BLE001 - same reason
                pass
            self._transfer = None
        if self._http is not None:
            self._http.close()
            self._http = None

    def __enter__(self) -> "ServerEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
