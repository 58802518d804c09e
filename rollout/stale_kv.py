"""The stale-KV alarm: no request after a weight update may read prompt KV the old weights computed.

vLLM's prefix cache keys a KV block by its tokens, not by the weights that computed it: after a weight or adapter
update, a prompt seen before is served the old weights' KV unless ``reset_prefix_cache()`` emptied the cache. Two
peers lost runs to this silently: NeMo-RL never reset the cache across 17 updates (NVIDIA-NeMo/RL PR #4018), and its
reset after an in-flight update was a no-op because vLLM refuses ``reset_prefix_cache`` while requests run
(PR #3929). The engine raises when vLLM *says* it refused; this alarm catches the reset that reports success and
empties nothing, or a path that never calls it.

The test is vLLM's own count, ``RequestOutput.num_cached_tokens`` (prompt tokens read from the cache, set when the
request is first scheduled). In the first batch of requests after a reset, the first request scheduled finds the
cache empty, so at least one request reads nothing; later requests may legitimately read blocks the batch itself
computed (a group's shared prompt, a common chat-template prefix). If *every* request of that first batch read
cached tokens, some came from before the update: stale. The check is sound (a healthy engine never trips it) and
costs nothing (one integer per request); it is not complete: a stale cache that covers only some of the batch's
prompts is not seen by it, which ``parityrl doctor``'s ``prefix_cache`` check (its sync leg) measures instead.

Requests with prompt log-probs (the engine's ``score``) skip reading the cache but may fill it with the new
weights' KV, after which a read is no longer evidence: a score first spends the check for that update.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["StaleKVError", "StaleKVAlarm"]


class StaleKVError(RuntimeError):
    """Prompt KV computed under older weights was served after a weight update."""


class StaleKVAlarm:
    """Armed by every weight or adapter update (``updated``); the next batch of generate requests disarms it,
    raising ``StaleKVError`` when every one of its requests read the prefix cache."""

    def __init__(self) -> None:
        self.armed = True  # a new engine's cache is empty: its first batch is checked too
        self.update = "the engine's start"
        self.checked = 0  # batches checked, so a test can tell the alarm looked
        self.last: list[int] = []  # each request's cached prompt tokens in the last batch generated

    def updated(self, what: str) -> None:
        """A weight or adapter update has just reset the cache."""
        self.armed, self.update = True, what

    def spent(self) -> None:
        """Requests that fill the cache without reading it ran first (``score``): nothing left to check."""
        self.armed = False

    def check(self, cached_tokens: Sequence[int | None]) -> None:
        """``cached_tokens``: each request's ``num_cached_tokens`` in the batch just generated."""
        counts = self.last = [int(c or 0) for c in cached_tokens]
        if not self.armed or not counts:
            return
        self.armed = False
        self.checked += 1
        if min(counts) > 0:
            raise StaleKVError(
                f"stale KV: all {len(counts)} requests of the first batch after {self.update} read prompt tokens "
                f"from vLLM's prefix cache ({min(counts)} to {max(counts)} each), so KV computed under the previous "
                "weights was reused; reset_prefix_cache() reported success but left the cache in place (a reset "
                "while requests ran, or an update path that skips it). Its log-probs are not the current policy's")
