"""Starting a server the tests run in a subprocess (`parityrl serve`, `vllm serve`): a free port, and the wait for
its /health."""
import socket
import subprocess
import time
from pathlib import Path

import httpx

# vLLM's API server and engine core each import vLLM: ~100 s measured on a loaded 2-core CPU
SERVER_START_S = 600


def free_port() -> int:
    """A port nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, what: str = "server") -> None:
    """Return once ``url``/health answers 200; raise with the log's tail when ``proc`` exits or the wait runs out."""
    deadline = time.monotonic() + SERVER_START_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not healthy within {SERVER_START_S} s:\n{log.read_text()[-3000:]}")
        time.sleep(1)
