"""Adapters over the wire: the server's side of ``rollout.lora_sync: adapter`` in server mode.

The trainer (``rollout.server_engine.ServerEngine.load_adapter``) pushes each version of the policy's LoRA adapter
as PEFT's two files, through ``/collective_rpc`` (``parityrl_put_adapter`` of the worker extension,
``server_transfer.ParityrlWorkerExtension``): the files must be on the server's own filesystem, since vLLM's workers
read an adapter from a path (``vllm/lora/worker_manager.py``), and the server may be another host (the NCCL
backend). Then vLLM's own ``POST /v1/load_lora_adapter`` loads them under a new name per version
(``vllm/entrypoints/serve/lora/api_router.py``, mounted by ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``;
``OpenAIServingModels.load_adapter`` adds it in every worker at once, so a broken adapter fails the sync), and
every request names it in its ``model`` field (``serving.py: _maybe_get_adapters`` of the token route).

The functions run in each worker, called with the worker (``route_capture`` does the same):

- ``put_adapter``: one writer per host (local rank 0; the other ranks of a tensor-parallel group read the same
  files once the call returned, since ``collective_rpc`` answers when every worker has), written to a temporary
  name and renamed into place, so vLLM never reads half an adapter. The directory is the server instance's
  (``vllm_config.instance_id``), in the system temporary directory: an adapter is small (a 7B model's r-16
  adapter on every linear is ~80 MB), it is read once per version, and what a killed trainer leaves there is
  deleted by the next trainer's first push (``drop_adapters``).
- ``mark_base_changed`` / ``restore_base``: a merged push replaces base weights (``rollout.lora_sync: merged``, an
  earlier run on the same server); an adapter must run over the model's own weights, so the first adapter after
  one reloads them from the model's files (``reload_weights``, as the colocated engine's ``load_adapter`` does),
  in every worker. The mark is the worker's, so it holds across trainers.
"""
from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path

from rollout.adapters import CONFIG_FILE, WEIGHTS_FILE
from rollout.weight_updates import quiet_partial_reload

ROOT_PREFIX = "parityrl-adapters-"
BASE_CHANGED = "_parityrl_base_changed"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def lora_info(vllm_config) -> dict | None:
    """The server's LoRA settings as the trainer checks them (None: started without ``--enable-lora``)."""
    lc = vllm_config.lora_config
    if lc is None:
        return None
    dtype = lc.lora_dtype
    if dtype in (None, "auto"):  # vllm/config/lora.py: "auto" is the model's dtype
        dtype = vllm_config.model_config.dtype
    return {"max_lora_rank": int(lc.max_lora_rank), "max_loras": int(lc.max_loras),
            "max_cpu_loras": None if lc.max_cpu_loras is None else int(lc.max_cpu_loras),
            "target_modules": None if lc.target_modules is None else sorted(lc.target_modules),
            "dtype": str(dtype).split(".")[-1],
            # vLLM reads it in the API server (vllm/envs.py); the workers inherit the server's environment
            "runtime_updating": os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")}


def adapter_root(worker) -> Path:
    instance = getattr(worker.vllm_config, "instance_id", "") or "server"
    return Path(tempfile.gettempdir()) / f"{ROOT_PREFIX}{instance}"


def _writes(worker) -> bool:
    return int(getattr(worker, "local_rank", 0)) == 0


def mark_base_changed(worker) -> None:
    """A merged push is about to replace base weights (``ServerEngine.load_weight_chunks``)."""
    setattr(worker, BASE_CHANGED, True)


def restore_base(worker) -> bool:
    """The model's own weights back from its files if a merged push replaced some; whether it did."""
    if not getattr(worker, BASE_CHANGED, False):
        return False
    with quiet_partial_reload():
        worker.reload_weights()  # from model_config.model; vLLM drops its adapters (reset_lora_state)
    setattr(worker, BASE_CHANGED, False)  # only once the reload succeeded: a failed one is tried again
    return True


def put_adapter(worker, name: str, config_json: str, weights_b64: str) -> dict:
    """PEFT's two files of adapter ``name`` under this server's adapter directory, over the model's own base
    weights (``restore_base``). ``weights_b64``: ``adapter_model.safetensors``'s bytes in base64 (``collective_rpc``
    passes strings only). Answers the path and whether the base weights were restored."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"parityrl_put_adapter: adapter name {name!r}: expected letters, digits, '.', '_', '-'")
    config = json.loads(config_json)
    if not isinstance(config, dict) or "r" not in config:
        raise ValueError(f"parityrl_put_adapter: {name}: the config is not PEFT's adapter_config.json (no 'r')")
    restored = restore_base(worker)
    root = adapter_root(worker)
    path = root / name
    if _writes(worker):
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{name}.{secrets.token_hex(4)}.tmp"
        tmp.mkdir()
        try:
            (tmp / WEIGHTS_FILE).write_bytes(base64.b64decode(weights_b64, validate=True))
            (tmp / CONFIG_FILE).write_text(config_json)
            if path.exists():
                shutil.rmtree(path)
            os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return {"path": str(path), "restored": restored}


def drop_adapters(worker, keep: str) -> int:
    """Delete every adapter directory of this server but ``keep`` (the version now served; "": none); how many."""
    root = adapter_root(worker)
    if not _writes(worker) or not root.is_dir():
        return 0
    dropped = 0
    for child in root.iterdir():
        if child.name != keep:
            shutil.rmtree(child, ignore_errors=True)
            dropped += 1
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    return dropped
