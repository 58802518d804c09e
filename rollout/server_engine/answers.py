"""Reading the token route's answers: log-probs (the route's floor for -inf undone), the weight version and the
adapter each was generated with (package docstring)."""
from __future__ import annotations

import math

from rollout.prompt_logprobs import read_prompt_logprobs
from rollout.server_engine.errors import ServerEngineError

_CLAMPED = -9999.0  # the route's floor for -inf / NaN log-probs (serving.py: _clamp_logprob)


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


def _unclamp(x: float) -> float:
    return -math.inf if x == _CLAMPED else float(x)


def parse_sample(url: str, s: int, resp: dict, k: int, version: str | None, adapter: str | None = None):
    """One ``generate`` answer (sample ``s``): (token ids, log-probs, finish reason, top-k ids, top-k log-probs);
    the top ``k`` re-sorted by log-prob (package docstring); an answer of another weight version or adapter is
    refused. ``version`` None: the caller reads the answer's per-token versions itself (in-flight updates)."""
    def bad(msg: str) -> ServerEngineError:
        return ServerEngineError(f"vLLM server at {url}, sample {s}: {msg}")

    choices = resp.get("choices") or []
    if len(choices) != 1:
        raise bad(f"expected 1 choice, got {len(choices)}")
    c = choices[0]
    if c.get("finish_reason") not in ("stop", "length"):
        raise bad(f"finished with reason {c.get('finish_reason')!r} (expected 'stop' or 'length')")
    if version is not None:
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


def parse_prompt_logprobs(url: str, k: int, seq: list[int], resp: dict, topk: int, version: str,
                          adapter: str | None = None):
    """One ``score`` answer (the sequence ``k`` of the batch): the prompt log-probs of ``seq``'s tokens and their
    top ``topk``; an answer of another weight version or adapter is refused."""
    def bad(msg: str) -> ServerEngineError:
        return ServerEngineError(f"vLLM server at {url}, scored sequence {k}: {msg}")

    _check_version((resp.get("choices") or [{}])[0], version, bad)
    _check_adapter(resp, adapter, bad)
    plp = resp.get("prompt_logprobs")
    # JSON: token ids as string keys, the route's -9999 floor for -inf
    positions = [None if pos is None else {int(tid): (_unclamp(e["logprob"]), e["rank"]) for tid, e in pos.items()}
                 for pos in plp] if isinstance(plp, list) else None
    return read_prompt_logprobs(seq, positions, topk, bad)
