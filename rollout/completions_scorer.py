"""Scoring given token ids on any vLLM OpenAI-compatible server (``vllm serve <model>``), through its public
``POST /v1/completions`` with prompt log-probs (``teacher.engine: vllm_url``).

Unlike ``rollout.server_engine`` (a `parityrl serve` server: the token route, weight pushes, its worker extension),
this client needs nothing but the API every vLLM server has, and it only scores (``RolloutEngine.score``):

- Request (vLLM's ``CompletionRequest``, ``vllm/entrypoints/openai/completion/protocol.py``): ``prompt`` = the
  sequences' token ids (``list[list[int]]``: no tokenizer runs on them), ``max_tokens: 1`` (a prefill, and one
  sampled token nobody reads), ``prompt_logprobs: k`` (vLLM's extra parameter) and ``return_token_ids`` (the ids
  the server read come back and must be the ones sent: a server that truncated or re-encoded them is refused).
- Answer (``CompletionResponse``): one choice per prompt, ``index`` in prompt order; ``choices[i].prompt_logprobs``
  has one entry per prompt token, ``null`` at position 0 (nothing to condition on), else ``{"<id>": {"logprob",
  "rank", "decoded_token"}}`` holding the prompt's own token whatever its rank, and the top ``k`` by rank. vLLM
  applies no sampling processor to prompt tokens, so whatever the server's generation config they are taken at
  temperature 1 -- but what they are depends on the server's ``--logprobs-mode``: log_softmax of the logits with
  ``raw_logprobs`` (the default) or ``processed_logprobs``, the logits THEMSELVES with ``raw_logits`` or
  ``processed_logits`` (``gpu_model_runner._get_prompt_logprobs_dict``: ``scores = logits.to(torch.float32)`` in
  those modes; ``v1/worker/gpu/sample/prompt_logprob.py``: ``logits_mode``). Such a server is refused
  (``logits_problem``). ``-inf`` comes as -9999.0 (``clamp_prompt_logprobs``).
- Start: ``GET /health`` until it answers (``wait_for_health``), then ``GET /v1/models``: the served model (its
  ``root``: the path or hub id the server loaded) and its ``max_model_len``, which must hold the caller's sequences;
  then one scoring request of a short probe, whose values must be log-probs (``logits_problem``).
  What the server runs (its weights, dtype) cannot be read through this API: the caller checks the model's name.
"""
from __future__ import annotations

import math
import urllib.parse
from typing import Any, Sequence

from rollout.base import EngineUnavailable
from rollout.prompt_logprobs import read_prompt_logprobs
from rollout.requests import validate_score_request
from rollout.server_engine import MalformedAnswer, ServerEngineError, ServerKeys, UnusableServer, wait_for_health
from rollout.types import Scored

_CLAMPED = -9999.0  # vLLM's floor for -inf prompt log-probs in JSON (clamp_prompt_logprobs)

# How a server in a logits mode is told from one returning log-probs. Its mode is not in any production endpoint
# (/v1/models has no such field; /server_info, which dumps the config, exists only with VLLM_SERVER_DEV_MODE=1), and
# the two differ only by each position's normaliser, logsumexp over the whole vocabulary, which the API does not
# return (prompt_logprobs is capped by the server's --max-logprobs, 20 by default). What does hold for any answer:
# the returned values belong to DISTINCT ids of one position, so as log-probs their probabilities sum to at most 1
# (vLLM's float32 log_softmax: within ~1e-6). That bound never refuses a log-prob server; logits break it as soon as
# the returned logits at one position have a logsumexp above 0, i.e. whenever a language model's top logit there is
# positive (the connect probe asks for the top-1, so each position's largest logit is among the values). A model
# whose logits are all <= 0 at every position scored would pass unnoticed; the check runs on every answer, not
# only at connect, so one such position anywhere in a run is enough to stop it.
_MASS_SLACK = 1e-3  # in log space: exp(1e-3) - 1 = 0.1 % over a mass of 1, far above float32 rounding
_PROBE = list(range(8))  # ids every vocabulary has
_LOGITS_MODES = "`--logprobs-mode raw_logits` or `processed_logits`"


def endpoint_url_problem(url: str) -> str | None:
    """What ``url`` should be instead (the text after "expected"), or None for a server root
    ``http(s)://HOST[:PORT][/PREFIX]``. The URL is where ``/health`` and ``/v1/...`` are, so one ending in ``/v1`` is
    refused."""
    parts = urllib.parse.urlsplit(url or "")
    try:
        port_ok = parts.port is not None or ":" not in parts.netloc.rsplit("]", 1)[-1]
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok or parts.query or parts.fragment:
        return "http(s)://HOST[:PORT], e.g. http://127.0.0.1:8000 (the vLLM server's root)"
    if parts.path.rstrip("/").endswith("/v1"):
        return "the server's root, without /v1 (the client asks /health and /v1/completions under it)"
    return None


def parse_endpoint_url(url: str, key: str = "teacher.server_url") -> str:
    """``url`` without a trailing '/'; ValueError naming ``key`` unless ``endpoint_url_problem`` accepts it."""
    problem = endpoint_url_problem(url)
    if problem:
        raise ValueError(f"{key} = {url!r}: expected {problem}")
    return url.rstrip("/")


def completion_body(model: str, sequences: Sequence[Sequence[int]], topk: int) -> dict[str, Any]:
    """The ``/v1/completions`` request scoring ``sequences`` (module docstring)."""
    return {"model": model, "prompt": [[int(t) for t in seq] for seq in sequences], "max_tokens": 1,
            "temperature": 1.0, "prompt_logprobs": int(topk), "return_token_ids": True}


def unclamp(x: float) -> float:
    return -float("inf") if x == _CLAMPED else float(x)


def logits_problem(positions: Sequence) -> str | None:
    """Why the values of one sequence's prompt log-prob ``positions`` (``{id: (value, rank)}`` per position, None at
    0) cannot be log-probs, or None: at some position the ids' probabilities sum to more than 1 (``_MASS_SLACK``)."""
    for t, pos in enumerate(positions):
        values = [v for v, _ in (pos or {}).values() if v > -math.inf]
        if not values:
            continue
        top = max(values)
        lse = top + math.log(sum(math.exp(v - top) for v in values))
        if lse > _MASS_SLACK:
            return (f"position {t}: the values of {len(values)} distinct ids ({', '.join(f'{v:.4g}' for v in values[:4])}"
                    f"{', ...' if len(values) > 4 else ''}) are probabilities summing to {math.exp(lse):.4g} > 1 "
                    f"as log-probs: they are logits, as vLLM returns them with {_LOGITS_MODES}; start the server "
                    "without --logprobs-mode (raw_logprobs, the default) or with processed_logprobs")
    return None


def read_completion_scores(resp: Any, sequences: Sequence[Sequence[int]], topk: int, bad) -> Scored:
    """``Scored`` from a ``/v1/completions`` answer to ``completion_body(..., sequences, topk)``; ``bad(msg)`` builds
    the exception for an answer that does not fit the request."""
    choices = resp.get("choices") if isinstance(resp, dict) else None
    if not isinstance(choices, list) or len(choices) != len(sequences):
        raise bad(f"{len(choices) if isinstance(choices, list) else 'no'} choices for {len(sequences)} sequences")
    rows = []
    for k, (seq, choice) in enumerate(zip(sequences, sorted(choices, key=lambda c: c.get("index", 0)))):
        def bad_k(msg: str, k=k):
            return bad(f"sequence {k}: {msg}")

        read = choice.get("prompt_token_ids")
        if read is not None and [int(t) for t in read] != [int(t) for t in seq]:
            raise bad_k(f"the server read {len(read)} ids {list(read)[:8]}..., not the {len(seq)} sent "
                        "(truncated or re-encoded)")
        plp = choice.get("prompt_logprobs")
        # JSON: token ids as string keys
        positions = [None if pos is None else {int(tid): (unclamp(e["logprob"]), e.get("rank"))
                                               for tid, e in pos.items()}
                     for pos in plp] if isinstance(plp, list) else None
        problem = None if positions is None else logits_problem(positions)
        if problem:
            raise bad_k(problem)
        rows.append(read_prompt_logprobs(seq, positions, topk, bad_k))
    return Scored.from_rows(rows)


class CompletionsScorer:
    """A vLLM OpenAI-compatible server as a scorer of given ids (module docstring).

    url: the server's root, ``http(s)://HOST[:PORT][/PREFIX]`` (``parse_endpoint_url``).
    timeout_s: the start-up health wait and the limit of every request. connect_timeout_s: give up sooner when
        nothing accepts a connection. keys: the recipe keys its errors name and how its server is started.
    max_model_len: the caller's need (sequence + the one sampled token); the server's must be >= it.
    """

    # Nothing is generated and no weights are pushed: the RolloutEngine fields a scorer is asked for.
    pushes_weights = False
    streams_weights = False
    fp8_block_weights = False
    adapter_dtype = None

    def __init__(self, url: str, *, timeout_s: float, max_model_len: int | None = None,
                 connect_timeout_s: float | None = None, keys: ServerKeys) -> None:
        import httpx

        self.url, self.timeout_s, self.keys = parse_endpoint_url(url, keys.url), float(timeout_s), keys
        self.startup_wait_s = wait_for_health(self.url, self.timeout_s, connect_timeout_s=connect_timeout_s, keys=keys)
        self._client = httpx.Client(base_url=self.url, timeout=self.timeout_s)
        try:
            self.served = self._served_model()
            self.model, self.max_model_len = self.served["id"], self.served.get("max_model_len")
            if not isinstance(self.max_model_len, int) or (max_model_len and self.max_model_len < max_model_len):
                raise UnusableServer(f"vLLM server at {self.url}: max_model_len = {self.max_model_len!r}, expected an "
                                     f"integer >= {max_model_len} (the longest sequence scored, + the one token sampled)")
            self._check_logprobs_mode()
        except BaseException:
            self.close()
            raise

    def _served_model(self) -> dict[str, Any]:
        """The card of the model the server serves (``/v1/models``: its base model, not a LoRA adapter's)."""
        out = self._call("GET", "/v1/models", "list models")
        cards = [c for c in (out.get("data") or []) if isinstance(c, dict) and c.get("parent") is None] \
            if isinstance(out, dict) else []
        if len(cards) != 1 or not isinstance(cards[0].get("id"), str):
            raise UnusableServer(f"vLLM server at {self.url}: GET /v1/models answered {out!r:.300}; expected one "
                                 "served model (a vLLM OpenAI-compatible server)")
        return cards[0]

    def _check_logprobs_mode(self) -> None:
        """UnusableServer naming --logprobs-mode unless a probe's prompt log-probs (with each position's top-1) are
        log-probs (``logits_problem``)."""
        body = completion_body(self.model, [_PROBE], 1)
        resp = self._call("POST", "/v1/completions", "score a probe (log-probs, not logits)", json=body)

        def bad(msg: str) -> UnusableServer:
            return UnusableServer(f"vLLM server at {self.url}: its prompt log-probs of ids {_PROBE}: {msg}")

        read_completion_scores(resp, [_PROBE], 1, bad)

    def score(self, sequences: list[list[int]], topk: int = 0) -> Scored:
        """log p(x_t | x_<t) at temperature 1 of every token t >= 1 of each sequence (``RolloutEngine.score``)."""
        validate_score_request(sequences, self.max_model_len)
        resp = self._call("POST", "/v1/completions", f"score ({len(sequences)} sequences)",
                          json=completion_body(self.model, sequences, topk))

        def bad(msg: str) -> ServerEngineError:
            return ServerEngineError(f"vLLM server at {self.url}, /v1/completions with prompt_logprobs: {msg}")

        return read_completion_scores(resp, sequences, topk, bad)

    def _call(self, method: str, path: str, action: str, *, json: Any = None) -> Any:
        import httpx

        try:
            r = self._client.request(method, path, json=json)
        except httpx.TransportError as e:
            what = (f"did not answer within {self.timeout_s:g} s ({self.keys.timeout})"
                    if isinstance(e, httpx.TimeoutException) else f"is unreachable ({type(e).__name__}: {e})")
            raise EngineUnavailable(f"vLLM server at {self.url} {what} during {action} ({method} {path})") from None
        if r.status_code >= 400:
            raise ServerEngineError(f"vLLM server at {self.url}: {method} {path} ({action}) failed with HTTP "
                                    f"{r.status_code}: {r.text[:800]}")
        try:
            return r.json()
        except ValueError as e:
            raise MalformedAnswer(f"vLLM server at {self.url} answered {method} {path} ({action}) with a body that "
                                  f"is not JSON ({type(e).__name__}: {e}): cut short, or not a vLLM server") from None

    def close(self) -> None:
        """Close the HTTP client; the server keeps running. Safe to call twice."""
        self._client.close()
