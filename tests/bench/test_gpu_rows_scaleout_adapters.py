"""bench/gpu/gpu_check.py's rows for issue 57 item 7 (bench/gpu/gpu_rows_scaleout_adapters.py): listed by ``--list``,
skipped on a CPU saying what they need, and what they rest on checked here without a GPU: the OLMoE recipe resolves
to the adapter sync and routing replay on CUDA (merged on vLLM's CPU build), and the rows' pass rules fail on the
records a broken run would leave (run in this process: nothing is built or started)."""
import pytest
import torch
from gpu_check_loader import listed, load_gpu_check

ROWS = [("57.7", "LoRA adapter served under data parallel"), ("57.7", "OLMoE recipe on CUDA: adapter + routes, 2 steps")]


def _rows():
    load_gpu_check()
    import gpu_rows_scaleout_adapters

    return gpu_rows_scaleout_adapters


def test_list_names_both_rows_with_their_item(capsys):
    assert listed(capsys, "--only", "57.7") == ROWS


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour (on a GPU the rows train for minutes)")
def test_both_rows_say_they_need_vllms_cuda_build_on_a_cpu(tmp_path):
    rows = _rows()
    import gpu_rows_common

    def never_built():
        raise AssertionError("the row built its model on a machine that cannot run it")

    with pytest.raises(gpu_rows_common.Skip, match="CUDA GPU and vLLM's CUDA build"):
        rows.dp_adapter_row(never_built)
    with pytest.raises(gpu_rows_common.Skip, match="CUDA GPU and vLLM's CUDA build"):
        rows.olmoe_row(tmp_path)
    assert not any(tmp_path.iterdir())


def test_the_olmoe_recipe_resolves_to_adapter_and_replay_on_cuda_only():
    from transformers import OlmoeConfig

    rows = _rows()
    config = OlmoeConfig(**rows.OLMOE_SHAPE)
    sets = rows.olmoe_sets("/nowhere/olmoe", "/nowhere/train.jsonl")
    assert rows.olmoe_resolution(sets, config, cuda=True) == ("adapter", "replay")
    # vLLM's CPU build runs an MoE adapter through its Triton fused-MoE kernel, which it lacks: merged there
    assert rows.olmoe_resolution(sets, config, cuda=False) == ("merged", "replay")


def test_the_bound_is_the_bf16_level_at_the_depth_times_the_warn_factor():
    rows = _rows()
    assert rows.mae_bound(4) == pytest.approx(3 * 4e-3)  # trainer/precision/bf16.py's floor at the tiny depth
    assert rows.mae_bound(8) == pytest.approx(3 * 4e-3 * 2 ** 1.6)  # grown with depth (levels.DEPTH_EXPONENT)


def _rank(rank: int, digests=("a", "b", "c"), served=(1, 2, 3), mode="adapter") -> dict:
    return {"rank": rank, "local_rank": rank, "exit": 0, "engine_device": f"cuda:{rank}",
            "syncs": [{"mode": mode, "version": v, "served": s, "digest": d}
                      for v, s, d in zip((1, 2, 3), served, digests)]}


STEPS_OK = [{"step": 1, "parity/mae": 3e-3}, {"step": 2, "parity/mae": 4e-3}]


def test_the_dp_rule_passes_ranks_that_serve_the_same_versions_and_names_each_fault():
    problems = _rows().adapter_dp_problems
    assert problems([_rank(0), _rank(1)], STEPS_OK, 2, 1.2e-2) == []
    assert problems([_rank(0)], STEPS_OK, 1, 1.2e-2) == []  # the one-GPU fallback
    assert problems([_rank(0)], [STEPS_OK[0], {"step": 2, "parity/mae": 0}], 1, 1.2e-2) == []  # JSON's integer 0
    nan = [STEPS_OK[0], {"step": 2, "parity/mae": float("nan")}]
    assert problems([_rank(0)], nan, 1, 1.2e-2) == ["step 2: parity/mae nan above 1.20e-02"]
    bad = problems([_rank(0), _rank(1, digests=("a", "x", "c"))], STEPS_OK, 2, 1.2e-2)
    assert len(bad) == 1 and "adapter version 2" in bad[0]
    bad = problems([_rank(0), _rank(1, served=(1, 2, 2))], STEPS_OK, 2, 1.2e-2)
    assert any("rank 1: engine served versions [1, 2, 2]" in b for b in bad)
    bad = problems([_rank(0, mode="merged"), _rank(1)], STEPS_OK, 2, 1.2e-2)
    assert any("rank 0: sync modes" in b for b in bad)
    wrong_gpu = _rank(1) | {"engine_device": "cuda:0"}
    assert any("rank 1: engine on cuda:0" in b for b in problems([_rank(0), wrong_gpu], STEPS_OK, 2, 1.2e-2))
    assert problems([_rank(0)], STEPS_OK, 2, 1.2e-2) == ["rank records [0], expected [0, 1]"]
    high = [STEPS_OK[0], {"step": 2, "parity/mae": 0.16}]  # a skipped sync's level
    assert problems([_rank(0), _rank(1)], high, 2, 1.2e-2) == ["step 2: parity/mae 0.16 above 1.20e-02"]


def _olmoe_step(step: int, **over) -> dict:
    return {"step": step, "perf/sync_chunks": 1.0, "parity/routing_unrouted": 0.0, "parity/mae": 2e-3,
            "parity/unreplayed/mae": 5e-3, "parity/routing_agree": 0.4, **over}


def test_the_olmoe_rule_wants_the_adapter_routes_and_replay_on_every_step():
    problems = _rows().olmoe_problems
    assert problems([_olmoe_step(1), _olmoe_step(2)], "step 1 ...\n", 1.2e-2) == []
    merged = "rollout.lora_sync: merged (a mixture-of-experts model on vLLM's CPU build: ...)\n"
    assert problems([_olmoe_step(1), _olmoe_step(2)], merged, 1.2e-2) == [
        "the run fell back to the merged sync: " + merged.strip()]
    assert problems([_olmoe_step(1), _olmoe_step(2, **{"perf/sync_chunks": 4.0})], "", 1.2e-2) == [
        "step 2: perf/sync_chunks 4.0, expected 1 (one adapter)"]
    assert problems([_olmoe_step(1, **{"parity/routing_unrouted": 0.25}), _olmoe_step(2)], "", 1.2e-2) == [
        "step 1: parity/routing_unrouted 0.25, expected 0"]
    not_replayed = _olmoe_step(2)
    del not_replayed["parity/unreplayed/mae"]
    assert problems([_olmoe_step(1), not_replayed], "", 1.2e-2) == [
        "step 2: no parity/unreplayed/mae (the step was not replayed)"]
    assert problems([_olmoe_step(1)], "", 1.2e-2) == ["steps logged [1], expected [1, 2]"]
