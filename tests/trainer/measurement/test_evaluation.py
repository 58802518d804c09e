"""Held-out evaluation: the unbiased pass@k against hand-computed cases, and a run that evaluates (slow tier)."""
import json
import math
from pathlib import Path

import pytest

from trainer.config import RecipeError
from trainer.lifecycle.preflight import check_before_loading, load_recipe
from trainer.lifecycle.stops import RewardFailed
from trainer.measurement.evaluation import pass_at_k
from trainer.rl.loop import train

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 0, 1, 0.0), (4, 4, 1, 1.0), (4, 1, 1, 0.25), (4, 2, 1, 0.5),
    # 1 - C(n-c, k)/C(n, k): n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6
    (4, 1, 2, 0.5),
    # n=5, c=2, k=3: 1 - C(3,3)/C(5,3) = 1 - 1/10
    (5, 2, 3, 0.9),
    (4, 1, 4, 1.0), (4, 0, 4, 0.0),
    # n - c < k: every k-subset holds a solved sample
    (4, 3, 2, 1.0),
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert math.isclose(pass_at_k(n, c, k), expected, abs_tol=1e-12)


def test_pass_at_1_is_the_solved_share_and_pass_at_k_matches_the_binomials():
    for n in range(1, 9):
        for c in range(n + 1):
            assert math.isclose(pass_at_k(n, c, 1), c / n)
            for k in range(1, n + 1):
                assert math.isclose(pass_at_k(n, c, k), 1 - math.comb(n - c, k) / math.comb(n, k), abs_tol=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, 1, 0), (4, 1, 5), (3, -1, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def cfg_for(tmp_path, name, *sets):
    return load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [
        f"name={name}", f"logging.run_dir={tmp_path / name}", "logging.wandb.mode=disabled", "checkpoint.every=0",
        "rollout.prompts_per_step=4", "algorithm.group_size=4", "train.micro_batch_size=16", *sets])


@pytest.mark.parametrize("sets, says", [
    (("eval.every=1", "eval.pass_k=[5]"), "eval.pass_k = [5]: expected integers in [1, eval.samples = 4]"),
    (("eval.every=1", "eval.samples=0", "eval.greedy=false"), "eval.samples = 0: expected at least 1"),
    (("eval.every=1", "eval.success_reward=nope"), "eval.success_reward = 'nope'"),
])
def test_eval_recipe_refusals(tmp_path, sets, says):
    with pytest.raises(RecipeError) as e:
        cfg_for(tmp_path, "bad", *sets)
    assert says in str(e.value), str(e.value)


def test_a_missing_held_out_file_is_refused_by_its_key_before_anything_loads(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text((REPO / "recipes" / "grpo_tiny.yaml").read_text())
    with pytest.raises(RecipeError, match=r"eval.source = '/nope/held_out.jsonl': no such file or directory"):
        check_before_loading(recipe, ["eval.every=5", "eval.source=/nope/held_out.jsonl",
                                      f"logging.run_dir={tmp_path / 'run'}"], model=False)


@pytest.mark.slow
def test_a_split_that_overlaps_the_training_prompts_is_refused_before_the_engine(tmp_path):
    with pytest.raises(RecipeError, match=r"eval.source = 'builtin:arithmetic' \(split 'train'\): .* are also "
                                          r"training prompts"):
        train(cfg_for(tmp_path, "overlap", "train.steps=1", "eval.every=1", "eval.split=train"))


@pytest.mark.slow
def test_a_reward_failing_on_held_out_prompts_says_it_was_the_evaluation(tmp_path, vllm_engine):
    (tmp_path / "bad_reward.py").write_text("def broken(prompts, completions, **kw):\n"
                                            "    raise ValueError('no answer key')\n")
    cfg = cfg_for(tmp_path, "eval_fails", "train.steps=1", "eval.every=1", "eval.num_prompts=2", "eval.samples=2",
                  f"reward.functions={{broken: '{tmp_path / 'bad_reward.py'}:broken'}}")
    with pytest.raises(RewardFailed, match=r"^held-out evaluation, step 0: .*broken.*no answer key"):
        train(cfg, engine=vllm_engine)


@pytest.mark.slow
def test_a_run_evaluates_before_every_n_steps_and_after_the_last(tmp_path, vllm_engine, capsys):
    res = train(cfg_for(tmp_path, "evals", "train.steps=3", "eval.every=2", "eval.num_prompts=6", "eval.samples=4"),
                engine=vllm_engine)
    rows = [json.loads(x) for x in (tmp_path / "evals" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in rows if "eval/mean@4" in r}
    assert sorted(evals) == [0, 2, 3]  # before step 1, every 2nd step, after the last
    for r in evals.values():
        assert 0.0 <= r["eval/mean@4"] <= r["eval/pass@4"] <= 1.0
        assert r["eval/pass@1"] == pytest.approx(r["eval/mean@4"])
        assert 0.0 <= r["eval/greedy"] <= 1.0 and r["eval/mean_length"] > 0
        assert r["eval/parity/mae"] < 1e-2 and r["eval/parity/num_tokens"] > 0
        assert r["eval/reward/exact_answer"] == pytest.approx(r["eval/reward/mean"])  # one reward function
    out = capsys.readouterr().out
    assert "held-out before step 1: mean@4" in out and "held-out after step 3:" in out
    assert [h["step"] for h in res.history] == [1, 2, 3] and "eval/mean@4" in res.history[1]
    # the same weights, the same seed: an evaluation is reproducible (step 0's again from a fresh run)
    again = train(cfg_for(tmp_path, "evals2", "train.steps=1", "eval.every=2", "eval.num_prompts=6",
                          "eval.samples=4"), engine=vllm_engine)
    assert again.history
    rows2 = [json.loads(x) for x in (tmp_path / "evals2" / "metrics.jsonl").read_text().splitlines()]
    first2 = next(r for r in rows2 if r["step"] == 0 and "eval/mean@4" in r)
    assert first2["eval/mean@4"] == evals[0]["eval/mean@4"] and first2["eval/greedy"] == evals[0]["eval/greedy"]


def test_best_metric_that_is_never_logged_is_refused(tmp_path):
    from trainer.measurement.evaluation import BestCheckpoint

    with pytest.raises(RecipeError, match=r"checkpoint.best_metric = 'eval/mean@4': the run never logs it"):
        BestCheckpoint.from_config(cfg_for(tmp_path, "b", "eval.every=0", "checkpoint.best_metric=eval/mean@4"))
    with pytest.raises(RecipeError, match=r"expected one of eval/mean@4, eval/pass@1, eval/pass@4"):
        BestCheckpoint.from_config(cfg_for(tmp_path, "b", "eval.every=2", "checkpoint.best_metric=eval/mean@8"))
    best = BestCheckpoint.from_config(cfg_for(tmp_path, "b", "eval.every=2", "checkpoint.best_metric=eval/greedy",
                                              "checkpoint.best_mode=min"))
    assert best.update(2, {"eval/greedy": 0.5}) and not best.update(4, {"eval/greedy": 0.6})
    assert not best.update(5, {}) and best.update(6, {"eval/greedy": 0.25}) and best.step == 6


@pytest.mark.slow
def test_the_best_evaluations_checkpoint_is_kept_and_survives_a_resume(tmp_path, vllm_engine, capsys):
    from trainer.io.checkpoint import list_checkpoints

    sets = ("eval.every=1", "eval.num_prompts=4", "eval.samples=2", "checkpoint.keep_last=1",
            "checkpoint.best_metric=eval/reward/mean")
    res = train(cfg_for(tmp_path, "best", "train.steps=3", *sets), engine=vllm_engine)
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "best" / "metrics.jsonl").read_text().splitlines())}
    values = [rows[s]["eval/reward/mean"] for s in (0, 1, 2, 3)]
    best_step = max(range(4), key=lambda s: (values[s], -s))  # the first of the highest
    kept = [s for s, _ in list_checkpoints(tmp_path / "best")]
    assert kept == sorted({3} | ({best_step} if best_step else set())), (values, kept)
    state = json.loads((tmp_path / "best" / "checkpoints" / "step_000003" / "state.json").read_text())
    assert state["best"] == {"metric": "eval/reward/mean", "value": values[best_step], "step": best_step}
    assert "best        eval/reward/mean" in capsys.readouterr().out
    assert res.history
    # a resume restores the best so far, and its own first step is not evaluated as "before step 1" again
    more = train(cfg_for(tmp_path, "best", "train.steps=4", *sets), resume=True, engine=vllm_engine)
    assert [h["step"] for h in more.history] == [4]
    rows = [json.loads(x) for x in (tmp_path / "best" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/reward/mean" in r] == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_a_resume_moves_the_rows_past_its_checkpoint_aside(tmp_path, vllm_engine, capsys):
    """A kill between a step's record and its checkpoint: the resumed run trains that step again, and the record
    holds it once (the earlier row in metrics.superseded.jsonl)."""
    import shutil

    sets = ("eval.every=0", "checkpoint.every=1", "checkpoint.keep_last=3")
    train(cfg_for(tmp_path, "killed", "train.steps=3", *sets), engine=vllm_engine)
    shutil.rmtree(tmp_path / "killed" / "checkpoints" / "step_000003")
    train(cfg_for(tmp_path, "killed", "train.steps=3", *sets), resume=True, engine=vllm_engine)
    steps = [json.loads(x)["step"] for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]
    moved = [json.loads(x) for x in (tmp_path / "killed" / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [r["step"] for r in moved] == [3] and moved[0]["superseded_by_resume_from"] == 2
    assert "resuming from step 2: moved the rows of step" in capsys.readouterr().out


def test_accuracies_per_source_and_overall_hand_computed(tmp_path):
    """Three prompts (sources a, a, b), 2 samples each, solved 2/2, 0/2 and 1/2, and their greedy completions."""
    from rollout.types import Rollouts
    from trainer.distributed.data_parallel import DataParallel
    from trainer.measurement.evaluation import Evaluator
    from trainer.sampling.drawn import Drawn

    cfg = cfg_for(tmp_path, "src", "eval.every=1", "eval.samples=2", "eval.num_prompts=3")
    rows = [{"prompt": "p0", "source": "a"}, {"prompt": "p1", "source": "a"}, {"prompt": "p2", "source": "b"}]
    ev = Evaluator(cfg=cfg, rows=rows, dp=DataParallel.current(), pad_id=0)

    def drawn(solved, n):
        r = Rollouts(prompt_ids=[[1]] * len(solved), completion_ids=[[5, 6]] * len(solved),
                     rollout_logprobs=[[-1.0, -1.0]] * len(solved), finish_reasons=["stop"] * len(solved), group_size=n)
        return Drawn(rows=rows, rollouts=r, rewards=list(solved), per_fn={"exact_answer": list(solved)})

    sums, per_source = {}, {}
    ev._accumulate(drawn([1.0, 1.0, 0.0, 0.0, 1.0, 0.0], 2), 2, sums, per_source, "sampled")
    ev._accumulate(drawn([1.0, 0.0, 0.0], 1), 1, sums, per_source, "greedy")
    m = ev._finish(sums, per_source)
    assert m["eval/mean@2"] == pytest.approx((1 + 0 + 0.5) / 3)
    assert m["eval/pass@2"] == pytest.approx((1 + 0 + 1) / 3) and m["eval/pass@1"] == pytest.approx(m["eval/mean@2"])
    assert m["eval/greedy"] == pytest.approx(1 / 3)
    assert m["eval/a/mean@2"] == pytest.approx(0.5) and m["eval/b/mean@2"] == pytest.approx(0.5)
    assert m["eval/a/pass@2"] == pytest.approx(0.5) and m["eval/b/pass@2"] == pytest.approx(1.0)
    assert m["eval/a/greedy"] == pytest.approx(0.5) and m["eval/b/greedy"] == 0.0
    assert m["eval/reward/mean"] == pytest.approx(0.5) and m["eval/frac_truncated"] == 0.0
