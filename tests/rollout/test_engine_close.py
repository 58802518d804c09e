"""Closing one in-process vLLM engine leaves another working: vLLM 0.32's ``EngineCore.shutdown`` tears down the
process's model-parallel groups (``cleanup_dist_env_and_memory``), which every in-process engine shares; before
``VLLMEngine.close`` kept it from doing so, the engine left open failed its next step with "pipeline model parallel
group is not initialized" (the doctor's recipes check starts and closes engines beside the run's own)."""
import pytest

from rollout.types import SamplingSpec


@pytest.mark.slow
def test_the_session_engine_still_generates_after_a_second_engine_closes(vllm_engine, tiny_model_dir, prompts):
    from rollout.vllm_engine import VLLMEngine

    spec = SamplingSpec(n=1, temperature=1.0, max_new_tokens=6, seed=3)
    before = vllm_engine.generate(prompts[:2], spec)
    second = VLLMEngine(tiny_model_dir, dtype="bfloat16", max_model_len=64, seed=0,
                        kv_cache_memory_bytes=64 * 1024**2, enforce_eager=True)
    try:
        # it generates; its tokens need not be the session engine's (its own KV layout and eager mode can flip a
        # near-tie bf16 draw)
        assert [len(c) > 0 for c in second.generate(prompts[:2], spec).completion_ids] == [True, True]
    finally:  # a failure above must not leave it to the garbage collector, whose shutdown tears the groups down
        second.close()
    after = vllm_engine.generate(prompts[:2], spec)
    assert after.completion_ids == before.completion_ids and after.rollout_logprobs == before.rollout_logprobs
    assert vllm_engine.score([p + c for p, c in zip(after.prompt_ids, after.completion_ids)]).logprobs
