"""rollout.max_staleness k (trainer/sampling/async_prefetch.py): the behaviour adapter, the pending batches and their
versions, the split of the mismatch into parity/* (numerics) and staleness/* (policy lag, per lag), and exact resume."""
import json
from pathlib import Path

import pytest
import torch

from rollout.types import Rollouts
from trainer.config.schema import RecipeError
from trainer.lifecycle.preflight import load_recipe
from trainer.sampling.async_prefetch import Prefetch, _decode, _encode, behaviour_weights, snapshot
from trainer.sampling.drawn import Drawn

REPO = Path(__file__).resolve().parents[3]


def test_behaviour_weights_swap_in_and_restore_bit_for_bit():
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    before = snapshot(model)
    assert list(before) == ["weight"]
    with torch.no_grad():
        model.weight.add_(1.0)
    current = model.weight.detach().clone()
    with behaviour_weights(model, before):
        assert torch.equal(model.weight, before["weight"])
    assert torch.equal(model.weight, current)
    with behaviour_weights(model, None):  # on-policy: nothing swapped
        assert torch.equal(model.weight, current)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_behaviour_tensors_survive_the_checkpoint_encoding_bit_for_bit(dtype):
    t = (torch.randn(5, 7) * 1e-3).to(dtype)
    back = _decode(_encode(t))
    assert back.dtype == dtype and torch.equal(back, t)
    assert _decode(_encode(torch.empty(0, 4))).shape == (0, 4)


def test_a_failed_prefetch_is_raised_by_the_step_that_takes_it():
    p = Prefetch()
    assert p.take(3) is None and p.state_dict() is None

    def boom(step):
        raise RuntimeError("engine down")

    p.launch([4], boom, {}, version=2, threaded=True)
    p.wait()  # the sync's wait does not raise: the failure belongs to step 4
    assert p.take(3) is None
    with pytest.raises(RuntimeError, match="engine down"):
        p.take(4)
    assert p.state_dict() is None


def _drawn(tag: str) -> Drawn:
    return Drawn(rows=[{"prompt": tag}], rollouts=Rollouts(
        prompt_ids=[[1], [1]], completion_ids=[[2], [3]], rollout_logprobs=[[-0.5], [-0.25]],
        completion_texts=[tag, tag], finish_reasons=["stop", "stop"], group_size=2), rewards=[1.0, 0.0], per_fn={}, episodes={"turns": [1.0, 2.0]})


def test_the_first_step_launches_k_batches_and_every_later_step_one():
    p, drawn_for = Prefetch(), []

    def draw(step):
        drawn_for.append(step)
        return _drawn(f"s{step}")

    assert p.missing(1, 3) == [2, 3, 4]
    p.launch(p.missing(1, 3), draw, {"w": torch.zeros(2)}, version=0, threaded=True)
    assert drawn_for == [2, 3, 4]  # in step order: the data order of the uninterrupted run
    assert p.missing(2, 3) == [5]
    taken = p.take(2)
    assert taken.version == 0 and taken.drawn.rows == [{"prompt": "s2"}]
    p.launch([5], draw, {"w": torch.ones(2)}, version=1, threaded=False)
    assert sorted(p.pending) == [3, 4, 5] and p.missing(3, 3) == [6]
    with pytest.raises(RuntimeError, match="step 5 is already pending"):
        p.launch([5], draw, {}, version=1, threaded=False)


def test_pending_batches_survive_the_checkpoint_with_their_versions_and_one_adapter_per_version():
    p = Prefetch()
    p.launch([2, 3], lambda s: _drawn(f"s{s}"), {"w": torch.tensor([1.5, -2.0])}, version=0, threaded=False)
    p.launch([4], lambda s: _drawn(f"s{s}"), {"w": torch.tensor([3.0, 0.25])}, version=1, threaded=False)
    state = json.loads(json.dumps(p.state_dict()))  # the checkpoint's state is JSON
    assert [b["step"] for b in state["batches"]] == [2, 3, 4] and sorted(state["behaviours"]) == ["0", "1"]
    back = Prefetch()
    back.load_state_dict(state)
    for step, version, w in ((2, 0, [1.5, -2.0]), (3, 0, [1.5, -2.0]), (4, 1, [3.0, 0.25])):
        e = back.take(step)
        assert e.version == version and torch.equal(e.behaviour["w"], torch.tensor(w))
        assert e.drawn.rows == [{"prompt": f"s{step}"}] and e.drawn.episodes == {"turns": [1.0, 2.0]}
        assert e.drawn.rollouts.completion_ids == [[2], [3]]


def test_a_failure_midway_drops_the_batches_after_it_and_the_checkpoint_keeps_those_before():
    def draw(step):
        if step == 3:
            raise RuntimeError("engine down at 3")
        return _drawn(f"s{step}")

    p = Prefetch()
    p.launch([2, 3, 4], draw, {"w": torch.zeros(1)}, version=0, threaded=True)
    state = p.state_dict()
    assert [b["step"] for b in state["batches"]] == [2]  # 3 failed; 4 was never drawn
    assert p.take(2).drawn.rows == [{"prompt": "s2"}] and p.take(4) is None
    with pytest.raises(RuntimeError, match="engine down at 3"):
        p.take(3)


def test_a_one_step_off_checkpoint_loads_as_a_batch_of_the_version_two_steps_back():
    legacy = {"step": 5, "drawn": {"rows": [{"prompt": "a"}], "rollouts": {
        "prompt_ids": [[1]], "completion_ids": [[2]], "rollout_logprobs": [[-0.5]], "finish_reasons": ["stop"],
        "group_size": 1}, "rewards": [1.0], "per_fn": {}}, "behaviour": {"w": _encode(torch.tensor([2.0]))}}
    p = Prefetch()
    p.load_state_dict(legacy)
    e = p.take(5)
    assert e.version == 3 and torch.equal(e.behaviour["w"], torch.tensor([2.0])) and e.drawn.episodes == {}


def test_staleness_metrics_are_filed_under_the_batchs_lag():
    from trainer.distributed.data_parallel import DataParallel
    from trainer.measurement.staleness import staleness_metrics

    dp = DataParallel.current()
    current = torch.tensor([[-0.5, -1.0, -2.0]])
    behaviour = torch.tensor([[-0.7, -1.0, -1.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    on = staleness_metrics(dp, current, behaviour, mask, None)
    assert not any("lag" in k for k in on)
    assert on["staleness/mae"] == pytest.approx(0.1)  # |-0.5 + 0.7| and 0 over the two unmasked tokens
    off = staleness_metrics(dp, current, behaviour, mask, 3)
    assert off["staleness/lag"] == 3.0
    assert {k.removeprefix("staleness/lag_3/") for k in off if k.startswith("staleness/lag_3/")} == \
        {k.removeprefix("staleness/") for k in on}
    assert all(off[f"staleness/lag_3/{k.removeprefix('staleness/')}"] == v for k, v in on.items())
    with pytest.raises(ValueError, match="lag is -1"):
        staleness_metrics(dp, current, behaviour, mask, -1)


def test_a_pending_batchs_routes_survive_the_checkpoint_as_json():
    routes = [torch.randint(-1, 60, (3, 2, 4), dtype=torch.int16), torch.randint(-1, 60, (4, 2, 4), dtype=torch.int16)]
    drawn = Drawn(rows=[{"prompt": "a"}], rollouts=Rollouts(
        prompt_ids=[[1, 2], [1, 2]], completion_ids=[[3], [4, 5]], rollout_logprobs=[[-0.5], [-0.1, -0.2]],
        finish_reasons=["stop", "stop"], group_size=2, routes=routes), rewards=[1.0, 0.0], per_fn={})
    p = Prefetch()
    p.launch([2], lambda step: drawn, {}, version=0, threaded=False)
    back = Prefetch()
    back.load_state_dict(json.loads(json.dumps(p.state_dict())))  # the checkpoint's state is JSON
    restored = back.take(2).drawn.rollouts
    assert all(torch.equal(a, b) for a, b in zip(restored.routes, routes)) and len(restored.routes) == 2


@pytest.mark.parametrize("sets, words", [
    (["rollout.max_staleness=9"], "rollout.max_staleness = 9: expected an integer from 0"),
    (["rollout.max_staleness=-1"], "rollout.max_staleness = -1"),
    (["rollout.max_staleness=1", "algorithm.dynamic_sampling=true"], "algorithm.dynamic_sampling"),
    (["rollout.max_staleness=1", "algorithm.name=ppo"], "algorithm.name = 'ppo'"),
    (["rollout.max_staleness=4", "algorithm.name=ppo"], "critic-free algorithm with rollout.max_staleness 4"),
    (["rollout.max_staleness=2", "algorithm.off_policy=decoupled"], "decoupled's clip is anchored to the policy"),
    (["algorithm.off_policy=m2po", "algorithm.m2_threshold=0"], r"algorithm.m2_threshold = 0\.0: expected a number > 0"),
    (["algorithm.off_policy=m2p"], "algorithm.off_policy = 'm2p': expected one of"),
])
def test_refused_combinations(sets, words):
    with pytest.raises(RecipeError, match=words):
        load_recipe(REPO / "recipes" / "grpo_tiny.yaml", sets)


def _cfg(tmp_path, name, *sets):
    return load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [
        f"name={name}", f"logging.run_dir={tmp_path / name}", "logging.wandb.mode=disabled", "checkpoint.every=1",
        "rollout.prompts_per_step=6", "algorithm.group_size=4", "train.micro_batch_size=24", *sets])


@pytest.mark.slow
def test_staleness_is_zero_on_policy_and_grows_to_k_steps_off(tmp_path, vllm_engine):
    from trainer.rl.loop import train

    on = train(_cfg(tmp_path, "onpolicy", "train.steps=2"), engine=vllm_engine).history
    off = train(_cfg(tmp_path, "offpolicy", "train.steps=4", "rollout.max_staleness=3"), engine=vllm_engine).history
    assert [h["staleness/mae"] for h in on] == [0.0, 0.0]
    assert [h["staleness/max_abs"] for h in on] == [0.0, 0.0]
    assert not any(k.startswith("staleness/lag") for k in on[0])  # an on-policy run has no lag to file
    # step 1's batch was generated by the weights it trains; step s's (s <= 4) by the adapter s - 1 updates back
    assert [h["staleness/lag"] for h in off] == [0.0, 1.0, 2.0, 3.0]
    assert off[0]["staleness/mae"] == 0.0 and all(h["staleness/kl_k3"] > 0.0 for h in off[1:])
    # the timeline: step 1's batch drawn by version 0, then steps 2-4 launched with it; each later step launches
    # the batch k ahead with the weights it holds (the final checkpoint keeps batches 5-7)
    spans = [json.loads(x) for x in (tmp_path / "offpolicy" / "timeline.jsonl").read_text().splitlines()]
    assert [(s["step"], s["version"]) for s in spans if s["lane"] == "generate"] == [
        (1, 0), (2, 0), (3, 0), (4, 0), (5, 1), (6, 2), (7, 3)]
    assert [s["step"] for s in spans if s["lane"] == "train"] == [1, 2, 3, 4]
    assert all(s["end"] >= s["start"] for s in spans)
    assert (tmp_path / "offpolicy" / "timeline.png").exists()
    for h in off:
        lag = int(h["staleness/lag"])
        assert h[f"staleness/lag_{lag}/kl_k3"] == h["staleness/kl_k3"]
    # parity/* stays the numerics of same-weights scoring: the level of the on-policy run (bf16, ~1e-3)
    assert all(h["parity/mae"] < 5 * on[1]["parity/mae"] for h in off)
    assert all(h["staleness/mae"] > h["parity/mae"] for h in off[1:])
    # AReaL's decoupled objective (two mini-batches: with one update its clip never acts, and it is refused) against
    # behaviour_clip with two: step 1 (lag 0) is the same update; from step 2 the ratios are taken against pi_prox and
    # weighted by pi_prox / pi_behaviour, so the loss differs
    two = ("train.steps=2", "rollout.max_staleness=3", "algorithm.mini_batches=2")
    clip2 = train(_cfg(tmp_path, "clip2", *two), engine=vllm_engine).history
    dec = train(_cfg(tmp_path, "decoupled", *two, "algorithm.off_policy=decoupled"), engine=vllm_engine).history
    assert dec[0]["train/loss"] == clip2[0]["train/loss"] and "staleness/decoupled_weight_mean" not in dec[0]
    assert dec[1]["reward/mean"] == clip2[1]["reward/mean"] and dec[1]["train/loss"] != clip2[1]["train/loss"]
    assert 0.5 < dec[1]["staleness/decoupled_weight_mean"] < 2.0 and dec[1]["staleness/decoupled_filtered_frac"] < 0.1
    assert dec[1]["staleness/kl_k3"] == clip2[1]["staleness/kl_k3"]  # the same lag measured (pi_prox: one forward)
    # M2PO with a threshold below the lag's second moment: its largest (log pi_prox / pi_behaviour)^2 are masked,
    # the rest is behaviour_clip's surrogate; its M2 is the squared staleness RMSE (the same tokens, one definition)
    m2 = train(_cfg(tmp_path, "m2po", "train.steps=2", "rollout.max_staleness=3", "algorithm.off_policy=m2po",
                    "algorithm.m2_threshold=1e-5"), engine=vllm_engine).history
    assert m2[0]["train/loss"] == off[0]["train/loss"] and "staleness/m2po_m2" not in m2[0]
    assert m2[1]["reward/mean"] == off[1]["reward/mean"] and m2[1]["train/loss"] != off[1]["train/loss"]
    assert m2[1]["staleness/m2po_m2"] == pytest.approx(off[1]["staleness/rmse"] ** 2, rel=1e-3)
    assert 0.0 < m2[1]["staleness/m2po_masked_frac"] < 1.0 and m2[1]["staleness/m2po_m2_kept"] < 1e-5


@pytest.mark.slow
def test_off_policy_resume_equals_uninterrupted(tmp_path, vllm_engine):
    """k = 3: the checkpoint after step 2 holds the batches of steps 3, 4 and 5 (versions 0, 1 and 1)."""
    from peft.utils import load_peft_weights

    from trainer.io.checkpoint import latest_checkpoint
    from trainer.rl.loop import train

    full = train(_cfg(tmp_path, "full", "train.steps=5", "rollout.max_staleness=3"), engine=vllm_engine)
    half = _cfg(tmp_path, "split", "train.steps=5", "rollout.max_staleness=3")
    half.train.steps = 2
    train(half, engine=vllm_engine)
    half.train.steps = 5
    resumed = train(half, resume=True, engine=vllm_engine)
    assert [h["step"] for h in resumed.history] == [3, 4, 5]
    for a, b in zip(full.history[2:], resumed.history):
        for key in ("reward/mean", "train/loss", "staleness/mae", "staleness/lag", "parity/mae"):
            assert a[key] == b[key], (a["step"], key)
    pa = load_peft_weights(str(latest_checkpoint(full.run_dir) / "adapter"), device="cpu")
    pb = load_peft_weights(str(latest_checkpoint(resumed.run_dir) / "adapter"), device="cpu")
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
