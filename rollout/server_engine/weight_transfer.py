"""vLLM's weight-transfer lifecycle over the server's RL routes (package docstring, Weight sync)."""
from __future__ import annotations

import socket
from typing import Any

import torch

from rollout.server_engine.errors import ServerEngineError
from rollout.server_engine.http_channel import _Http

NCCL_DEVICE = "cuda"


def nccl_ready(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The chunk on the trainer's GPU, with every kernel that wrote it finished.

    vLLM's packed NCCL producer packs the tensors on streams of its own
    (``weight_transfer/packed_tensor.py: packed_nccl_broadcast_producer``, ``with torch.cuda.stream(...)``), which
    do not wait for this one; the merged weights (and the host-to-device copy here) are queued on the current
    stream just before, so without this wait the broadcast could read them half written."""
    named = [(n, t.to(NCCL_DEVICE, non_blocking=True)) for n, t in named]
    torch.cuda.current_stream().synchronize()
    return named


class HTTPWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol (``weight_transfer/base.py``) over the RL routes.

    The same four calls as vLLM's ``HTTPVLLMWeightSyncClient`` (``clients.py``), with
    errors that name the server and the step of the push that failed.
    """

    def __init__(self, http: _Http) -> None:
        self.http = http

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.http.call("POST", "/init_weight_transfer_engine", "weight-transfer init", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.http.call("POST", "/start_weight_update", "weight push (start_weight_update)")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.http.call("POST", "/update_weights", "weight push (update_weights)", json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self.http.call("POST", "/finish_weight_update", "weight push (finish_weight_update)", json=body)

    def shutdown_weight_transfer_engine(self) -> None:
        self.http.call("POST", "/shutdown_weight_transfer_engine", "weight-transfer shutdown", timeout=10.0)


def _local_address_towards(host: str) -> str:
    """The address of this machine that ``host`` can reach (no packet is sent: UDP connect)."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_transfer(http: _Http, backend: str, host: str, transfer_root):
    """(the weight source, vLLM's trainer-side transfer engine) for the server's ``backend``: the trainer pushes
    by filling the source and calling the engine's ``send_weights``."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    # late: the plug-in imports vLLM, only needed when this trainer pushes weights
    from rollout.vllm_plugins import server_transfer

    source = server_transfer.ListWeightSource()
    client = HTTPWeightSyncClient(http)
    if backend == server_transfer.BACKEND:
        info = server_transfer.FileTrainerInitInfo(rank=0, root=str(transfer_root or ""))
    else:  # nccl -- not run by the CPU-only tests: follows vllm/distributed/weight_transfer/nccl_engine.py
        if not torch.cuda.is_available():
            raise ServerEngineError(f"vLLM server at {http.url} uses the nccl weight-transfer backend, which needs "
                                    "CUDA in the trainer too; on CPU start it with --transfer-backend parityrl_file")
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        world = int(http.call("GET", "/get_world_size", "weight-transfer init")["world_size"])
        address = _local_address_towards(host)
        # The trainer is NCCL rank 0 and hosts the rendezvous; the server's workers join as 1..world.
        info = NCCLTrainerInitInfo(master_address=address, master_port=_free_port(address),
                                   world_size=1 + world, rank=0)
    return source, WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
