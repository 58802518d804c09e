"""The stale-KV alarm (rollout/stale_kv.py): the first batch after an update that reads the prefix cache in every
request is refused; a healthy engine never trips it; the NeMo-RL bug (a reset that reports success and empties
nothing) planted on a real vLLM engine is caught at the first generate after the update."""
import pytest
import torch

from rollout.stale_kv import StaleKVAlarm, StaleKVError
from rollout.types import SamplingSpec

BLOCK = 32  # the smallest KV block vLLM's CPU attention takes: the prompts below fill one


def test_first_batch_after_an_update_must_compute_one_prompt_itself():
    alarm = StaleKVAlarm()
    alarm.check([0, 32, 32])  # the engine's first batch: the first request computed, the rest shared it
    assert alarm.checked == 1 and alarm.last == [0, 32, 32]
    alarm.check([32, 32, 32])  # no update since: reading the batch before's KV is the cache doing its job
    assert alarm.checked == 1
    alarm.updated("a weight update")
    with pytest.raises(StaleKVError, match=r"all 3 requests of the first batch after a weight update .*32 to 64"):
        alarm.check([32, 64, 32])
    alarm.check([64, 64, 64])  # raised once; the run stops there, and nothing is re-armed by reading
    assert alarm.checked == 2


def test_none_counts_and_a_score_first_do_not_alarm():
    alarm = StaleKVAlarm()
    alarm.check([None, None])  # prefix caching off: vLLM counts nothing
    alarm.updated("an adapter update")
    alarm.spent()  # a score filled the cache under the new weights without reading it
    alarm.check([32, 32])
    assert alarm.checked == 1
    alarm.updated("an adapter update")
    alarm.check([])  # nothing generated: still armed
    with pytest.raises(StaleKVError, match="adapter update"):
        alarm.check([5])


@pytest.fixture(scope="module")
def block_engine(tiny_model_dir):
    """The tiny model on an engine whose KV blocks a 40-token prompt fills (the session engine's are 128)."""
    from rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_model_dir, dtype="bfloat16", max_model_len=128, seed=0,
                        kv_cache_memory_bytes=64 * 1024**2, block_size=BLOCK)
    yield engine
    engine.close()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, 200, (4, BLOCK + 8), generator=g).tolist()


def _changed(engine, tiny_model_dir, scale: float):
    from transformers import AutoModelForCausalLM

    from rollout.weight_export import full_weights

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    return [(n, t * (1 + scale) if ".layers." in n and t.dim() == 2 else t) for n, t in full_weights(model)]


@pytest.mark.slow
def test_a_reset_that_empties_nothing_is_caught_at_the_next_generate(block_engine, tiny_model_dir, monkeypatch):
    spec = SamplingSpec(n=2, temperature=1.0, max_new_tokens=4, seed=1)
    prompts = _prompts()
    block_engine.generate(prompts, spec)
    block_engine.generate(prompts, spec)  # the cache is live: every request reads its prompt's first block
    assert block_engine.stale_kv.last == [BLOCK] * 8
    checked = block_engine.stale_kv.checked
    block_engine.load_weights(_changed(block_engine, tiny_model_dir, 0.01))  # a healthy sync: reset, then checked
    block_engine.generate(prompts, spec)
    assert block_engine.stale_kv.checked == checked + 1 and min(block_engine.stale_kv.last) == 0
    # planted: vLLM's reset reports success and keeps every block (NeMo-RL PR #3929's no-op, PR #4018's missing call)
    monkeypatch.setattr(block_engine.llm, "reset_prefix_cache", lambda *a, **k: True)
    block_engine.load_weights(_changed(block_engine, tiny_model_dir, 0.02))
    with pytest.raises(StaleKVError, match="all 8 requests of the first batch after a weight update"):
        block_engine.generate(prompts, spec)
