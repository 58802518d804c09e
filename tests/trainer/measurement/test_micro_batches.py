"""Micro-batches cut longest-first (trainer/measurement/micro_batches.py), and packed: the update pass is unchanged.

The loss is normalised by whole-batch counts, so grouping rows differently only reorders a sum:
loss, metrics and every LoRA gradient equal the row-order path to float32 rounding (not
bitwise: summation order, and GEMMs of other shapes). Float32, random-init model at std 0.2.
Measured: gradients within 2.3e-6 of each tensor's largest entry; the loss (a sum of signed
terms that nearly cancel: 0.0088 from terms of ~0.05) within 1.1e-5 relative, hence the tolerances.
"""
import pytest
import torch

from trainer.algorithms import ADVANTAGES, AdvantageInputs
from trainer.builtin.zoo import ensure_arch_model
from trainer.lifecycle.preflight import load_recipe
from trainer.measurement import micro_batches
from trainer.measurement.micro_batches import length_order, micro_batch_rows
from trainer.models.batch import build_token_batch
from trainer.models.policy import add_lora, completion_logprobs, load_base_model
from trainer.rl.learner import Learner
from trainer.rl.update import policy_gradient_pass, score_pass, several_updates


def test_length_order_is_longest_first_and_stable():
    # total lengths (prompt + completion): 3, 6, 3, 8
    b = build_token_batch([[1, 2], [1], [3, 4], [5, 6, 7]], [[9], [9, 9, 9, 9, 9], [9], [9] * 5], pad_id=0)
    assert length_order(b).tolist() == [3, 1, 0, 2]
    assert [r.tolist() for r in micro_batch_rows(b, 3)] == [[3, 1, 0], [2]]
    assert [r.tolist() for r in micro_batch_rows(b, 2, order=torch.arange(4))] == [[0, 1], [2, 3]]


@pytest.fixture(scope="module")
def setup():
    """(model, cfg, batch, advantages): 12 rows, completion lengths 2..20 (10x) in shuffled order."""
    torch.manual_seed(0)
    model = add_lora(load_base_model(str(ensure_arch_model("qwen2")), "float32"),
                     load_recipe("recipes/grpo_tiny.yaml", check_paths=False).model.lora)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    g = torch.Generator().manual_seed(1)
    lengths = [20, 2, 11, 3, 17, 5, 2, 14, 8, 2, 20, 6]
    prompts = [torch.randint(5, 500, (3 + i % 4,), generator=g).tolist() for i in range(12)]
    completions = [torch.randint(5, 500, (n,), generator=g).tolist() for n in lengths]
    batch = build_token_batch(prompts, completions, pad_id=0)
    with torch.no_grad():  # "engine" log-probs: the trainer's, perturbed, so ratios and corrections are not 1
        lp, _ = completion_logprobs(model, batch, temperature=1.0)
    batch.rollout_logprobs = (lp + 0.05 * torch.randn(lp.shape, generator=g)) * batch.mask
    rewards = torch.tensor([float(i % 3 == 0) for i in range(12)])
    return model, batch, rewards


def _cfg(*overrides):
    return load_recipe("recipes/grpo_tiny.yaml", ["algorithm.group_size=4", "train.micro_batch_size=4",
                                                  "parity.correction.rule=token_tis", *overrides], check_paths=False)


def _advantages(cfg, batch, rewards):
    a = cfg.algorithm
    return ADVANTAGES.get(a.name)(AdvantageInputs(rewards=rewards, mask=batch.mask, group_size=a.group_size),
                                  a.options)


def _pass(model, cfg, batch, rewards):
    model.zero_grad()
    scores, metrics = policy_gradient_pass(Learner(cfg=cfg, model=model, backward=lambda loss: loss.backward()),
                                           batch, _advantages(cfg, batch, rewards))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return scores, metrics, grads


def _assert_same(got, ref):
    (s, m, g), (s_ref, m_ref, g_ref) = got, ref
    torch.testing.assert_close(s.logprobs, s_ref.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(s.entropy, s_ref.entropy, rtol=0, atol=1e-5)
    assert m.keys() == m_ref.keys()
    for k in m:
        assert m[k] == pytest.approx(m_ref[k], rel=1e-4, abs=1e-7), k
    assert g.keys() == g_ref.keys() and len(g) > 0
    for n in g:
        torch.testing.assert_close(g[n], g_ref[n], rtol=0, atol=1e-5 * float(g_ref[n].abs().max()), msg=n)


@pytest.mark.parametrize("algo", ["grpo", "gspo"])
@pytest.mark.parametrize("pack", [False, True], ids=["bucketed", "packed"])
def test_update_pass_equals_row_order(setup, monkeypatch, algo, pack):
    model, batch, rewards = setup
    ref_cfg, cfg = _cfg(f"algorithm.name={algo}"), _cfg(f"algorithm.name={algo}", f"train.pack_sequences={pack}")
    # the length order does regroup this batch: micro-batch widths 20+6 longest first vs 20+6 in row order
    assert [r.tolist() for r in micro_batch_rows(batch, 4)] != [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    got = _pass(model, cfg, batch, rewards)
    with monkeypatch.context() as m:  # the row-order path: micro-batches cut as the rows come
        m.setattr(micro_batches, "length_order", lambda b: torch.arange(len(b)))
        ref = _pass(model, ref_cfg, batch, rewards)
    assert ref[1]["train/loss"] != 0.0
    _assert_same(got, ref)


def test_several_updates_and_score_pass_equal_row_order(setup, monkeypatch):
    """PPO-style: pi_old scored first, then two mini-batches, each bucketed (and packed) within itself."""
    model, batch, rewards = setup
    cfg = _cfg("algorithm.mini_batches=2", "train.pack_sequences=true")

    def run():
        model.zero_grad()
        params = [p for p in model.parameters() if p.requires_grad]
        start = [p.detach().clone() for p in params]
        opt = torch.optim.SGD(params, lr=0.1)

        def step():
            opt.step()
            opt.zero_grad()
            return 0.0

        learner = Learner(cfg=cfg, model=model, backward=lambda loss: loss.backward(), step=step)
        old = score_pass(learner, batch)
        metrics, last = several_updates(learner, batch, _advantages(cfg, batch, rewards), old, step=1)
        moved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, s in zip(params, start):
                p.copy_(s)
        return old, metrics, last, moved

    got = run()
    with monkeypatch.context() as m:
        m.setattr(micro_batches, "length_order", lambda b: torch.arange(len(b)))
        ref_cfg_pack = cfg.train.pack_sequences
        cfg.train.pack_sequences = False
        try:
            ref = run()
        finally:
            cfg.train.pack_sequences = ref_cfg_pack
    torch.testing.assert_close(got[0].logprobs, ref[0].logprobs, rtol=0, atol=1e-5)
    for k in ref[1]:
        assert got[1][k] == pytest.approx(ref[1][k], rel=1e-4, abs=1e-7), k
    torch.testing.assert_close(got[2].logprobs, ref[2].logprobs, rtol=0, atol=1e-5)
    for a, b in zip(got[3], ref[3]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * float(b.abs().max()))


def test_pack_sequences_with_flash_attention_is_refused():
    from trainer.config.schema import RecipeError

    with pytest.raises(RecipeError, match="train.pack_sequences.*flash_attention_2"):
        _cfg("train.pack_sequences=true", "model.attn_implementation=flash_attention_2")
