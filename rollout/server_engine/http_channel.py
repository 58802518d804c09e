"""JSON over HTTP to one vLLM server, every failure turned into an error naming the URL, the route and the action."""
from __future__ import annotations

import urllib.parse
from typing import Any

from rollout.base import EngineUnavailable
from rollout.server_engine.errors import MalformedAnswer, ServerEngineError
from rollout.server_engine.keys import ROLLOUT_SERVER, ServerKeys

_ENGINE_DEAD = "EngineCore encountered an issue"  # vLLM EngineDeadError's message, in its HTTP 500 body


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

    def rpc(self, method: str, action: str, *args: str, timeout: float | None = None) -> list:
        """The worker extension's ``method`` in every worker of the server (``/collective_rpc``): their answers."""
        out = self.call("POST", "/collective_rpc", action, json={"method": method, "args": list(args)},
                        timeout=timeout)
        results = out.get("results") if isinstance(out, dict) else None
        if not isinstance(results, list) or not results:
            raise ServerEngineError(f"vLLM server at {self.url}: {method} returned {out!r:.300}")
        return results

    def close(self) -> None:
        self._client.close()
