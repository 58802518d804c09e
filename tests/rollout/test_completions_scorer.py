"""Scoring on a plain vLLM OpenAI-compatible server (rollout/completions_scorer.py).

Fast tier: the request is validated by vLLM's own ``CompletionRequest`` and the answers are built with vLLM's own
response classes and serialised as its API router does (``JSONResponse(content=response.model_dump())``), served by
a stand-in HTTP server: a misread field or shape fails here. Slow tier (tests/trainer/teacher/test_vllm_url_teacher.py):
a real ``vllm serve``.
"""
import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from starlette.responses import JSONResponse
from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponse, CompletionResponseChoice
from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList, UsageInfo
from vllm.logprobs import Logprob

from rollout.base import EngineUnavailable
from rollout.completions_scorer import CompletionsScorer, completion_body, endpoint_url_problem, read_completion_scores
from rollout.server_engine import ServerEngineError, ServerKeys, UnusableServer

VOCAB = 50
# the recipe keys the scorer's errors name: its caller's (the teacher's, trainer/teacher/teacher.py)
KEYS = ServerKeys(url="my.url", timeout="my.timeout_s", connect_timeout="my.connect_timeout_s", start="`vllm serve m`")


def true_logprob(prefix: list[int], token: int) -> float:
    """The stand-in model: a distribution over VOCAB ids that depends on the prefix (token 7 impossible after 3)."""
    if prefix[-1] == 3 and token == 7:
        return -math.inf
    return -0.5 - ((token * 13 + len(prefix) * 5 + prefix[-1]) % 17) / 4.0


def vllm_prompt_logprobs(ids: list[int], k: int) -> list:
    """vLLM's ``RequestOutput.prompt_logprobs`` for ``ids``: None, then the actual token and the top k by rank."""
    out = [None]
    for t in range(1, len(ids)):
        lps = {v: true_logprob(ids[:t], v) for v in range(VOCAB)}
        order = sorted(lps, key=lambda v: (-lps[v], v))
        keep = set(order[:k]) | {ids[t]}
        out.append({v: Logprob(logprob=lps[v], rank=order.index(v) + 1, decoded_token=f"<{v}>") for v in keep})
    return out


def vllm_json(model) -> dict:
    """What vLLM's API router sends for a response model (completion/api_router.py, models/api_router.py)."""
    return json.loads(JSONResponse(content=model.model_dump()).body)


def completion_answer(body: dict, *, drop_prompt_logprobs=False, read_ids=None) -> dict:
    from vllm.entrypoints.generate.base.serving import clamp_prompt_logprobs

    req = CompletionRequest.model_validate(body)  # the request must be one vLLM accepts ...
    params = req.to_sampling_params(max_tokens=req.max_tokens)
    assert params.prompt_logprobs == body["prompt_logprobs"] and params.max_tokens == 1  # ... read as meant
    prompts = req.prompt if isinstance(req.prompt[0], list) else [req.prompt]
    choices = [CompletionResponseChoice(
        index=i, text="x", finish_reason="length",
        prompt_logprobs=None if drop_prompt_logprobs else clamp_prompt_logprobs(vllm_prompt_logprobs(p, req.prompt_logprobs)),
        prompt_token_ids=read_ids or p if req.return_token_ids else None, token_ids=[1])
        for i, p in enumerate(prompts)]
    return vllm_json(CompletionResponse(model=req.model, choices=choices[::-1],  # the index, not the order, counts
                                        usage=UsageInfo(prompt_tokens=1, total_tokens=2, completion_tokens=1)))


class StandIn:
    """A stand-in vLLM OpenAI server on a free local port; ``answers`` tunes what it says."""

    def __init__(self, max_model_len=64, root="/models/teacher", **answers):
        self.answers, self.requests = answers, []
        models = vllm_json(ModelList(data=[ModelCard(id="teacher", root=root, max_model_len=max_model_len)]))
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.send(200, {} if self.path == "/health" else models)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.requests.append(body)
                self.send(200, completion_answer(body, **outer.answers))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stand_in():
    servers = []

    def start(**kw):
        servers.append(StandIn(**kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


SEQS = [[1, 2, 3, 7, 4], [5, 6, 9]]


def expected(seq):
    return [true_logprob(seq[:t], seq[t]) for t in range(1, len(seq))]


def test_request_and_answer_parse_to_the_log_probs_of_every_token():
    body = completion_body("teacher", SEQS, topk=2)
    resp = completion_answer(body)
    assert list(resp["choices"][0]["prompt_logprobs"][1]) == [str(k) for k in resp["choices"][0]["prompt_logprobs"][1]]
    scored = read_completion_scores(resp, SEQS, 2, ValueError)
    # -inf (token 7 after 3) comes as vLLM's -9999 and is mapped back
    assert scored.logprobs == [expected(s) for s in SEQS] and scored.logprobs[0][2] == -math.inf
    for seq, ids, lps in zip(SEQS, scored.topk_ids, scored.topk_logprobs):
        for t, (row_ids, row_lps) in enumerate(zip(ids, lps), start=1):
            want = sorted(range(VOCAB), key=lambda v: (-true_logprob(seq[:t], v), v))[:2]
            assert row_ids == want and row_lps == [true_logprob(seq[:t], v) for v in want]


@pytest.mark.parametrize("answer, why", [
    (lambda b: completion_answer(b, drop_prompt_logprobs=True), "sequence 0: None prompt log-prob positions"),
    (lambda b: completion_answer(b, read_ids=[1, 2]), r"sequence 0: the server read 2 ids \[1, 2\]"),
    (lambda b: {**completion_answer(b), "choices": []}, "0 choices for 2 sequences"),
])
def test_answers_that_do_not_fit_are_refused(answer, why):
    with pytest.raises(ValueError, match=why):
        read_completion_scores(answer(completion_body("teacher", SEQS, 0)), SEQS, 0, ValueError)


def test_the_scorer_against_a_stand_in_server(stand_in):
    server = stand_in()
    scorer = CompletionsScorer(server.url + "/", timeout_s=5, max_model_len=16, keys=KEYS)
    assert (scorer.model, scorer.max_model_len, scorer.served["root"]) == ("teacher", 64, "/models/teacher")
    scored = scorer.score(SEQS, topk=0)
    assert scored.logprobs == [expected(s) for s in SEQS] and scored.topk_ids == [[], []]
    assert server.requests == [completion_body("teacher", SEQS, 0)]  # one request for the batch
    scorer.close()
    scorer.close()


def test_a_server_with_a_short_context_or_no_prompt_logprobs_is_refused(stand_in):
    with pytest.raises(UnusableServer, match=r"max_model_len = 32, expected an integer >= 129"):
        CompletionsScorer(stand_in(max_model_len=32).url, timeout_s=5, max_model_len=129, keys=KEYS)
    scorer = CompletionsScorer(stand_in(drop_prompt_logprobs=True).url, timeout_s=5, keys=KEYS)
    with pytest.raises(ServerEngineError, match="/v1/completions with prompt_logprobs: sequence 0: None prompt log-prob"):
        scorer.score(SEQS)


def test_a_url_where_nothing_listens_is_unavailable():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(EngineUnavailable, match=f"vLLM server at {url} did not become healthy within 1 s "
                                                r"\(my.timeout_s\).* Start it with `vllm serve m` \(listening on my.url\)"):
        CompletionsScorer(url, timeout_s=1.0, keys=KEYS)


def test_endpoint_urls():
    assert endpoint_url_problem("http://127.0.0.1:8000") is None and endpoint_url_problem("https://h/prefix/") is None
    assert "without /v1" in endpoint_url_problem("http://h:8000/v1")
    for bad in ("127.0.0.1:8000", "ftp://h:1", "http://h:x", "", "http://h:1/?a=b"):
        assert endpoint_url_problem(bad).startswith("http(s)://HOST[:PORT]"), bad
