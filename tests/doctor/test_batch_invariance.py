"""The batch-invariance check on the tiny model: each side's batching spread within the dtype's level when healthy,
and a trainer that lets padding into a row's attention fails on the micro-batch row, and only there."""
import pytest
import torch

from trainer.doctor.checks.batch_invariance import run
from trainer.doctor.records import FAIL, PASS

pytestmark = pytest.mark.slow


def test_healthy_tiny_model_passes_with_the_mismatch_beside(tiny_engine, make_doctor):
    doc = make_doctor(engine=tiny_engine)
    found = run(doc)
    assert [f.verdict for f in found] == [PASS] * 3, [(f.item, f.figure, f.cause) for f in found]
    for f in found:
        assert f.figure <= doc.mae_level()
        mismatch = f.details["mismatch_engine_vs_trainer"]
        assert 0 < mismatch["mean"] <= doc.mae_level()  # bf16: the two sides really differ on these tokens
        assert set(f.details["spread"]) and all(s["max"] >= s["mean"] for s in f.details["spread"].values())
    assert set(found[0].details["spread"]) == {"batch 8", "batch 64"}


def test_attention_mask_ignored_fails_the_micro_batch_row(tiny_engine, make_doctor):
    """Planted: the trainer's backbone sees an attention mask of ones (the padding's zeros ignored), so a left-padded
    row attends to its pad tokens: a row alone (no padding) is unchanged, the same row among longer prompts is not.
    (Dropping the mask altogether would not do: Transformers then reads the rows' starts from the position ids.)"""
    doc = make_doctor(engine=tiny_engine)

    def ignore_mask(_module, args, kwargs):
        kwargs["attention_mask"] = torch.ones_like(kwargs["attention_mask"])
        return args, kwargs

    doc.model.model.register_forward_pre_hook(ignore_mask, with_kwargs=True)
    engine, micro, chunks = run(doc)
    assert micro.verdict == FAIL and micro.figure > 3 * doc.mae_level(), (micro.figure, micro.details)
    assert "attention mask" in micro.cause
    assert micro.details["spread"]["micro-batch 64 in a batch of 64"]["mean"] > micro.figure / 2
    assert engine.verdict == PASS and chunks.verdict == PASS  # the engine and the kernel's tiling are not at fault
