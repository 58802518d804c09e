"""A CPU-capable vLLM weight-transfer backend: tensors handed over in a safetensors file.

Server mode (``rollout.server_engine``) pushes the trainer's weights into a separate
vLLM server through vLLM's own weight-transfer lifecycle
(``vllm/distributed/weight_transfer/base.py``: ``init_transfer_engine`` once, then
``start_weight_update`` -> ``update_weights`` -> ``finish_weight_update`` per sync,
driven over the RL HTTP routes of ``vllm/entrypoints/rl/online/api_router.py``).
vLLM 0.32's built-in backends all need CUDA: ``nccl`` / ``sparse_nccl`` /
``nccl_m2n`` build a ``PyNcclCommunicator``, ``ipc`` rebuilds CUDA tensors from IPC
handles, and even the base ``WeightTransferEngine.update_weights`` ends with
``torch.accelerator.synchronize()``, which raises on a CPU-only torch. On CUDA,
server mode uses vLLM's ``nccl`` engine unchanged; this module is the backend for
everything else.

Backend ``parityrl_file`` -- why a file:

- The payload must cross a process boundary without CUDA. The candidates were (a) the
  HTTP body (JSON or base64: copies, a 4/3 size blow-up, the whole update in the API
  server's memory), (b) vLLM's ``reload_weights(weights_path=...)`` through
  ``/collective_rpc`` (``vllm/model_executor/model_loader/reload/inplace.py``: it
  re-reads every file of a checkpoint directory, rewrites ``model_config.model`` to
  that path, and bypasses the weight-transfer lifecycle and its endpoints), and (c) a
  registered ``WeightTransferEngine`` that reads a file the trainer wrote. (c) keeps
  vLLM's lifecycle, endpoints and metrics, and costs one write plus one mmap read.
- The file is safetensors (no pickle: the server never unpickles trainer data) in a
  directory on ``/dev/shm`` when it exists (tmpfs: RAM, no disk I/O), written to a
  temporary name and renamed into place. It is deleted after the update.
- Limitation: trainer and server must see the same directory (same host, or a shared
  filesystem). ``init_transfer_engine`` checks this with a random token the trainer
  wrote there, so a server on another host fails at start with that explanation.

Receiving mirrors vLLM's NCCL engine (``nccl_engine.py``): ``start_weight_update``
calls ``initialize_layerwise_reload(model)``, every tensor goes through
``model.load_weights`` (which applies vLLM's name mapping, fuses q/k/v and gate/up and
shards for tensor parallelism: with TP > 1 every worker reads the whole file and keeps
its shard), and ``finish_weight_update`` calls ``finalize_layerwise_reload``. That is
the same sequence as the in-process ``reload_weights`` the colocated engine uses, so
the fused-group rule of ``rollout.weight_updates`` (send q/k/v and gate/up whole) holds
here too.

Registration in the server process: vLLM resolves ``--worker-extension-cls`` in every
worker before the worker is built (``vllm/v1/worker/worker_base.py: init_worker``)
and the worker creates its weight-transfer engine after loading the model
(``gpu_worker.py: load_model`` -> ``WeightTransferEngineFactory.create_engine``), so
importing this module through ``ParityrlWorkerExtension`` registers the backend in
time. No package entry point is needed. The extension also answers
``parityrl_server_info`` over ``/collective_rpc``, which the trainer uses to check the
server's settings before the first rollout.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from rollout.routes import encode_routes
from rollout.support import encode_supports
from rollout.vllm_plugins.image_capture import serve_images, take_images
from rollout.vllm_plugins.route_capture import install_route_capture, reset_routes, take_routes
from rollout.vllm_plugins.server_adapters import drop_adapters, lora_info, mark_base_changed, put_adapter
from rollout.vllm_plugins.support_capture import serve_supports, take_supports
from rollout.weight_updates import quiet_partial_reload

BACKEND = "parityrl_file"
TOKEN_FILE = "parityrl_token"
_UPDATE_PREFIX = "update-"


def default_transfer_root() -> Path:
    """/dev/shm (tmpfs) when it is a writable directory, else the system temp dir."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


# ---------------------------------------------------------------- wire info


@dataclass
class FileWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker-side init info: the exchange directory and the token the trainer wrote there."""

    directory: str
    token: str


@dataclass
class FileWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One update: a safetensors file inside the exchange directory and what it must hold."""

    path: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n:
            raise ValueError(f"update_info: {n} names but {len(self.dtype_names)} dtype_names and "
                             f"{len(self.shapes)} shapes; expected one of each per name")


@dataclass
class FileTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info: where to write updates (a fresh directory is made inside)."""

    backend: ClassVar[str] = BACKEND
    root: str = ""


# ---------------------------------------------------------------- server side (vLLM worker)


class FileWeightTransferEngine(WeightTransferEngine[FileWeightTransferInitInfo, FileWeightTransferUpdateInfo]):
    """Worker side of ``parityrl_file``: load the tensors of a safetensors file into the model."""

    init_info_cls = FileWeightTransferInitInfo
    update_info_cls = FileWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.directory: Path | None = None

    def init_transfer_engine(self, init_info: FileWeightTransferInitInfo) -> None:
        directory = Path(init_info.directory)
        token_file = directory / TOKEN_FILE
        try:
            seen = token_file.read_text().strip()
        except OSError as e:
            raise RuntimeError(
                f"{BACKEND}: cannot read {token_file} from the vLLM server ({type(e).__name__}: {e}); this backend "
                "needs the trainer and the server on the same host (or a shared filesystem); on CUDA use "
                "`parityrl serve --transfer-backend nccl`") from None
        if seen != init_info.token:
            raise RuntimeError(f"{BACKEND}: {token_file} holds another token than the trainer sent: the server sees "
                               "a different directory under that path (another host or container?)")
        self.directory = directory.resolve()

    def start_weight_update(self) -> None:
        # The same deferred, layer-by-layer load as vLLM's NCCL engine and in-process reload_weights.
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        # A partial update (LoRA-targeted modules only) is routine; the reload code
        # warns about every untouched layer otherwise.
        with quiet_partial_reload():
            finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises without
        # an accelerator; reading a file is synchronous, so only sync when there is one.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: FileWeightTransferUpdateInfo) -> None:
        if self.directory is None:
            raise RuntimeError(f"{BACKEND}: update_weights before init_weight_transfer_engine")
        path = Path(update_info.path).resolve()
        # Only files the trainer put in the exchange directory: the RL routes take any path.
        if path.parent != self.directory or not path.name.startswith(_UPDATE_PREFIX):
            raise ValueError(f"{BACKEND}: update path {update_info.path!r} is not an update file in {self.directory}")
        from safetensors import safe_open
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with safe_open(str(path), framework="pt", device="cpu") as f:
            present = set(f.keys())
            missing = [n for n in update_info.names if n not in present]
            if missing or len(present) != len(update_info.names):
                raise ValueError(f"{BACKEND}: {path} holds {len(present)} tensors, the update names "
                                 f"{len(update_info.names)}; missing {missing[:6]}")
            for name, shape in zip(update_info.names, update_info.shapes):
                sl = f.get_slice(name)
                if list(sl.get_shape()) != list(shape):
                    raise ValueError(f"{BACKEND}: {name} has shape {sl.get_shape()} in {path}, update says {shape}")

            def tensors() -> Iterator[tuple[str, torch.Tensor]]:
                for name, dtype_name in zip(update_info.names, update_info.dtype_names):
                    t = f.get_tensor(name)
                    if str(t.dtype).split(".")[-1] != dtype_name:
                        raise ValueError(f"{BACKEND}: {name} is {t.dtype} in {path}, update says {dtype_name}")
                    yield name, t.to(self.device)

            with disable_mtp_completeness_check():
                self.model.load_weights(tensors())

    def shutdown(self) -> None:
        self.directory = None


# ---------------------------------------------------------------- trainer side


class ListWeightSource(WeightSource):
    """A ``WeightSource`` over a list of (name, tensor) that is replaced before every send.

    vLLM's trainer engines replay the source given at ``trainer_init`` on each
    ``send_weights()`` (full-resync design); a sync here sends whatever the trainer
    exported for that step, so the list is swapped in with ``set``.
    """

    def __init__(self) -> None:
        self._named: list[tuple[str, torch.Tensor]] = []

    def set(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self._named = list(named)

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self._named]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(list(self._named))


class FileTrainerWeightTransferEngine(TrainerWeightTransferEngine[FileTrainerInitInfo]):
    """Trainer side of ``parityrl_file``: write the source to a file, drive the update round trip."""

    init_info_cls = FileTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, directory: Path) -> None:
        super().__init__(client=client, source=source, is_sender=True)
        self.directory = directory
        self._seq = 0
        self.last_file_bytes = 0

    @classmethod
    def trainer_init(cls, init_info: FileTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> FileTrainerWeightTransferEngine:
        if source is None:
            raise ValueError(f"{BACKEND}: the trainer engine needs a WeightSource")
        if not init_info.is_sender:
            raise ValueError(f"{BACKEND}: one trainer process (rank 0) drives the transfer; got rank {init_info.rank}")
        root = Path(init_info.root) if init_info.root else default_transfer_root()
        directory = Path(tempfile.mkdtemp(prefix="parityrl-weights-", dir=root))
        token = secrets.token_hex(16)
        (directory / TOKEN_FILE).write_text(token)
        engine = cls(client=client, source=source, directory=directory)
        try:
            client.init_weight_transfer_engine(asdict(FileWeightTransferInitInfo(str(directory), token)))
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return engine

    def send_weights(self) -> None:
        from safetensors.torch import save_file

        assert self.source is not None
        meta = self.source.metadata()
        tensors: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for name, t in self.source:
            t = t.detach().to("cpu").contiguous()
            # save_file refuses tensors that share memory (e.g. tied weights exported twice).
            ptr = t.untyped_storage().data_ptr()
            tensors[name] = t.clone() if ptr in storages else t
            storages.add(ptr)
        self._seq += 1
        path = self.directory / f"{_UPDATE_PREFIX}{self._seq:06d}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)  # the server never sees a half-written file
        self.last_file_bytes = path.stat().st_size
        info = FileWeightTransferUpdateInfo(path=str(path), names=[m.name for m in meta],
                                            dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
                                            shapes=[list(m.shape) for m in meta])
        try:
            self.client.start_weight_update()
            self.client.update_weights(asdict(info))
            self.client.finish_weight_update()
        finally:
            path.unlink(missing_ok=True)

    def shutdown(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def register() -> None:
    """Register ``parityrl_file`` with vLLM's worker and trainer factories (idempotent)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, FileWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, FileTrainerWeightTransferEngine)


register()


# ---------------------------------------------------------------- worker extension


def image_info(cfg) -> dict[str, Any] | None:
    """What the server does with images, for the client's check (None: it serves text only): the images a prompt
    may hold, its processor settings and where it normalises (the pixels the capture reads are the front end's, and
    the trainer's processor output equals them only with ``mm_device_do_normalize`` off)."""
    mm = cfg.model_config.multimodal_config
    if mm is None or not mm.get_limit_per_prompt("image"):
        return None
    return {"limit": int(mm.get_limit_per_prompt("image")), "processor": dict(mm.mm_processor_kwargs or {}),
            "device_normalize": bool(mm.mm_device_do_normalize)}


class ParityrlWorkerExtension:
    """Mixed into every vLLM worker by ``--worker-extension-cls`` (see the module docstring).

    Importing this module registered the backend; ``parityrl_server_info`` reports the
    settings the trainer relies on, the two route methods serve rollout routing replay
    (``rollout.vllm_plugins.route_capture``), the two support methods truncated sampling
    (``rollout.vllm_plugins.support_capture``) and the three adapter methods the adapter sync
    (``rollout.vllm_plugins.server_adapters``). Names carry a ``parityrl_`` prefix because vLLM
    refuses an extension attribute that the worker class already has.
    """

    def parityrl_server_info(self) -> dict[str, Any]:
        cfg = self.vllm_config  # type: ignore[attr-defined]
        mc, pc = cfg.model_config, cfg.parallel_config
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        packed = getattr(type(model), "packed_modules_mapping", None) or {}
        wt = cfg.weight_transfer_config
        return {
            "model": str(mc.model),
            "dtype": str(mc.dtype).split(".")[-1],
            "max_model_len": int(mc.max_model_len),
            "logprobs_mode": str(mc.logprobs_mode),
            "max_logprobs": int(mc.max_logprobs),
            "weight_transfer_backend": None if wt is None else str(wt.backend),
            "packed_modules": {k: list(v) for k, v in dict(packed).items()},
            "tensor_parallel_size": int(pc.tensor_parallel_size),
            "world_size": int(pc.world_size),
            "rank": int(getattr(self, "rank", 0)),
            "prefix_caching": bool(cfg.cache_config.enable_prefix_caching),
            "device": str(cfg.device_config.device_type),
            "lora": lora_info(cfg),  # None: started without LoRA (server_adapters)
            "images": image_info(cfg),  # None: a text-only server
        }

    def parityrl_install_route_capture(self) -> dict[str, int]:
        """Hook the model's MoE routers (``route_capture``; once) and forget earlier requests' routes: the shape
        of the routes ``parityrl_take_routes`` hands out."""
        shape = install_route_capture(self)
        reset_routes(self)
        return shape

    def parityrl_take_routes(self, requests_json: str) -> list[dict]:
        """The routes of each ``[request id, sequence length]`` of the JSON list (``collective_rpc`` passes
        strings only), encoded for the wire (``rollout.routes.encode_routes``)."""
        requests = [(str(rid), int(n)) for rid, n in json.loads(requests_json)]
        return [encode_routes(r) for r in take_routes(self, requests)]

    def parityrl_serve_supports(self, reset: str = "1") -> dict:
        """Record the kept sets of every truncated request from now on (``support_capture.serve_supports``; ``reset``
        "1" or "0", as ``collective_rpc`` passes strings only); a ``ValueError`` on Model Runner V2, whose own
        sampling masks vLLM's HTTP answers do not carry."""
        serve_supports(self, reset == "1")
        return {"recording": True}

    def parityrl_take_supports(self, requests_json: str) -> list[dict]:
        """The kept sets of each ``[request id, completion length]`` of the JSON list, encoded for the wire
        (``rollout.support.encode_supports``)."""
        requests = [(str(rid), int(n)) for rid, n in json.loads(requests_json)]
        return encode_supports(take_supports(self, requests))

    def parityrl_serve_images(self, reset: str = "1") -> dict:
        """Record the images of every request from now on (``image_capture.serve_images``; ``reset`` "1" or "0")."""
        serve_images(self, reset == "1")
        return {"recording": True}

    def parityrl_take_images(self, requests_json: str) -> list[list[dict]]:
        """The images each request id of the JSON list consumed (``image_capture.take_images``)."""
        return take_images(self, [str(r) for r in json.loads(requests_json)])

    def parityrl_put_adapter(self, name: str, config_json: str, weights_b64: str) -> dict:
        """Write adapter ``name``'s PEFT files on this server (``server_adapters.put_adapter``): its path."""
        return put_adapter(self, name, config_json, weights_b64)

    def parityrl_drop_adapters(self, keep: str) -> int:
        """Delete this server's adapter files but those of ``keep`` (``server_adapters.drop_adapters``)."""
        return drop_adapters(self, keep)

    def parityrl_base_changed(self) -> None:
        """A merged push replaces base weights: the next adapter restores them first (``server_adapters``)."""
        mark_base_changed(self)
