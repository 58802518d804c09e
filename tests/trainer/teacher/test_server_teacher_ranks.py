"""A teacher server under several data-parallel ranks (issue 57 item 2): every rank reads the weights the server
loaded, none pushes or sets a version, so no rank opens a weight transfer (one NCCL group per rank as the server's
rank 0 on CUDA) and no rank's version check fails another's.

The server's RL routes are vLLM's own (``vllm.entrypoints.rl.online.api_router``: ``/weight_info``,
``/update_weight_version``, ``/init_weight_transfer_engine``, ``/get_world_size``, ...) over a stand-in for its engine
client that records each call and holds the weight version as vLLM's engine core does (``"default"`` until a push sets
one); ``parityrl serve``'s own answers (``/health``, the worker extension's settings, the token route's prompt
log-probs) are written here. The real server: tests/rollout/test_server_engine.py's slow tier.
"""
import inspect
import threading
import time

import pytest

from rollout.server_engine import ServerEngineError, UnusableServer
from rollout.server_engine.engine import SERVED_VERSION
from trainer.config import RunConfig, TeacherConfig
from trainer.sampling.engines import connect_shared_server
from trainer.teacher.teacher import start_teacher_engine


class EngineClient:
    """What vLLM's RL routes ask of the engine client (``AsyncLLM``), recorded; the version as ``EngineCore``."""

    def __init__(self) -> None:
        self.version, self.calls = SERVED_VERSION, []

    async def get_weight_version(self):
        self.calls.append("get_weight_version")
        return self.version

    async def update_weight_version(self, new_version):
        self.calls.append("update_weight_version")
        self.version = new_version

    async def init_weight_transfer_engine(self, request):
        self.calls.append("init_weight_transfer_engine")

    async def get_world_size(self, *args, **kwargs):
        self.calls.append("get_world_size")
        return 1


def _server(model_dir: str):
    import uvicorn
    from fastapi import FastAPI, Request
    from vllm.entrypoints.rl.online.api_router import router

    app = FastAPI()
    app.include_router(router)
    app.state.engine_client = client = EngineClient()

    @app.get("/health")
    async def health():
        return {}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request):
        assert (await request.json())["method"] == "parityrl_server_info"
        return {"results": [{"model": model_dir, "dtype": "bfloat16", "max_model_len": 256,
                             "logprobs_mode": "processed_logprobs", "max_logprobs": 20,
                             "weight_transfer_backend": "parityrl_file", "packed_modules": {},
                             "tensor_parallel_size": 1, "world_size": 1, "rank": 0, "prefix_caching": True,
                             "device": "cpu", "lora": None}]}

    @app.post("/inference/v1/generate")
    async def generate(request: Request):
        ids = (await request.json())["token_ids"]
        return {"model": "teacher", "prompt_logprobs": [None] + [{str(t): {"logprob": -1.0, "rank": 1}}
                                                                 for t in ids[1:]],
                "choices": [{"token_ids": [1], "finish_reason": "length",
                             "weight_versions": [{"version": client.version, "start": 0}]}]}

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, client, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


@pytest.fixture
def teacher_server(tiny_model_dir):
    server, client, url = _server(tiny_model_dir)
    yield client, url
    server.should_exit = True


class Ranks:
    """Rank ``rank`` of ``world``: the collectives of ``connect_shared_server`` for one process playing each rank."""

    def __init__(self, rank: int, world: int = 2) -> None:
        self.rank, self.world = rank, world

    def raise_together(self, error) -> None:
        if error is not None:
            raise error


def test_vllm_starts_with_the_version_a_served_client_expects():
    from vllm.v1.engine.core import EngineCore

    assert f'self._weight_version = "{SERVED_VERSION}"' in inspect.getsource(EngineCore.__init__)


def test_every_rank_reads_the_teacher_server_and_none_sets_it_up(teacher_server, tiny_model_dir):
    client, url = teacher_server
    cfg = RunConfig()
    cfg.teacher = TeacherConfig(path="builtin:tiny-teacher", engine="server", server_url=url, server_timeout_s=10)
    engines = [start_teacher_engine(cfg, tiny_model_dir, max_model_len=100, device="cpu", dp=Ranks(r))
               for r in (0, 1)]
    try:
        # no transfer opened, no version set: only read, once per rank
        assert client.calls == ["get_weight_version", "get_weight_version"]
        assert all(e.served_weights and not e.pushes_weights and e._transfer is None for e in engines)
        assert [e.score([[3, 4, 5]]).logprobs for e in engines] == [[[-1.0, -1.0]]] * 2
        for call in (lambda e: e.load_weights([]), lambda e: e.follow_push()):
            with pytest.raises(RuntimeError, match="reads the weights the server loaded"):
                call(engines[1])
        # a trainer pushing into the teacher's server: every rank refuses what it answers from then on
        client.version = "parityrl-student-1"
        for e in engines:
            with pytest.raises(ServerEngineError, match="weight version.*'parityrl-student-1'"):
                e.score([[3, 4, 5]])
    finally:
        for e in engines:
            e.close()
    with pytest.raises(UnusableServer, match=r"holds weight version 'parityrl-student-1', not the weights it loaded "
                                             r"\('default'\).*teacher.server_url a student's server"):
        start_teacher_engine(cfg, tiny_model_dir, max_model_len=100, device="cpu", dp=Ranks(0))


def test_a_shared_server_is_joined_by_rank_0_first_and_a_failure_stops_every_rank():
    order = []

    class Client:
        def __init__(self, rank, first):
            order.append((rank, first))
            self.closed = False

        def close(self):
            self.closed = True

    class Collective(Ranks):
        """A rank whose ``raise_together`` calls are recorded; ``other_fails``: the call at which another rank
        passes an error (raise_together then raises on this one too)."""

        def __init__(self, rank, other_fails=None):
            super().__init__(rank)
            self.other_fails, self.calls = other_fails, 0

        def raise_together(self, error):
            order.append((self.rank, "together"))
            self.calls += 1
            if error is not None:
                raise error
            if self.calls == self.other_fails:
                raise RuntimeError("data-parallel rank(s) [1] failed")

    made = [connect_shared_server(Collective(r), lambda first, r=r: Client(r, first)) for r in (0, 1)]
    assert not any(c.closed for c in made)
    assert order == [(0, True), (0, "together"), (0, "together"), (1, "together"), (1, False), (1, "together")]

    def refuse(first):
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        connect_shared_server(Collective(0), refuse)
    # rank 1 fails after rank 0 connected: rank 0 stops too, its client closed
    order.clear()
    kept = []
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] failed"):
        connect_shared_server(Collective(0, other_fails=2), lambda first: kept.append(Client(0, first)) or kept[-1])
    assert kept[0].closed and order == [(0, True), (0, "together"), (0, "together")]
