"""Run as a script (tests/rollout/test_engine_cuda_options.py does): start the colocated engine as training starts
it (``trainer.sampling.engines.make_engine``) on a stand-in CUDA platform, through vLLM's own ``LLM`` and
``EngineArgs.create_engine_config`` -- the real option handling and config validation -- and stop there, before
anything would touch a device. Prints, per case, what vLLM made of the options (or its refusal) as one JSON line.

vLLM picks its platform once per process and many of its modules bind it at import, hence a process of its own,
with the stand-in installed before anything else of vLLM is imported. What stands in for a GPU machine:

- ``current_platform``: a ``Platform`` with vLLM's CUDA enum, device type and an sm_90 capability (vLLM's own
  ``CudaPlatform`` cannot be imported without its CUDA extension);
- Triton: ``vllm.config.vllm.HAS_TRITON`` (the CPU wheel's Triton has no CPU backend, so vLLM disables it; a GPU
  machine has it, and Model Runner V2 -- the CUDA default -- needs it: ``VllmConfig.use_v2_model_runner``);
- ``torch.cuda.is_available()``: True, so the project's code takes its CUDA branches; the engine's RNG guard,
  which would read the CUDA generator, is a no-op.

Usage: ``python cuda_standin.py CASES_JSON`` with a list of ``{"name", "recipe", "sets", "model", "routes"}``.
"""
import contextlib
import json
import sys

import torch
import vllm.platforms
from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum


class StandInCuda(Platform):
    _enum = PlatformEnum.CUDA
    device_name = device_type = "cuda"
    dispatch_key = "CUDA"
    ray_device_key = "GPU"
    dist_backend = "nccl"
    device_control_env_var = "CUDA_VISIBLE_DEVICES"

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(9, 0)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return 80 * 1024**3

    def is_cumem_allocator_available(self) -> bool:
        return True


vllm.platforms.current_platform = StandInCuda()

import vllm.config.vllm as config_vllm  # noqa: E402 - after the platform is set
import vllm.entrypoints.llm as entry_llm  # noqa: E402

import rollout.vllm_engine as vllm_engine  # noqa: E402
from rollout.base import EngineCannotLoad  # noqa: E402
from trainer.config.validate import sequence_length  # noqa: E402
from trainer.lifecycle.preflight import load_recipe  # noqa: E402
from trainer.sampling.engines import make_engine  # noqa: E402

config_vllm.HAS_TRITON = True
torch.cuda.is_available = lambda: True
torch.cuda.current_device = lambda: 0  # one GPU: the process is on cuda:0 (rollout.device_placement asks)
torch.cuda.set_device = lambda index: None
vllm_engine._preserve_rng = contextlib.nullcontext


class Built(Exception):
    def __init__(self, config):
        super().__init__("config built")
        self.config = config


class ConfigOnly:
    """Stands for vllm's LLMEngine in ``LLM.__init__``: builds (and so validates) the config, then stops."""

    @staticmethod
    def from_engine_args(engine_args, usage_context=None):
        raise Built(engine_args.create_engine_config(usage_context))


entry_llm.LLMEngine = ConfigOnly


def what_vllm_made(c) -> dict:
    return {"enable_prefix_caching": c.cache_config.enable_prefix_caching,
            "kv_cache_memory_bytes": c.cache_config.kv_cache_memory_bytes,
            "gpu_memory_utilization": c.cache_config.gpu_memory_utilization,
            "enforce_eager": c.model_config.enforce_eager,
            "enable_sleep_mode": c.model_config.enable_sleep_mode,
            "enable_cumem_allocator": c.model_config.enable_cumem_allocator,
            "return_routed_experts": c.aux_output_config.enable_return_routed_experts,
            "use_v2_model_runner": c.use_v2_model_runner,
            "compilation_mode": int(c.compilation_config.mode)}


def main(cases: list[dict]) -> None:
    for case in cases:
        cfg = load_recipe(case["recipe"], case["sets"], check_paths=False)
        out = {"name": case["name"]}
        try:
            make_engine(cfg, case["model"], max_model_len=sequence_length(cfg), return_routes=case["routes"])
            out["error"] = "the engine started without building a config"
        except Built as b:
            out["config"] = what_vllm_made(b.config)
        except EngineCannotLoad as e:  # the engine names vLLM's refusal; the stand-in's stop is its cause
            if isinstance(e.__cause__, Built):
                out["config"] = what_vllm_made(e.__cause__.config)
            else:
                out["error"] = f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - vLLM's refusal is the result
            out["error"] = f"{type(e).__name__}: {e}"
        print("CASE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
