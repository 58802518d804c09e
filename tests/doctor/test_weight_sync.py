"""The weight-sync check on the session's engine: a healthy adapter and merged sync of the tiny model deliver every
module bit for bit and leave the engine as found; a sync that leaves one module out, or delivers one shard of a fused
group wrong, fails naming that module."""
import pytest

from trainer.doctor.checks.weight_sync import run
from trainer.doctor.records import FAIL, PASS

pytestmark = pytest.mark.slow


class FaultySync:
    """The engine, but its first weight update loses the tensor ``drop``; ``garble``: sends it negated instead, so one
    shard of a fused module arrives wrong beside its siblings.

    Not by leaving the shard out past the engine's whole-fused-group guard: vLLM's in-place reload materializes the
    fused layer with ``torch.empty_strided`` (``model_loader/reload/meta.py``), so a shard nothing loaded holds
    whatever memory the allocator hands back -- the old weights on one host, the very values just exported on
    another -- and the check rightly passes an engine that happens to hold the exported values."""

    streams_weights = False  # one load_weights per sync: the fault is in that one update

    def __init__(self, engine, drop: str, *, garble: bool = False) -> None:
        self._engine, self._drop, self._garble, self._armed = engine, drop, garble, True

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def load_weights(self, named) -> None:
        named = list(named)
        if not self._armed:
            return self._engine.load_weights(named)
        self._armed = False
        assert any(n == self._drop for n, _ in named)
        if self._garble:
            named = [(n, -t if n == self._drop else t) for n, t in named]
        else:
            named = [(n, t) for n, t in named if n != self._drop]
        return self._engine.load_weights(named)


def _by_item(found):
    return {f.item: f for f in found}


def test_an_adapter_sync_delivers_every_module_and_the_engine_is_left_without_it(tiny_engine, make_doctor):
    doc = make_doctor(engine=tiny_engine)
    found = run(doc)
    assert [f.verdict for f in found] == [PASS, PASS], [(f.item, f.figure, f.cause) for f in found]
    head = found[0]
    assert head.details["mode"] == "adapter" and head.details["modules"] == 28  # 4 layers x 7 linears
    assert head.figure == 0.0 and tiny_engine.adapter_version is None


def test_a_merged_sync_delivers_bit_for_bit_and_restores_the_engine(tiny_engine, make_doctor):
    found = run(make_doctor("rollout.lora_sync=merged", engine=tiny_engine))
    assert [f.verdict for f in found] == [PASS, PASS, PASS], [(f.item, f.figure, f.cause) for f in found]
    assert found[0].details["mode"] == "merged" and found[0].details["modules"] == 28


def test_a_module_the_sync_leaves_out_fails_by_name(tiny_engine, make_doctor):
    faulty = FaultySync(tiny_engine, "model.layers.1.self_attn.o_proj.weight")
    found = run(make_doctor("rollout.lora_sync=merged", engine=faulty))
    head = found[0]
    assert head.verdict == FAIL and head.details["not_delivered"] == ["model.layers.1.self_attn.o_proj"]
    named = _by_item(found)["model.layers.1.self_attn.o_proj: not delivered"]
    assert named.verdict == FAIL and named.figure > 0
    assert _by_item(found)["engine restored after the check (relative error vs before)"].verdict == PASS
    assert _by_item(found)["engine's log-probs after the check vs before: max |dlp|"].verdict == PASS


def test_one_wrong_shard_of_a_fused_group_fails_as_partially_delivered(tiny_engine, make_doctor):
    faulty = FaultySync(tiny_engine, "model.layers.1.self_attn.k_proj.weight", garble=True)
    found = run(make_doctor("rollout.lora_sync=merged", engine=faulty))
    assert found[0].verdict == FAIL and found[0].details["not_delivered"] == ["model.layers.1.self_attn.k_proj"]
    partial = [f for f in found if f.item.startswith("model.layers.1.self_attn.k_proj: partially delivered")]
    assert len(partial) == 1 and "qkv_proj took q_proj, v_proj, not k_proj" in partial[0].item, found
    assert _by_item(found)["engine restored after the check (relative error vs before)"].verdict == PASS
    assert _by_item(found)["engine's log-probs after the check vs before: max |dlp|"].verdict == PASS
