"""Serving the policy's LoRA adapter on the server (package docstring, LoRA adapter sync): whether the server can,
and unloading the versions a client no longer uses."""
from __future__ import annotations

from typing import Any, Sequence

from rollout.server_engine.errors import ServerEngineError
from rollout.server_engine.http_channel import _Http


def adapter_unavailable_reason(lora: dict[str, Any] | None, url: str, rank: int, targets: Sequence[str] | None,
                               packed_modules: dict[str, list[str]]) -> str | None:
    """Why the server at ``url``, with LoRA settings ``lora`` (None: started without LoRA), cannot serve the policy's
    adapter of rank ``rank`` on ``targets``; None when it can."""
    where = f"the vLLM server at {url}"
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
        missing = [t for t in targets if not lora_covers(t, lora["target_modules"], packed_modules)]
        if missing:
            why = (f"{where} runs LoRA on {lora['target_modules']}, not on the recipe's "
                   f"model.lora.target_modules {missing}")
    return why


def lora_covers(target: str, served: Sequence[str], packed_modules: dict[str, list[str]]) -> bool:
    """vLLM's rule (``vllm/lora/utils.py: is_in_target_modules``): a leaf name, or its fused parent's."""
    return target in served or any(target in children and parent in served
                                   for parent, children in packed_modules.items())


def unload_adapters(http: _Http, keep: str, action: str, timeout: float | None = None) -> None:
    """Unload every parityrl adapter the server lists but ``keep`` (a client's older versions, and any a
    killed trainer left), then delete their files. In that order: a request naming a listed adapter whose
    files are gone kills vLLM's engine core (the worker's ``LoRAAdapterNotFoundError`` is fatal there,
    ``vllm/lora/worker_manager.py``), while one naming an unlisted adapter is an HTTP 404."""
    listed = http.call("GET", "/v1/models", f"{action} (list adapters)", timeout=timeout) or {}
    for card in listed.get("data") or []:
        name = card.get("id") if isinstance(card, dict) else None
        if isinstance(name, str) and name.startswith("parityrl-") and name != keep:
            try:
                http.call("POST", "/v1/unload_lora_adapter", f"{action} (unload {name})",
                          json={"lora_name": name}, timeout=timeout)
            except ServerEngineError as e:
                if "cannot be found" not in str(e):  # unloaded meanwhile: nothing to do
                    raise
    http.rpc("parityrl_drop_adapters", f"{action} (delete older adapter files)", keep, timeout=timeout)
