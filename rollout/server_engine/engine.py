"""``ServerEngine``: the client of a `parityrl serve` server behind the ``RolloutEngine`` interface (package
docstring)."""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import json
import secrets
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from rollout.adapters import LoraAdapter
from rollout.base import EngineUnavailable
from rollout.model_files import checkpoint_shapes, eos_token_ids
from rollout.requests import sample_seed, validate_request, validate_score_request
from rollout.server_engine.adapters import adapter_unavailable_reason, unload_adapters
from rollout.server_engine.answers import parse_prompt_logprobs, parse_sample
from rollout.server_engine.captures import SERVER_ROUTES_ON_CUDA, SERVER_SUPPORTS_ON_CUDA, take_routes, take_supports
from rollout.server_engine.errors import MalformedAnswer, ServerEngineError, UnusableServer
from rollout.server_engine.health import wait_for_health
from rollout.server_engine.http_channel import _Http, _json, parse_server_url
from rollout.server_engine.images import check_image_server, expanded_prompt, image_parts, take_images
from rollout.server_engine.in_flight import (
    MODES,
    pause_for_update,
    recompute_running,
    resume_after_update,
    stale_kv_flags,
    token_versions,
)
from rollout.server_engine.keys import ROLLOUT_SERVER, ServerKeys
from rollout.server_engine.weight_transfer import HTTPWeightSyncClient, nccl_ready, start_transfer
from rollout.types import Rollouts, SamplingSpec, Scored
from rollout.weight_export import payload_bytes
from rollout.weight_updates import DEFAULT_PACKED_MODULES, check_update, engine_named_tensors

# The weight version vLLM's engine core starts with (``EngineCore._weight_version``, vllm/v1/engine/core.py); any
# push through the RL routes (``finish_weight_update``) or ``/update_weight_version`` replaces it.
SERVED_VERSION = "default"


def _run_coroutine(coro):
    """asyncio.run, also from a thread when the caller already runs an event loop (notebooks)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


class ServerEngine:
    """A vLLM server behind the ``rollout.base.RolloutEngine`` interface (see the package docstring).

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
    served_weights: the server's own weights, which no client pushes (a teacher's: `parityrl serve` of the teacher's
        recipe loaded them from its checkpoint, and they never change during a run). Nothing is set up on the server:
        no weight transfer (no NCCL group on CUDA), no version set, so any number of ranks and runs may read it at
        once; the version every answer must carry is the one vLLM starts with (``SERVED_VERSION``), checked at
        connect: a server a trainer has pushed to (or set a version on) does not hold its checkpoint's weights and
        is refused. Needs ``pushes_weights=False``.
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
        is refused (see the package docstring).
    keys: the recipe keys its errors name (``ServerKeys``: the student's server's by default).
    max_images: the images a prompt of the run may hold (``data.max_images_per_prompt``), 0 for a text run. The
        server must have been started for images (``parityrl serve`` of a vision-language recipe); its workers then
        record what each request consumed (``images.py``), and every push empties its encoder cache.
    """

    # A push may come as chunks of whole layers, all under one weight version (load_weight_chunks).
    streams_weights = True
    # The server runs vLLM in BF16/FP16 (the recipe check refuses FP8 recipes in server mode).
    fp8_block_weights = False
    served_weights = False  # set per client (``served_weights``)
    in_flight = "off"  # set per client (``in_flight``)
    _paused = False  # inside ``in_flight_update``: the server's requests are frozen
    max_images = 0  # set per client (``max_images``)

    def __init__(self, url: str, *, model_dir: str | Path, timeout_s: float = 300.0, dtype: str = "bfloat16",
                 max_model_len: int | None = None, eos_ids: Sequence[int] | None = None,
                 transfer_root: str | Path | None = None, max_concurrency: int = 256, pushes_weights: bool = True,
                 version_tag: str | None = None, connect_timeout_s: float | None = None,
                 return_routes: bool = False, adapter_rank: int | None = None,
                 adapter_targets: Sequence[str] | None = None, adapter_required: bool = False,
                 return_supports: bool = False, served_weights: bool = False, in_flight: str = "off",
                 keys: ServerKeys = ROLLOUT_SERVER, max_images: int = 0) -> None:
        self.host, self.port = parse_server_url(url)
        if in_flight not in MODES:
            raise ValueError(f"in_flight = {in_flight!r}: expected one of {', '.join(MODES)}")
        if in_flight != "off" and max_images:
            raise ValueError("in_flight: a push in the middle of a generation would empty the encoder cache under "
                             "running requests that hold images; expected 'off' with images")
        if in_flight != "off" and not pushes_weights:
            raise ValueError("in_flight: only the client that pushes the weights updates them in flight")
        if served_weights and pushes_weights:
            raise ValueError("served_weights: the server's own weights are never pushed; expected "
                             "pushes_weights=False")
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
        self.served_weights = bool(served_weights)
        self.return_routes = bool(return_routes)
        self.route_shape = None
        self.return_supports = bool(return_supports)
        self.adapter_dtype: torch.dtype | None = None  # None: merged weights only (RolloutEngine.adapter_dtype)
        self.adapter_unavailable: str | None = None  # why not, when an adapter was asked for
        self._lora: dict[str, Any] | None = None  # the server's LoRA settings (None: started without LoRA)
        self._adapter: str | None = None  # the adapter every request names (its version's name), None: the base
        self._loaded_adapters = False  # this client loaded adapters on the server (close() unloads them)
        self.in_flight = in_flight  # rollout.in_flight (in_flight.py): weight updates while requests run
        self.max_images = int(max_images)

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
            if self.max_images:
                check_image_server(info, self.url, self.max_images)
                self.http.call("POST", "/collective_rpc", "image capture",  # the weight-pushing rank connects first
                               json={"method": "parityrl_serve_images", "args": ["1" if pushes_weights else "0"]})
            if in_flight == "keep" and info.get("prefix_caching") is not False:
                raise ServerEngineError(f"vLLM server at {self.url}: prefix caching is {info.get('prefix_caching')!r}; "
                                        "rollout.in_flight: keep needs it off (the cache cannot be emptied while "
                                        "requests run, so a request started after an update would read the old "
                                        "weights' prompt KV): restart it with `parityrl serve <recipe>` for this "
                                        "recipe")
            # A version of our own: responses generated with anything else are refused.
            self._version_tag, self._version_n = version_tag or secrets.token_hex(4), 0
            if self.served_weights:
                self._check_served_version(keys)
            if self.pushes_weights:
                self._source, self._transfer = start_transfer(self.http, self.backend, self.host, transfer_root)
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
        lora = self._lora
        why = adapter_unavailable_reason(lora, self.url, rank, targets, self.packed_modules)
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

    @property
    def http(self) -> _Http:
        if self._http is None:
            raise RuntimeError(f"ServerEngine({self.url}) is closed")
        return self._http

    def _version(self) -> str:
        if self.served_weights:
            return SERVED_VERSION
        return f"parityrl-{self._version_tag}-{self._version_n}"

    def _check_served_version(self, keys: ServerKeys) -> None:
        """ServerEngineError unless the server still holds the weights it loaded (``served_weights``)."""
        out = self.http.call("GET", "/weight_info", "weight version check")
        version = out.get("weight_version") if isinstance(out, dict) else out
        if version != SERVED_VERSION:
            raise ServerEngineError(
                f"vLLM server at {self.url} holds weight version {version!r}, not the weights it loaded "
                f"({SERVED_VERSION!r}): a trainer has pushed weights to it or set its version (is {keys.url} a "
                "student's server?); expected a server that reads its own checkpoint: restart it with "
                f"{keys.start}")

    def _set_version(self, version: str | None = None) -> None:
        self.http.call("POST", "/update_weight_version", "weight push (update_weight_version)",
                       json={"new_version": version or self._version()})

    # ---- generation -------------------------------------------------------------------------
    def _check_max_logprobs(self, asked: int, what: str) -> None:
        if asked > self.max_logprobs:
            raise ValueError(f"{what}, but the server at {self.url} allows max_logprobs = {self.max_logprobs}; "
                             "restart it with `parityrl serve` (it sets max_logprobs from parity.topk)")

    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec,
                 images: Sequence[Sequence[Any]] | None = None) -> Rollouts:
        """Sample ``spec.n`` completions per prompt; sample i answers prompt i // n (VLLMEngine's conventions).

        ``images``: per prompt, its images (PIL) in the order of its placeholders, as ``VLLMEngine.generate`` takes
        them; ``Rollouts.prompt_ids`` are then the ids the server consumed, expanded, and ``Rollouts.images`` what
        its workers received of each image (``images.py``)."""
        validate_request(prompt_ids, spec, self.max_model_len)
        parts = self._image_parts(images, len(prompt_ids), "prompt")
        k = spec.logprobs_topk
        if k:  # k + 1: see the package docstring
            self._check_max_logprobs(k + 1, f"spec.logprobs_topk = {k}: this client asks for k + 1")
        tag = secrets.token_hex(4)
        version, adapter = self._version(), self._adapter  # as at launch: the batch must come from these
        in_flight = self.in_flight != "off"
        bodies = []
        for i, p in enumerate(prompt_ids):
            for j in range(spec.n):
                s = i * spec.n + j
                bodies.append({
                    "request_id": f"parityrl-{tag}-{s}", "token_ids": list(p), "output_mode": "tokens",
                    **self._model_field(adapter), **parts[i],
                    "sampling_params": {
                        "n": 1, "temperature": spec.temperature, "top_p": spec.top_p, "top_k": spec.top_k,
                        "min_p": spec.min_p,
                        "max_tokens": spec.max_new_tokens, "seed": sample_seed(spec.seed, spec.sample_index(s)),
                        "stop_token_ids": list(self.eos_ids), "detokenize": False,
                        # k + 1: see the package docstring (the route cuts [sampled, top...] to this many).
                        "logprobs": k + 1 if k else 0}})
        responses = _run_coroutine(self._post_all(bodies, action=f"generate ({len(bodies)} requests)"))
        completion_ids, logprobs, finish, top_ids, top_lps, versions = [], [], [], [], [], []
        for s, resp in enumerate(responses):
            # in flight, a sample may span this client's pushes since the launch: read per token below
            ids, lps, reason, t_ids, t_lps = parse_sample(self.url, s, resp, k, None if in_flight else version, adapter)
            if in_flight:
                versions.append(self._token_versions(s, resp, len(ids)))
            completion_ids.append(ids)
            logprobs.append(lps)
            finish.append(reason)
            top_ids.append(t_ids)
            top_lps.append(t_lps)
        prompts = [list(prompt_ids[s // spec.n]) if not parts[s // spec.n] else
                   expanded_prompt(self.url, s, resp, prompt_ids[s // spec.n]) for s, resp in enumerate(responses)]
        routes = (take_routes(self.http, [(b["request_id"], len(p) + len(c))
                                          for b, p, c in zip(bodies, prompts, completion_ids)],
                              "samples", self.route_shape) if self.return_routes else [])
        support = (take_supports(self.http, [(b["request_id"], len(c)) for b, c in zip(bodies, completion_ids)])
                   if spec.truncated and self.return_supports else [])
        return Rollouts(prompt_ids=prompts, completion_ids=completion_ids, rollout_logprobs=logprobs,
                        finish_reasons=finish, group_size=spec.n, topk_ids=top_ids if k else [],
                        topk_logprobs=top_lps if k else [], routes=routes, support=support, versions=versions,
                        stale_kv=[stale_kv_flags(v, self.in_flight) for v in versions],
                        images=take_images(self.http, [b["request_id"] for b in bodies]) if images is not None else [])

    def _image_parts(self, images: Sequence[Sequence[Any]] | None, count: int, what: str) -> list[dict]:
        """Per prompt, the fields its requests add for its images (``content_parts``, and the expanded prompt asked
        back); {} for a text prompt."""
        if images is None:
            return [{}] * count
        if len(images) != count:
            raise ValueError(f"images: expected one list per {what} ({count}), got {len(images)}")
        if any(images) and not self.max_images:
            raise ValueError(f"images: ServerEngine({self.url}) was created for text (max_images=0)")
        return [{"content_parts": image_parts(i), "return_token_ids": True} if i else {} for i in images]

    @property
    def weight_version(self) -> int:
        """This client's pushes so far: the number ``Rollouts.versions`` gives the weights that sampled a token."""
        return self._version_n

    def _token_versions(self, s: int, resp: dict, num_tokens: int) -> list[int]:
        def number(label: str) -> int | None:
            head, _, n = label.rpartition("-")
            ok = head == f"parityrl-{self._version_tag}" and n.isdigit() and int(n) <= self._version_n
            return int(n) if ok else None

        def bad(msg: str) -> ServerEngineError:
            return ServerEngineError(f"vLLM server at {self.url}, sample {s}: {msg}")

        return token_versions((resp.get("choices") or [{}])[0], num_tokens, number, bad)

    @contextlib.contextmanager
    def in_flight_update(self):
        """A weight push inside reaches the requests running now (``rollout.in_flight``, in_flight.py): they are
        frozen first, and continue after it on the KV they hold (keep) or re-prefilled under the new weights
        (recompute). Only merged pushes: a running request keeps the adapter it was started with."""
        if self.in_flight == "off":
            raise RuntimeError(f"ServerEngine({self.url}) was created with in_flight='off'")
        pause_for_update(self.http)
        self._paused = True
        try:
            yield self
            if self.in_flight == "recompute":
                recompute_running(self.http, self.url)
        finally:
            self._paused = False
            resume_after_update(self.http)

    def score(self, sequences: list[list[int]], topk: int = 0,
              images: Sequence[Sequence[Any]] | None = None) -> Scored:
        """log p(x_t | x_<t) at temperature 1 of every token t >= 1 of each sequence (``VLLMEngine.score``; with
        ``images``, of the sequence the server consumed, its placeholders expanded, as there)."""
        validate_score_request(sequences, self.max_model_len)
        parts = self._image_parts(images, len(sequences), "sequence")
        self._check_max_logprobs(topk, f"score: topk = {topk}")
        tag = secrets.token_hex(4)
        version, adapter = self._version(), self._adapter
        bodies = [{"request_id": f"parityrl-score-{tag}-{k}", "token_ids": list(seq), "output_mode": "tokens",
                   **self._model_field(adapter), **parts[k],
                   "sampling_params": {"n": 1, "temperature": 1.0, "max_tokens": 1, "seed": sample_seed(0, k),
                                       "detokenize": False, "prompt_logprobs": topk}}
                  for k, seq in enumerate(sequences)]
        responses = _run_coroutine(self._post_all(bodies, action=f"score ({len(bodies)} sequences)"))
        if images is not None:  # the sequences the server consumed; what its workers recorded is nobody's to read
            sequences = [expanded_prompt(self.url, k, resp, seq) if parts[k] else seq
                         for k, (seq, resp) in enumerate(zip(sequences, responses))]
            take_images(self.http, [b["request_id"] for b in bodies])
        scored = Scored.from_rows(parse_prompt_logprobs(self.url, k, seq, resp, topk, version, adapter)
                                  for k, (seq, resp) in enumerate(zip(sequences, responses)))
        if self.return_routes:  # the prefill's routes of the whole sequence (+1: the one token sampled after it)
            scored.routes = [r[:len(seq)] for r, seq in zip(
                take_routes(self.http, [(b["request_id"], len(seq) + 1) for b, seq in zip(bodies, sequences)],
                            "sequences", self.route_shape),
                sequences)]
        return scored

    @staticmethod
    def _model_field(adapter: str | None) -> dict:
        """A request's ``model``: the adapter it runs with (the token route's ``_maybe_get_adapters``), or none."""
        return {} if adapter is None else {"model": adapter}

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
        self._refuse_served("load_weights")
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
                    self.http.rpc("parityrl_base_changed", "weight push (base weights replaced)")
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
        if not self._paused:  # in flight the requests hold their blocks: in_flight_update empties the cache or has none
            self._reset_prefix_cache("weight push")
        self.last_push = {**totals, "seconds": time.perf_counter() - t0}

    def _reset_prefix_cache(self, action: str) -> None:
        """The caches of the old weights emptied: the prefix cache's KV, and with images the encoder's features (a
        trained projector changes them; vLLM keeps them across a push)."""
        out = self.http.call("POST", "/reset_prefix_cache", f"{action} (reset_prefix_cache)")
        if not (out or {}).get("success"):
            raise ServerEngineError(f"vLLM server at {self.url} refused to reset its prefix cache after a {action} "
                                    "(requests still running?); KV blocks of the old weights would be reused")
        if self.max_images:
            self.forget_images()

    def forget_images(self) -> None:
        """The server's cached image features dropped: the next request holding an image runs the vision encoder on
        it again (``VLLMEngine.forget_images``)."""
        self.http.call("POST", "/reset_encoder_cache", "reset_encoder_cache")

    # ---- LoRA adapter -----------------------------------------------------------------------
    def load_adapter(self, adapter: LoraAdapter) -> None:
        """Serve ``adapter`` (one version of the policy's LoRA) over the model's own weights for every generate and
        score from now on, as a new weight version (package docstring). Only when ``adapter_dtype`` (the server
        serves adapters). ``last_push`` records the adapter's bytes, the bytes sent and the seconds."""
        if self.adapter_dtype is None:
            raise RuntimeError(f"load_adapter(): the server at {self.url} does not serve adapters for this client "
                               f"({self.adapter_unavailable or 'construct ServerEngine(..., adapter_rank=r)'})")
        self._refuse_served("load_adapter")
        if self._paused:
            raise RuntimeError(f"load_adapter(): an in-flight update of the server at {self.url} takes merged weights "
                               "only (a running request keeps the adapter it was started with)")
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
        written = self.http.rpc("parityrl_put_adapter", f"{action} (write its files)", name,
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
        unload_adapters(self.http, keep=name, action=action)
        self._reset_prefix_cache("adapter push")
        self.last_push = {"bytes": float(adapter.nbytes), "tensors": float(len(adapter.tensors)),
                          "file_bytes": float(len(weights)), "chunks": 1.0, "base_restored": float(any(
                              isinstance(r, dict) and r.get("restored") for r in written)),
                          "seconds": time.perf_counter() - t0}

    @property
    def adapter_version(self) -> str | None:
        """The name of the adapter version the requests run with (None: the base or merged weights)."""
        return self._adapter

    def follow_push(self, adapter: bool = False) -> None:
        """On a rank that does not push (``pushes_weights=False``): the pushing rank has just pushed (the
        caller synchronises the ranks around it); from now on expect its new weight version, and with ``adapter``
        name its adapter (the version's name) in every request."""
        self._refuse_served("follow_push")
        if self.pushes_weights:
            raise RuntimeError(f"ServerEngine({self.url}) pushes its own weights: call load_weights, not follow_push")
        if adapter and self.adapter_dtype is None:
            raise RuntimeError(f"follow_push(adapter=True): the server at {self.url} does not serve adapters for "
                               f"this client ({self.adapter_unavailable or 'no adapter_rank'})")
        self._version_n += 1
        self._adapter = self._version() if adapter else None

    def _refuse_served(self, call: str) -> None:
        if self.served_weights:
            raise RuntimeError(f"{call}(): ServerEngine({self.url}) reads the weights the server loaded "
                               "(served_weights, a teacher's), which no client changes")

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
                unload_adapters(self.http, keep="", action="close", timeout=10.0)
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
