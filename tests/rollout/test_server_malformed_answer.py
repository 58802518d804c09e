"""A server that answers HTTP 200 with a body that is not JSON (cut short): one line naming the server and the route,
an ``EngineUnavailable`` -- so `parityrl train` stops with the engine's status 4, not exit 1 and a JSONDecodeError."""
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollout.base import EngineUnavailable
from rollout.server_engine import MalformedAnswer, ServerEngine, ServerEngineError, UnusableServer
from rollout.server_engine.engine import _run_coroutine
from rollout.server_engine.http_channel import _Http

CUT = b'{"results": [{"logprobs_mode": "processed_lo'  # a JSON answer that stops mid-string


def _json_server(body: bytes):
    """A server alive on GET /health that answers every POST with HTTP 200 and ``body`` (its exact length)."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)  # /health: alive
            self.end_headers()

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))  # the length of what is sent: no transport error
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


@pytest.fixture
def cut_server():
    httpd, url = _json_server(CUT)
    httpd.handle_error = lambda request, address: None  # a request the client abandoned after the first failure
    yield url
    httpd.shutdown()
    httpd.server_close()


def _check(msg: str, url: str, route: str) -> None:
    assert "\n" not in msg and url in msg and route in msg, msg
    assert "HTTP 200 but a body that is not JSON (44 bytes, JSONDecodeError" in msg and "processed_lo'" in msg, msg
    assert "parityrl serve" in msg and "--resume" in msg, msg


def test_a_cut_answer_at_start_is_an_unavailable_engine_naming_the_route(cut_server, tmp_path):
    with pytest.raises(MalformedAnswer) as e:
        ServerEngine(cut_server, model_dir=tmp_path, timeout_s=5)
    assert isinstance(e.value, EngineUnavailable) and isinstance(e.value, ServerEngineError)
    _check(str(e.value), cut_server, "POST /collective_rpc (server check)")


def test_a_cut_generate_answer_is_an_unavailable_engine_naming_the_route(cut_server):
    engine = object.__new__(ServerEngine)  # only the request fan-out is exercised
    engine.url, engine.timeout_s, engine.max_concurrency = cut_server, 5.0, 2
    engine._http = _Http(cut_server, 5.0)
    try:
        with pytest.raises(MalformedAnswer) as e:
            _run_coroutine(engine._post_all([{"request_id": "a"}, {"request_id": "b"}], action="generate (2 requests)"))
    finally:
        engine._http.close()
    _check(str(e.value), cut_server, "POST /inference/v1/generate (generate (2 requests))")


def test_parityrl_train_against_it_exits_4_with_one_line(cut_server, tiny_model_dir, tmp_path, capsys):
    from trainer.commands.train import run_train_command

    status = run_train_command("recipes/grpo_tiny.yaml", [
        "rollout.mode=server", f"rollout.server_url={cut_server}", "rollout.server_timeout_s=5",
        f"logging.run_dir={tmp_path / 'run'}", "logging.wandb.mode=disabled"], resume=False)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("parityrl:")]
    assert status == 4 and len(lines) == 1 and "Traceback" not in err, err
    _check(lines[0], cut_server, "POST /collective_rpc")


@pytest.mark.parametrize("body", [b"[]", b'{"results": "x"}', b'{"results": [{"dtype": "bfloat16"}]}',
                                  b'{"results": [{"logprobs_mode": "processed_logprobs", "dtype": "bfloat16", '
                                  b'"max_model_len": null, "weight_transfer_backend": "parityrl_file"}]}'])
def test_a_json_answer_of_another_shape_at_start_is_an_unusable_server(body, tmp_path):
    """JSON, but not parityrl_server_info's dict with its keys: one line naming the server, an EngineUnavailable
    (`parityrl train` exits 4), never a KeyError / AttributeError (exit 1)."""
    httpd, url = _json_server(body)
    try:
        with pytest.raises(UnusableServer) as e:
            ServerEngine(url, model_dir=tmp_path, timeout_s=5, max_model_len=88)
    finally:
        httpd.shutdown()
        httpd.server_close()
    msg = str(e.value)
    assert isinstance(e.value, EngineUnavailable) and "\n" not in msg and url in msg, msg
    assert "parityrl_server_info" in msg, msg
