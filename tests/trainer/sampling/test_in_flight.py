"""rollout.in_flight (trainer/sampling/in_flight.py, rollout/server_engine/in_flight.py): the server's per-token
weight-version spans, the stale-KV flags, the engine versions mapped to policy versions, one behaviour pass per
version combined per token, the per-token lag metrics and the checkpoint of a batch holding several versions."""
import json
from pathlib import Path

import pytest
import torch

from rollout.server_engine.errors import ServerEngineError
from rollout.server_engine.in_flight import stale_kv_flags, token_versions
from rollout.types import Rollouts
from trainer.commands.serve import serve_command
from trainer.config.schema import RecipeError
from trainer.distributed.data_parallel import DataParallel
from trainer.lifecycle.preflight import load_recipe
from trainer.measurement.scoring import Scores
from trainer.measurement.staleness import lag_histogram, stale_kv_metrics, staleness_metrics
from trainer.models.batch import batch_from_rollouts
from trainer.off_policy.by_version import combine_by_version, score_by_version, versions_present
from trainer.sampling.async_prefetch import Prefetch
from trainer.sampling.drawn import Drawn
from trainer.sampling.in_flight import InFlight

REPO = Path(__file__).resolve().parents[3]
LABELS = {"parityrl-ab-3": 3, "parityrl-ab-4": 4}


def _bad(msg):
    return ServerEngineError(msg)


def _versions(spans, n):
    return token_versions({"weight_versions": spans}, n, LABELS.get, _bad)


def test_spans_give_each_token_the_version_that_sampled_it():
    spans = [{"version": "parityrl-ab-3", "start": 0, "end": 2}, {"version": "parityrl-ab-4", "start": 2, "end": 5}]
    assert _versions(spans, 5) == [3, 3, 4, 4, 4]
    assert _versions([{"version": "parityrl-ab-4", "start": 0, "end": 3}], 3) == [4, 4, 4]


@pytest.mark.parametrize("spans, n, words", [
    ([{"version": "parityrl-ab-3-partial", "start": 0, "end": 2}], 2, "not one this trainer pushed whole"),
    ([{"version": "parityrl-ab-3", "start": 0, "end": 1}, {"version": "parityrl-ab-4", "start": 2, "end": 3}], 3,
     "not contiguous"),
    ([{"version": "parityrl-ab-4", "start": 0, "end": 1}, {"version": "parityrl-ab-3", "start": 1, "end": 2}], 2,
     "go backwards"),
    ([{"version": "parityrl-ab-3", "start": 0, "end": 2}], 3, "cover 2 tokens, the sample has 3"),
    (None, 2, "no weight-version spans"),
])
def test_bad_spans_are_refused(spans, n, words):
    with pytest.raises(ServerEngineError, match=words):
        _versions(spans, n)


def test_keep_marks_the_tokens_after_an_update_as_read_over_older_kv_and_recompute_none():
    assert stale_kv_flags([3, 3, 4, 4], "keep") == [0, 0, 1, 1]
    assert stale_kv_flags([4, 4], "keep") == [0, 0]  # started after the update: its prefill is the new version's
    assert stale_kv_flags([3, 3, 4, 4], "recompute") == [0, 0, 0, 0]
    assert stale_kv_flags([], "keep") == []


class _Engine:
    """What InFlight reads of an engine: its weight version, and the pause it pushes inside."""

    def __init__(self):
        self.weight_version, self.calls = 1, []

    def in_flight_update(self):
        engine = self

        class Paused:
            def __enter__(self):
                engine.calls.append("pause")

            def __exit__(self, *exc):
                engine.calls.append("resume")

        return Paused()


def _drawn(versions, stale=None):
    comps = [[5] * len(v) for v in versions]
    return Drawn(rows=[{}], rollouts=Rollouts(
        prompt_ids=[[1, 2]] * len(versions), completion_ids=comps,
        rollout_logprobs=[[-0.5] * len(c) for c in comps], finish_reasons=["stop"] * len(versions),
        group_size=len(versions), versions=versions, stale_kv=stale or [[0] * len(v) for v in versions]),
        rewards=[0.0] * len(versions), per_fn={})


def test_an_in_flight_sync_snapshots_onto_the_pending_batches_pushes_paused_and_maps_versions():
    engine, flight, prefetch = _Engine(), InFlight("keep"), Prefetch()
    flight.pushed(engine, 7)  # the run's first sync: engine version 1 is policy version 7
    policy = torch.nn.Linear(2, 2)
    prefetch.launch([9], lambda s: _drawn([[1, 1]]), {"w": torch.zeros(1)}, version=7, threaded=False)

    def push(e):
        e.calls.append("push")
        e.weight_version += 1
        return {"perf/sync_bytes": 1.0}

    assert flight.sync(push, engine, policy, prefetch, 8) == {"perf/sync_bytes": 1.0}
    assert engine.calls == ["pause", "push", "resume"]
    assert sorted(prefetch.pending[9].behaviours) == [7, 8]  # the new version's snapshot is there for its tokens
    assert torch.equal(prefetch.pending[9].behaviours[8]["weight"], policy.weight)
    assert flight.mapped(_drawn([[1, 2, 2], [2]])).rollouts.versions == [[7, 8, 8], [8]]
    with pytest.raises(RuntimeError, match="weight version 5, which none of this run's syncs pushed"):
        flight.mapped(_drawn([[5]]))

    def no_push(e):
        return {}

    with pytest.raises(RuntimeError, match="expected one push"):
        flight.sync(no_push, engine, policy, prefetch, 9)


def test_a_pending_batch_of_two_versions_survives_the_checkpoint_with_both_snapshots():
    p = Prefetch()
    p.launch([3], lambda s: _drawn([[1, 2], [2]], [[0, 1], [0]]), {"w": torch.tensor([1.0])}, version=1,
             threaded=False)
    p.add_behaviour(2, {"w": torch.tensor([2.0])})
    p.add_behaviour(5, {"w": torch.tensor([5.0])})  # pushed while it generated, none of its tokens: not kept
    state = json.loads(json.dumps(p.state_dict()))
    assert state["batches"][0]["versions"] == [1, 2] and sorted(state["behaviours"]) == ["1", "2"]
    back = Prefetch()
    back.load_state_dict(state)
    taken = back.take(3)
    assert {v: float(b["w"]) for v, b in taken.behaviours.items()} == {1: 1.0, 2: 2.0}
    assert taken.drawn.rollouts.versions == [[1, 2], [2]] and taken.drawn.rollouts.stale_kv == [[0, 1], [0]]


def _scores(lp, topk):
    return Scores(logprobs=lp, entropy=lp * 0 + 1, topk=topk)


def test_each_token_takes_its_own_versions_scores():
    versions = torch.tensor([[3, 3, 4], [4, 4, 0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    a = _scores(torch.full((2, 3), -1.0), torch.full((2, 3, 2), -10.0))
    b = _scores(torch.full((2, 3), -2.0), torch.full((2, 3, 2), -20.0))
    out = combine_by_version({3: a, 4: b}, versions)
    assert torch.equal(out.logprobs, torch.tensor([[-1.0, -1.0, -2.0], [-2.0, -2.0, 0.0]]))  # padding: no version
    assert torch.equal(out.topk[0, 2], torch.tensor([-20.0, -20.0])) and torch.equal(out.topk[0, 0],
                                                                                     torch.tensor([-10.0, -10.0]))
    assert versions_present(versions, mask) == [3, 4]  # the padding's 0 is not a version
    seen = []

    class Weights:
        def __init__(self, v):
            self.v = v

        def __enter__(self):
            seen.append(self.v)

        def __exit__(self, *exc):
            pass

    got = score_by_version(lambda: {3: a, 4: b}[seen[-1]], Weights, versions, mask)
    assert seen == [3, 4] and torch.equal(got.logprobs, out.logprobs)


def test_per_token_lags_give_shares_mean_max_a_histogram_and_the_figures_per_lag():
    dp = DataParallel.current()
    current = torch.tensor([[-0.5, -1.0, -2.0, -1.0]])
    behaviour = torch.tensor([[-0.7, -1.0, -1.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    lag = torch.tensor([[1, 0, 0, 7]])  # the padding's lag is not counted
    m = staleness_metrics(dp, current, behaviour, mask, lag)
    assert m["staleness/lag_0/share"] == pytest.approx(2 / 3) and m["staleness/lag_1/share"] == pytest.approx(1 / 3)
    assert m["staleness/lag_mean"] == pytest.approx(1 / 3) and m["staleness/lag_max"] == 1.0 == m["staleness/lag"]
    assert m["staleness/lag_1/mae"] == pytest.approx(0.2) and m["staleness/lag_0/mae"] == pytest.approx(0.25)
    assert m["staleness/mae"] == pytest.approx(0.7 / 3)
    assert "staleness/lag_7/share" not in m
    assert lag_histogram(lag, mask) == ([2.0, 1.0], [-0.5, 0.5, 1.5])


def test_stale_kv_tokens_are_measured_apart():
    dp = DataParallel.current()
    train = torch.tensor([[-1.0, -1.0, -1.0]])
    engine = torch.tensor([[-1.0, -1.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    m = stale_kv_metrics(dp, train, engine, mask, torch.tensor([[0.0, 1.0, 1.0]]))
    assert m["parity/stale_kv/share"] == 0.5 and m["parity/stale_kv/mae"] == pytest.approx(0.5)
    assert stale_kv_metrics(dp, train, engine, mask, torch.zeros(1, 3)) == {"parity/stale_kv/share": 0.0}


def test_the_batch_carries_versions_and_stale_flags_on_its_grid():
    r = _drawn([[3, 4], [4]], [[0, 1], [0]]).rollouts
    batch = batch_from_rollouts(r, pad_id=0)
    assert torch.equal(batch.versions, torch.tensor([[3, 4], [4, 0]]))
    assert torch.equal(batch.stale_kv, torch.tensor([[0.0, 1.0], [0.0, 0.0]]))
    part = batch.select(slice(1, 2))
    assert torch.equal(part.versions, torch.tensor([[4]])) and torch.equal(part.stale_kv, torch.tensor([[0.0]]))
    with pytest.raises(ValueError, match="Rollouts.versions must hold one entry per completion token"):
        Rollouts(prompt_ids=[[1]], completion_ids=[[2, 3]], rollout_logprobs=[[0.0, 0.0]], finish_reasons=["stop"],
                 group_size=1, versions=[[1]])


SERVER = ["rollout.mode=server", "rollout.max_staleness=1"]


@pytest.mark.parametrize("sets, words", [
    (["rollout.in_flight=keep", "rollout.max_staleness=1"], "'off' with rollout.mode colocate"),
    (["rollout.in_flight=recompute", "rollout.mode=server"], "'off' with rollout.max_staleness 0"),
    (["rollout.in_flight=keep", *SERVER, "rollout.lora_sync=adapter"], "rollout.lora_sync = 'adapter': expected"),
    (["rollout.in_flight=always", *SERVER], "rollout.in_flight = 'always'"),
])
def test_refused_in_flight_combinations(sets, words):
    with pytest.raises(RecipeError, match=words):
        load_recipe(REPO / "recipes" / "grpo_tiny.yaml", sets)


def test_a_bare_yaml_off_is_the_choice_off():
    # YAML 1.1 reads `in_flight: off` (and --set rollout.in_flight=off) as false
    cfg = load_recipe(REPO / "recipes" / "grpo_tiny.yaml", ["rollout.in_flight=off"])
    assert cfg.rollout.in_flight == "off"
    with pytest.raises(RecipeError, match="rollout.in_flight = True: expected one of 'off', 'keep', 'recompute'"):
        load_recipe(REPO / "recipes" / "grpo_tiny.yaml", ["rollout.in_flight=on"])


def test_serve_runs_a_keep_server_without_prefix_caching_and_without_lora(tiny_model_dir):
    def argv(mode):
        cfg = load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [*SERVER, f"rollout.in_flight={mode}"])
        return serve_command(cfg, cuda=False, model_dir=tiny_model_dir)[0]

    keep, recompute = argv("keep"), argv("recompute")
    assert "--no-enable-prefix-caching" in keep and "--no-enable-prefix-caching" not in recompute
    assert "--enable-lora" not in keep and "--enable-lora" not in recompute  # merged: a new version replaces it
