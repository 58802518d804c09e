"""Scoring on a plain vLLM OpenAI-compatible server (rollout/completions_scorer.py).

Fast tier: the request is validated by vLLM's own ``CompletionRequest`` and the answers are built with vLLM's own
response classes and serialised as its API router does (``JSONResponse(content=response.model_dump())``), served by
a stand-in HTTP server: a misread field or shape fails here. Slow tier (tests/trainer/teacher/test_vllm_url_teacher.py):
a real ``vllm serve``.
"""
import json
import math
import threading
import typing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from starlette.responses import JSONResponse
from vllm.config.model import LogprobsMode
from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponse, CompletionResponseChoice
from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList, UsageInfo
from vllm.logprobs import Logprob
from vllm.v1.sample.sampler import Sampler

from rollout.base import EngineUnavailable
from rollout.completions_scorer import CompletionsScorer, completion_body, endpoint_url_problem, read_completion_scores
from rollout.server_engine import ServerEngineError, ServerKeys, UnusableServer

VOCAB = 50
# the recipe keys the scorer's errors name: its caller's (the teacher's, trainer/teacher/teacher.py)
KEYS = ServerKeys(url="my.url", timeout="my.timeout_s", connect_timeout="my.connect_timeout_s", start="`vllm serve m`")


def true_logits(prefix: list[int]) -> torch.Tensor:
    """The stand-in model's logits [VOCAB] after ``prefix``, float32: positive at the top, as a language model's
    (token 7 impossible after 3)."""
    v = torch.arange(VOCAB)
    logits = (3.0 - ((v * 13 + len(prefix) * 5 + prefix[-1]) % 17) / 4.0).float()
    if prefix[-1] == 3:
        logits[7] = -math.inf
    return logits


def scores(prefix: list[int], mode: str = "raw_logprobs") -> torch.Tensor:
    """What vLLM returns as the prompt "log-probs" of the position after ``prefix`` under ``--logprobs-mode mode``
    (gpu_model_runner._get_prompt_logprobs_dict): the logits in float32 in a logits mode, else the sampler's
    log_softmax (no sampling processor on prompt tokens)."""
    logits = true_logits(prefix)[None]
    return (logits.to(torch.float32) if mode in ("raw_logits", "processed_logits")
            else Sampler.compute_logprobs(logits))[0]


def true_logprob(prefix: list[int], token: int) -> float:
    return float(scores(prefix)[token])


def vllm_prompt_logprobs(ids: list[int], k: int, mode: str = "raw_logprobs") -> list:
    """vLLM's ``RequestOutput.prompt_logprobs`` for ``ids``: None, then the actual token and the top k by rank."""
    out = [None]
    for t in range(1, len(ids)):
        s = scores(ids[:t], mode)
        lps = {v: float(s[v]) for v in range(VOCAB)}
        order = sorted(lps, key=lambda v: (-lps[v], v))
        keep = set(order[:k]) | {ids[t]}
        out.append({v: Logprob(logprob=lps[v], rank=order.index(v) + 1, decoded_token=f"<{v}>") for v in keep})
    return out


def vllm_json(model) -> dict:
    """What vLLM's API router sends for a response model (completion/api_router.py, models/api_router.py)."""
    return json.loads(JSONResponse(content=model.model_dump()).body)


def completion_answer(body: dict, *, drop_prompt_logprobs=False, read_ids=None, mode="raw_logprobs") -> dict:
    from vllm.entrypoints.generate.base.serving import clamp_prompt_logprobs

    req = CompletionRequest.model_validate(body)  # the request must be one vLLM accepts ...
    params = req.to_sampling_params(max_tokens=req.max_tokens)
    assert params.prompt_logprobs == body["prompt_logprobs"] and params.max_tokens == 1  # ... read as meant
    prompts = req.prompt if isinstance(req.prompt[0], list) else [req.prompt]
    choices = [CompletionResponseChoice(
        index=i, text="x", finish_reason="length",
        prompt_logprobs=None if drop_prompt_logprobs else clamp_prompt_logprobs(vllm_prompt_logprobs(p, req.prompt_logprobs, mode)),
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
    # the connect probe (its top-1 too: log-probs, not logits), then one request for the batch
    assert server.requests == [completion_body("teacher", [list(range(8))], 1), completion_body("teacher", SEQS, 0)]
    scorer.close()
    scorer.close()


def test_a_server_with_a_short_context_or_no_prompt_logprobs_is_refused(stand_in):
    with pytest.raises(UnusableServer, match=r"max_model_len = 32, expected an integer >= 129"):
        CompletionsScorer(stand_in(max_model_len=32).url, timeout_s=5, max_model_len=129, keys=KEYS)
    # refused at connect: the probe that checks log-probs against logits gets none
    with pytest.raises(UnusableServer, match=r"its prompt log-probs of ids \[0, 1, .*: sequence 0: None prompt log-prob"):
        CompletionsScorer(stand_in(drop_prompt_logprobs=True).url, timeout_s=5, keys=KEYS)
    # ... and an answer without them later is refused as a failed request
    body = completion_body("teacher", SEQS, 0)
    with pytest.raises(ServerEngineError, match="sequence 0: None prompt log-prob"):
        read_completion_scores(completion_answer(body, drop_prompt_logprobs=True), SEQS, 0, ServerEngineError)


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


@pytest.mark.parametrize("mode", typing.get_args(LogprobsMode))
def test_a_server_returning_logits_is_refused_at_connect_naming_the_flag(stand_in, mode):
    server = stand_in(mode=mode)
    if mode in ("raw_logprobs", "processed_logprobs"):
        scorer = CompletionsScorer(server.url, timeout_s=5, keys=KEYS)
        assert scorer.score(SEQS, topk=2).logprobs == [expected(s) for s in SEQS]
        scorer.close()
        return
    with pytest.raises(UnusableServer, match=rf"vLLM server at {server.url}: its prompt log-probs of ids .*: "
                                             r"sequence 0: position 1: .* summing to .* > 1 as log-probs: they are "
                                             r"logits, as vLLM returns them with `--logprobs-mode raw_logits` or "
                                             r"`processed_logits`"):
        CompletionsScorer(server.url, timeout_s=5, keys=KEYS)


def test_every_answer_is_checked_and_a_whole_distribution_passes():
    # an answer in a logits mode is refused wherever it comes, not only at connect
    body = completion_body("teacher", SEQS, 2)
    with pytest.raises(ValueError, match="sequence 0: position 1: .* are logits"):
        read_completion_scores(completion_answer(body, mode="raw_logits"), SEQS, 2, ValueError)
    # log-probs of every id of a position sum to 1 up to float32 rounding: the bound does not refuse them
    whole = completion_body("teacher", SEQS, VOCAB)
    scored = read_completion_scores(completion_answer(whole), SEQS, VOCAB, ValueError)
    mass = [math.fsum(math.exp(x) for x in row) for rows in scored.topk_logprobs for row in rows]
    assert all(abs(m - 1) < 1e-5 for m in mass) and max(mass) > 1 - 1e-6
