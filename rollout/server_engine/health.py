"""The start-up wait: ``GET /health`` until the server answers, with errors naming the recipe's keys."""
from __future__ import annotations

import time

from rollout.base import EngineUnavailable
from rollout.server_engine.keys import ROLLOUT_SERVER, ServerKeys


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
