"""Session-wide setup: offline, hermetic cache, one tiny model and one vLLM engine per session."""
import os
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Before anything imports vllm or wandb.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Built models live in the checkout, so a test run never depends on (or disturbs) a user's cache.
os.environ.setdefault("PARITYRL_CACHE", str(REPO / ".cache" / "parityrl"))


def pytest_collection_modifyitems(config, items):
    """Files with more slow tests first, each file's own order kept (a stable sort). ``make test`` runs files on
    two workers (``--dist loadfile``), which take them in this order as they free up: the long files start first
    and the many short ones fill both workers to the end (longest first, the classic rule for packing jobs on
    machines), where collection order could start a long file last with the other worker idle beside it."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])


# The tiny Llama's decoder linears: what model.lora.target_modules [all-linear] resolves to on it.
TINY_LORA_TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    """The warm-started built-in model (built once per cache, then reused)."""
    from trainer.builtin.resolve import resolve_model_path

    return resolve_model_path("builtin:tiny")


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir):
    """One in-process vLLM engine for the whole session (engine start is the slow part on 2 cores).

    Started as a run of the demo recipe starts its own: serving the LoRA adapter of rank 16 on every linear
    (``rollout.lora_sync: auto`` is ``adapter`` there), so the integration tests run the default sync; a merged
    update works on it too (``VLLMEngine.load_adapter`` restores the base weights after one). It returns the kept
    sets of truncated sampling (top-k / top-p / min-p) when a request truncates.
    Tests that change its weights must restore them (train() re-syncs at its start).
    """
    from rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_model_dir, dtype="bfloat16", max_model_len=128, seed=0,
                        kv_cache_memory_bytes=256 * 1024**2, enforce_eager=True, max_lora_rank=16,
                        lora_target_modules=TINY_LORA_TARGETS, sampling_supports=True)
    yield engine
    engine.close()
