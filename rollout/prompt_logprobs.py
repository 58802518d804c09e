"""One scored sequence read from vLLM's prompt log-probs, as the colocated and the server engine receive them."""
from __future__ import annotations

from typing import Sequence


def read_prompt_logprobs(seq: Sequence[int], positions: Sequence, topk: int, bad) -> tuple[list, list, list]:
    """One scored sequence from vLLM's prompt log-probs, as both engines receive them.

    ``positions[t]``: ``{token id: (logprob, rank)}`` of the actual token and the top ``topk`` by
    rank (``None`` at t = 0, which has nothing to condition on). Returns the log-probs of tokens
    1.. and, with ``topk``, each position's top-k ids and log-probs, most likely first.
    ``bad(msg)`` builds the exception for an answer that does not fit the sequence.
    """
    if positions is None or len(positions) != len(seq):
        raise bad(f"{None if positions is None else len(positions)} prompt log-prob positions for {len(seq)} tokens")
    lps, top_ids, top_lps = [], [], []
    for t in range(1, len(seq)):
        pos = positions[t] or {}
        if seq[t] not in pos:
            raise bad(f"position {t} has no log-prob for its token {seq[t]}")
        lps.append(pos[seq[t]][0])
        if topk:
            top = sorted((rank, tid, lp) for tid, (lp, rank) in pos.items() if rank <= topk)
            if len(top) != topk:
                raise bad(f"position {t}: {len(top)} top log-probs, expected {topk}")
            top_ids.append([tid for _, tid, _ in top])
            top_lps.append([lp for _, _, lp in top])
    return lps, top_ids, top_lps
