"""torchrun worker of bench/gpu/gpu_rows_scaleout_adapters.py (issue 57 item 7): a training run whose engines serve
the LoRA adapter, on every rank, and what each rank's engine serves after every sync.

The run is the product's own entry (``trainer.cli.run_train``, what ``-m trainer.train`` calls), unchanged but for a
recorder around ``PolicySync.__call__`` (the one call through which the loop syncs, at start and after every
step): after each sync it notes the sync's mode, the trainer's adapter version, the version the engine says it
serves, and a digest of the adapter files vLLM loaded (the ``LoRARequest``'s path: ``rollout.vllm_adapters``), and
at the first sync where vLLM's worker put the engine (``collective_rpc`` of ``rollout.device_placement``'s reader).

argv: OUT_DIR RECIPE [--set key=value ...]. Each rank writes OUT_DIR/rank_<r>.json.
"""
import hashlib
import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as trainer/train.py, before vLLM loads
REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "trainer" / "distributed")]

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from worker_exit import finish  # noqa: E402

from rollout.adapters import WEIGHTS_FILE  # noqa: E402
from rollout.device_placement import _worker_device  # noqa: E402
from trainer.cli import run_train  # noqa: E402
from trainer.sampling.policy_sync import PolicySync  # noqa: E402


def adapter_digest(directory: str) -> str:
    """sha256 over the served adapter's tensors, by name (their bytes, not the file's layout)."""
    h = hashlib.sha256()
    tensors = load_file(str(Path(directory) / WEIGHTS_FILE))
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(out_dir: Path, argv: list[str]) -> int:
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    record: dict = {"rank": rank, "local_rank": local, "syncs": []}
    original = PolicySync.__call__

    def recording(self, engine):
        out = original(self, engine)
        try:  # a failure here is the record's, not the run's: the other rank would wait for this one
            request = engine._lora_request()  # the LoRARequest vLLM serves now (None: the base weights alone)
            record["syncs"].append({"mode": self.mode, "version": self.version, "served": engine.adapter_version,
                                    "digest": None if request is None else adapter_digest(request.lora_path)})
            if "engine_device" not in record:
                record["engine_device"] = engine.llm.collective_rpc(_worker_device)[0]
        except Exception as e:  # noqa: BLE001
            record.setdefault("recorder_errors", []).append(f"{type(e).__name__}: {e}"[:300])
        return out

    PolicySync.__call__ = recording
    try:
        record["exit"] = run_train(argv, prog="trainer.train")
    except BaseException as e:  # noqa: BLE001 - the record says how the run ended
        traceback.print_exc()
        record["exit"], record["error"] = 1, f"{type(e).__name__}: {e}"[:400]
    (out_dir / f"rank_{rank}.json").write_text(json.dumps(record))
    return record["exit"]


if __name__ == "__main__":
    code = main(Path(sys.argv[1]), sys.argv[2:])
    if code == 0:
        finish()  # the run left the process group already; finish only ends the process
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) and code else 1)
