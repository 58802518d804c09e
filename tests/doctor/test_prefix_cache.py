"""The prefix-cache check: cached, shared, reset and post-sync prompt KV give the log-probs a recomputation gives on
the tiny model; a weight sync that forgets to reset the cache fails the sync leg (stale KV from the old weights);
an engine it cannot read is a skip with the reason."""
import pytest

from rollout.vllm_engine import VLLMEngine
from rollout.weight_updates import engine_named_tensors
from trainer.doctor.battery import run_checks
from trainer.doctor.checks.prefix_cache import CHECK, run
from trainer.doctor.records import FAIL, PASS, SKIP


@pytest.mark.slow
def test_healthy_tiny_model_reads_the_cache_and_passes(tiny_engine, make_doctor):
    doc = make_doctor(engine=tiny_engine)
    found = {f.item.split(" vs ")[0]: f for f in run(doc)}
    assert set(found) == {"cold (a group's samples share its prompt)", "cached", "after reset_prefix_cache",
                          "after a weight sync"}
    assert all(f.verdict == PASS for f in found.values()), [(f.item, f.figure, f.details) for f in found.values()]
    # the legs really read the cache: every prompt's first block when cached, the group's shared prompt when cold
    cached, cold = found["cached"].details, found["cold (a group's samples share its prompt)"].details
    assert cached["cached_prompt_tokens"] == 8 * 4 * cached["block_size"]
    assert 0 < cold["cached_prompt_tokens"] < cached["cached_prompt_tokens"]
    assert all(f.details["tokens"] > 0 and f.details["samples_parted"] == 0 for f in found.values())


@pytest.mark.slow
def test_sync_without_cache_reset_fails_the_sync_leg(tiny_engine, make_doctor, monkeypatch):
    """Planted: the engine's weight sync reloads the weights as VLLMEngine does but leaves the prefix cache in place,
    so the prompts cached just before it are read back with KV from the old weights."""
    def load_without_reset(self, named_tensors):
        self.llm.collective_rpc("reload_weights",
                                kwargs={"weights_iterator": engine_named_tensors(named_tensors, self.torch_dtype)})

    monkeypatch.setattr(VLLMEngine, "load_weights", load_without_reset)
    doc = make_doctor(engine=tiny_engine)
    found = {f.item.split(" vs ")[0]: f for f in run(doc)}
    synced = found.pop("after a weight sync")
    assert synced.verdict == FAIL and "old weights" in synced.cause, (synced.figure, synced.details)
    assert synced.details["cached_prompt_tokens"] == 8 * 4 * synced.details["block_size"]  # every prompt read stale
    assert all(f.verdict == PASS for f in found.values())


def test_an_engine_other_than_vllm_is_skipped_with_the_reason(make_doctor):
    doc = make_doctor(engine=object())
    (finding,), _ = run_checks(doc, [CHECK])
    assert finding.verdict == SKIP and "not the colocated vLLM engine" in finding.cause
