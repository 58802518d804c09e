"""An in-process ``VLLMEngine`` started as on a CUDA machine, with a stand-in for vLLM's ``LLM``: the project's CUDA
branches run (device placement, options), nothing touches a device. For tests of what the engine hands vLLM or
does around it on CUDA; vLLM's own config handling on a stand-in platform is tests/rollout/cuda_standin.py's."""
import contextlib

import torch

import rollout.vllm_engine
from rollout.vllm_engine import VLLMEngine


def start_engines_as_on_cuda(monkeypatch, llm_cls) -> None:
    """Make ``VLLMEngine`` start ``llm_cls`` in place of vLLM's ``LLM`` as on CUDA device 0."""
    import vllm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(rollout.vllm_engine, "check_engine_device", lambda llm, expected: None)
    monkeypatch.setattr(rollout.vllm_engine, "_preserve_rng", contextlib.nullcontext)
    monkeypatch.setattr(vllm, "LLM", llm_cls)
    monkeypatch.setattr(VLLMEngine, "_live", VLLMEngine._live)  # engines a test never closes leave no trace
