"""The teacher's start check and schedule (trainer/teacher/teacher.py), with stand-in engines."""
import socket
import time

import httpx
import pytest

from rollout.base import EngineUnavailable
from rollout.completions_scorer import CompletionsScorer
from rollout.server_engine import UnusableServer
from rollout.types import Scored
from trainer.config import RunConfig, TeacherConfig
from trainer.teacher.teacher import (
    Teacher,
    check_prompt_logprobs,
    check_served_model,
    start_teacher_engine,
    teacher_dtype,
    teacher_server_keys,
)


class Answers:
    def __init__(self, logprobs=None, error=None):
        self.logprobs, self.error = logprobs, error

    def score(self, sequences, topk=0):
        if self.error:
            raise self.error
        return Scored([self.logprobs], [[]], [[]])


def cfg(**teacher) -> RunConfig:
    c = RunConfig()
    c.teacher = TeacherConfig(path="builtin:tiny-teacher", **teacher)
    return c


def test_an_engine_with_prompt_logprobs_passes():
    check_prompt_logprobs(Answers([-1.0, -2.0]), cfg(), [1, 2, 3])


@pytest.mark.parametrize("engine, why", [
    (Answers([]), r"returned \[\] for 3 tokens"),
    (Answers([-1.0, float("nan")]), r"returned \[-1.0, nan\] for 3 tokens"),
    (Answers(error=NotImplementedError("prompt_logprobs is not supported")),
     "NotImplementedError: prompt_logprobs is not supported"),
])
def test_an_engine_without_prompt_logprobs_is_refused(engine, why):
    with pytest.raises(EngineUnavailable, match=r"teacher.engine = 'vllm' \(builtin:tiny-teacher\): expected an engine "
                                                r"that returns prompt log-probs of given ids .*; " + why):
        check_prompt_logprobs(engine, cfg(), [1, 2, 3])


def test_teacher_parity_schedule_and_dtype():
    c = cfg()  # null: the probe's schedule (first 3 syncs, then every 2nd)
    t = Teacher(c, "unused", engine=None, dp=None, device="cpu")
    assert [s for s in range(1, 9) if t.parity_due(s)] == [1, 2, 3, 4, 6, 8]
    t.cfg = cfg(parity_every=3)
    assert [s for s in range(1, 9) if t.parity_due(s)] == [1, 3, 6]
    t.cfg = cfg(parity_every=0)
    assert not any(t.parity_due(s) for s in range(1, 9))
    assert teacher_dtype(c) == c.model.dtype and teacher_dtype(cfg(dtype="float32")) == "float32"


@pytest.fixture(params=["closed", "silent"])
def unanswering_url(request):
    """A local URL that does not answer: a closed port (connection refused), or one that accepts connections and
    never replies (a read timeout every attempt)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{s.getsockname()[1]}"
    if request.param == "closed":
        s.close()
    else:
        s.listen(16)
    yield url
    s.close()


@pytest.mark.parametrize("engine", ["server", "vllm_url"])
def test_a_teacher_url_that_does_not_answer_is_refused_naming_the_teacher_keys(tmp_path, engine, unanswering_url):
    url = unanswering_url
    c = cfg(engine=engine, server_url=url, server_timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailable) as e:
        start_teacher_engine(c, str(tmp_path), max_model_len=128, device="cpu")
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert msg.startswith(f"teacher.server_url = '{url}' (teacher.engine {engine}): vLLM server at {url} did not "
                          "become healthy within 2 s (teacher.server_timeout_s)"), msg
    assert "raise teacher.server_timeout_s" in msg and "listening on teacher.server_url" in msg
    assert "rollout." not in msg and "\n" not in msg, msg


def test_a_teacher_request_that_times_out_names_teacher_server_timeout_s():
    scorer = CompletionsScorer.__new__(CompletionsScorer)  # past its start-up: a request to a silent server
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        scorer.url, scorer.timeout_s = f"http://127.0.0.1:{s.getsockname()[1]}", 0.5
        scorer.keys = teacher_server_keys(cfg(engine="vllm_url", server_url=scorer.url))
        scorer._client = httpx.Client(base_url=scorer.url, timeout=0.5)
        scorer.model, scorer.max_model_len = "t", 64
        with pytest.raises(EngineUnavailable, match=r"did not answer within 0.5 s \(teacher.server_timeout_s\) during "
                                                    r"score \(1 sequences\) \(POST /v1/completions\)"):
            scorer.score([[1, 2, 3]])
        scorer.close()


def test_a_vllm_url_server_must_have_loaded_the_teacher_path(tmp_path):
    here = tmp_path / "teacher"
    here.mkdir()
    (tmp_path / "link").symlink_to(here)
    for card in ({"id": "t", "root": "Org/teacher"}, {"id": "t", "root": str(here)},
                 {"id": "t", "root": str(tmp_path / "link")}, {"id": "Org/teacher", "root": None}):
        check_served_model(card, "Org/teacher", str(here), "http://h:1")
    with pytest.raises(UnusableServer, match=r"teacher.server_url = 'http://h:1' \(teacher.engine vllm_url\): the "
                                             r"server loaded 'Org/other'; expected teacher.path's model \('Org/teacher'"):
        check_served_model({"id": "Org/teacher", "root": "Org/other"}, "Org/teacher", str(here), "http://h:1")
    with pytest.raises(UnusableServer, match="the server loaded '/elsewhere/teacher'"):
        check_served_model({"id": "t", "root": "/elsewhere/teacher"}, "Org/teacher", str(here), "http://h:1")


def test_check_prompt_logprobs_names_the_teacher_url():
    c = cfg(engine="vllm_url", server_url="http://h:1")
    with pytest.raises(EngineUnavailable, match=r"teacher.engine = 'vllm_url' \(builtin:tiny-teacher, "
                                                r"teacher.server_url = 'http://h:1'\): expected an engine that returns "
                                                r"prompt log-probs"):
        check_prompt_logprobs(Answers([]), c, [1, 2, 3])
