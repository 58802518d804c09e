"""The recipe's correction in the update pass: the loss takes the plan's weights, bypass and the unbiased KL change
what they should, a batch-normalised plan scores pi_old first, and the step's report agrees with the shadow table.

A float32 Qwen2-shaped model with random LoRA weights, and "engine" log-probs = the trainer's + noise, so the
ratios are far from 1 and every correction acts. Each pass's gradient is checked against the same loss written out
by hand on one whole-batch forward (summation order differs: float32 tolerances).
"""
import copy

import pytest
import torch

import trainer.rl.update as update
from parity.corrections import CorrectionInputs
from trainer.algorithms import ADVANTAGES, AdvantageInputs, LossInputs, LossNormalizer, grpo_loss
from trainer.builtin.zoo import ensure_arch_model
from trainer.distributed.data_parallel import DataParallel
from trainer.lifecycle.preflight import load_recipe
from trainer.measurement.correction_report import correction_report
from trainer.measurement.scoring import reference_logprobs
from trainer.models.batch import build_token_batch
from trainer.models.policy import add_lora, completion_logprobs, load_base_model
from trainer.rl.learner import Learner
from trainer.rl.update import correction_weights, policy_gradient_pass, score_pass, scores_first, several_updates


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = add_lora(load_base_model(str(ensure_arch_model("qwen2")), "float32"),
                     load_recipe("recipes/grpo_tiny.yaml", check_paths=False).model.lora)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    g = torch.Generator().manual_seed(1)
    lengths = [9, 2, 7, 4, 8, 3, 6, 5]
    prompts = [torch.randint(5, 500, (3 + i % 3,), generator=g).tolist() for i in range(8)]
    completions = [torch.randint(5, 500, (n,), generator=g).tolist() for n in lengths]
    batch = build_token_batch(prompts, completions, pad_id=0)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, batch, temperature=1.0)
    batch.rollout_logprobs = (lp + 0.4 * torch.randn(lp.shape, generator=g)) * batch.mask
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    return model, batch, rewards


def _cfg(*sets):
    return load_recipe("recipes/grpo_tiny.yaml", ["algorithm.group_size=4", "train.micro_batch_size=3", *sets],
                       check_paths=False)


def _advantages(cfg, batch, rewards):
    a = cfg.algorithm
    return ADVANTAGES.get(a.name)(AdvantageInputs(rewards=rewards, mask=batch.mask, group_size=a.group_size),
                                  a.options)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def _pass(model, cfg, batch, adv):
    model.zero_grad()
    learner = Learner(cfg=cfg, model=model, backward=lambda loss: loss.backward())
    if scores_first(cfg):
        old = score_pass(learner, batch)
        learner.step = lambda: 0.0  # gradients kept for the comparison
        metrics, scores = several_updates(learner, batch, adv, old, step=1)
    else:
        scores, metrics = policy_gradient_pass(learner, batch, adv)
    return scores, metrics, _grads(model)


def _by_hand(model, cfg, batch, adv, *, weights=None, old=None, ref=None, behaviour=None):
    """The GRPO loss on one whole-batch forward, its inputs given explicitly."""
    model.zero_grad()
    lp, _ = completion_logprobs(model, batch, temperature=1.0)
    inputs = LossInputs(logprobs=lp, old_logprobs=lp.detach() if old is None else old, advantages=adv,
                        mask=batch.mask, normalizer=LossNormalizer.from_mask(batch.mask, max_len=24),
                        ref_logprobs=ref, is_weights=weights, behaviour_logprobs=behaviour)
    out = grpo_loss(inputs, cfg.algorithm.options)
    out.loss.backward()
    return lp.detach(), out.loss.item(), _grads(model)


def _assert_grads(got, ref):
    assert got.keys() == ref.keys() and len(got) > 0
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=0, atol=2e-5 * float(ref[n].abs().max()) + 1e-9, msg=n)


def _plan_weights(cfg, lp, batch, adv):
    return cfg.parity.correction.plan.apply(CorrectionInputs.of(lp, batch.rollout_logprobs, batch.mask, adv)).weights


@pytest.mark.parametrize("sets", [["parity.correction.rule=token_tis", "parity.correction.token_tis.cap=1.2"],
                                  ["parity.correction.rule=[seq_tis, seq_mean_k3]",
                                   "parity.correction.seq_mean_k3.max_kl=0.05"],
                                  ["parity.correction.rule=[token_mis, opsm]", "parity.correction.opsm.delta=0"]])
def test_the_loss_takes_the_plans_weights(setup, sets):
    model, batch, rewards = setup
    cfg = _cfg(*sets)
    adv = _advantages(cfg, batch, rewards)
    assert not scores_first(cfg)  # the single update's own forward is pi_old: no extra pass
    _, metrics, got = _pass(model, cfg, batch, adv)
    lp, loss, _ = _by_hand(model, cfg, batch, adv)
    w = _plan_weights(cfg, lp, batch, adv)
    assert 0 < float(((w != 1) & (batch.mask > 0)).sum())  # the correction acts on this batch
    _, loss_w, ref = _by_hand(model, cfg, batch, adv, weights=w.float())
    assert metrics["train/loss"] == pytest.approx(loss_w, rel=1e-4, abs=1e-6) and loss_w != pytest.approx(loss)
    _assert_grads(got, ref)


def test_a_batch_normalised_plan_scores_pi_old_first_and_normalises_over_the_batch(setup):
    model, batch, rewards = setup
    cfg = _cfg("parity.correction.rule=token_tis", "parity.correction.batch_normalize=true")
    adv = _advantages(cfg, batch, rewards)
    assert scores_first(cfg)
    with pytest.raises(ValueError, match="a batch-level correction needs its weights"):
        policy_gradient_pass(Learner(cfg=cfg, model=model, backward=lambda loss: loss.backward()), batch, adv)
    _, _, got = _pass(model, cfg, batch, adv)
    lp, _, _ = _by_hand(model, cfg, batch, adv)
    w = _plan_weights(cfg, lp, batch, adv)
    assert float((w * batch.mask).sum() / batch.mask.sum()) == pytest.approx(1.0)  # mean 1 over the whole batch
    _, _, ref = _by_hand(model, cfg, batch, adv, weights=w.float())
    _assert_grads(got, ref)


def test_bypass_takes_the_engines_logprobs_as_pi_old(setup):
    model, batch, rewards = setup
    cfg = _cfg("parity.correction.preset=bypass_ppo_clip")
    adv = _advantages(cfg, batch, rewards)
    _, metrics, got = _pass(model, cfg, batch, adv)
    # PPO's ratio is now pi_theta / pi_rollout: far from 1 here, so the clip acts
    assert metrics["train/clip_frac_low"] + metrics["train/clip_frac_high"] > 0
    _, _, ref = _by_hand(model, cfg, batch, adv, old=batch.rollout_logprobs)
    _assert_grads(got, ref)


def test_unbiased_kl_weights_the_kl_term_by_the_rollout_ratio(setup):
    model, batch, rewards = setup
    cfg = _cfg("algorithm.kl_coef=0.5", "parity.correction.unbiased_kl=true")
    adv = _advantages(cfg, batch, rewards)
    _, _, got = _pass(model, cfg, batch, adv)
    ref_lp = reference_logprobs(model, batch, temperature=1.0)
    _, _, ref = _by_hand(model, cfg, batch, adv, ref=ref_lp, behaviour=batch.rollout_logprobs)
    _assert_grads(got, ref)
    _, _, plain = _by_hand(model, cfg, batch, adv, ref=ref_lp)
    assert any((plain[n] - ref[n]).abs().max() > 1e-4 * plain[n].abs().max() for n in ref)  # it does change it


def test_several_updates_compute_the_weights_once_on_the_whole_batch(setup, monkeypatch):
    model, batch, rewards = setup
    cfg = _cfg("algorithm.mini_batches=2", "parity.correction.rule=token_tis", "parity.correction.batch_normalize=true")
    adv = _advantages(cfg, batch, rewards)

    calls = []
    real = update.correction_weights
    monkeypatch.setattr(update, "correction_weights", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    _pass(model, cfg, batch, adv)
    assert calls == [batch.mask.shape]  # once, on every row; the mini-batches take their rows of it


def test_report_is_the_shadow_row_in_use_and_the_tables_count_every_token(setup):
    model, batch, rewards = setup
    cfg = _cfg("parity.correction.rule=token_mis", "parity.correction.token_mis.high=1.5",
               "parity.correction.shadow=true")
    adv = _advantages(cfg, batch, rewards)
    scores, _, _ = _pass(model, cfg, batch, adv)
    metrics, tables = correction_report(cfg.parity.correction, batch, scores, adv, DataParallel(), shadow=True)
    n = metrics["correction/num_tokens"]
    assert n == float(batch.mask.sum()) and metrics["correction/frac_masked"] > 0
    (row,) = [r for r in tables["correction_shadow"] if r["in_use"]]
    assert row["rule"] == "token_mis" and row["options"] == "token_mis(low=0.5, high=1.5)"
    for c in ("frac_masked", "frac_clipped", "frac_seqs_masked", "ess", "weight_mean", "loss_change", "signal_kept"):
        assert row[c] == metrics[f"correction/{c}"], c
    for name in ("correction_by_position", "correction_by_rollout_prob", "correction_by_entropy"):
        rows = tables[name]
        assert sum(r["num_tokens"] for r in rows) == n, name
        assert sum(r["frac_masked"] * r["num_tokens"] for r in rows) == pytest.approx(metrics["correction/frac_masked"] * n)
    # the weights the update used are the ones the report describes
    w = correction_weights(cfg, scores.logprobs, batch, adv)
    assert float((w == 0).logical_and(batch.mask > 0).sum()) == pytest.approx(metrics["correction/frac_masked"] * n)


def test_without_a_rule_the_raw_ratios_are_still_reported(setup):
    model, batch, rewards = setup
    cfg = _cfg()
    adv = _advantages(cfg, batch, rewards)
    scores, _, _ = _pass(model, cfg, batch, adv)
    metrics, tables = correction_report(cfg.parity.correction, batch, scores, adv, DataParallel())
    assert tables == {} and metrics["correction/frac_masked"] == 0 and metrics["correction/ess"] == pytest.approx(1)
    assert metrics["correction/raw/ratio_max"] > 1.5 and metrics["correction/raw/chi2_token"] > 0.1


def test_opsm_is_recomputed_at_every_update_from_the_policy_being_updated(setup, monkeypatch):
    """DeepSeek-V3.2's mask compares the engine with pi_theta, the policy being updated: with two updates on one
    batch, the second update's mask is the one the moved policy gives, computed here by hand, not pi_old's."""

    import trainer.rl.update as update

    model, batch, rewards = setup
    delta = 0.05
    cfg = _cfg("algorithm.epochs=2", "train.micro_batch_size=8", "parity.correction.rule=opsm",
               f"parity.correction.opsm.delta={delta}")
    adv = _advantages(cfg, batch, rewards)
    with torch.no_grad():
        lp_old, _ = completion_logprobs(model, batch, temperature=1.0)
    # every sequence's mean(lp_r - lp_old) sits 1e-3 above or below delta, in turn: a policy moving the mean by more
    # than that flips a negative-advantage sequence's mask
    b = copy.copy(batch)
    b.rollout_logprobs = (lp_old + delta + 1e-3 * torch.tensor([1.0, -1.0] * 4)[:, None]) * batch.mask
    negative = adv[:, 0] < 0

    def by_hand(lp, micro, a):
        """Keep a row unless its advantage is negative and its mean_t(lp_r - lp) exceeds delta."""
        m = micro.mask > 0
        gap = ((micro.rollout_logprobs - lp) * m).sum(1) / m.sum(1)
        return ~((a[:, 0] < 0) & (gap > delta))

    seen = []
    real = update.correction_weights

    def spy(cfg_, logprobs, micro, a, *args, **kwargs):
        w = real(cfg_, logprobs, micro, a, *args, **kwargs)
        if kwargs.get("policy") == "current":
            with torch.no_grad():
                now, _ = completion_logprobs(model, micro, temperature=1.0)  # the policy at this update
            seen.append((w, by_hand(now.double(), micro, a), micro.mask > 0))
        return w

    monkeypatch.setattr(update, "correction_weights", spy)
    trainable = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in trainable]
    opt = torch.optim.SGD(trainable, lr=2.0)

    def step():
        opt.step()
        opt.zero_grad()
        return 0.0

    learner = Learner(cfg=cfg, model=model, backward=lambda loss: loss.backward(), step=step)
    try:
        model.zero_grad()
        several_updates(learner, b, adv, score_pass(learner, b), step=1)
    finally:
        with torch.no_grad():
            for p, s in zip(trainable, saved):
                p.copy_(s)
        model.zero_grad()
    assert len(seen) == 2  # one micro-batch per update, two updates
    (w1, hand1, m1), (w2, hand2, m2) = seen
    for w, hand, m in seen:
        assert torch.equal(w, (hand[:, None] & m).float())  # 1 on the kept rows' tokens, 0 on the dropped rows'
    # the first update's policy is pi_old: its mask drops the negative-advantage rows placed above delta
    assert int((~hand1).sum()) >= 1 and bool(negative.any())
    assert not torch.equal(hand1, hand2)  # the policy moved: the second update's mask is another
