"""correction/* metrics pinned to hand-computed values, pooled over shards exactly, and each documented once."""
import math
import re
from pathlib import Path

import pytest
import torch
from correction_batch import MASK, ROLL, TRAIN, inputs  # this folder is on sys.path

from parity.corrections import CorrectionInputs, CorrectionPlan, correction_metrics, correction_stats, reduction
from parity.corrections.stats import finalize, signed_quantile

REPO = Path(__file__).resolve().parents[3]
E = math.exp


def test_raw_ratio_statistics_before_any_truncation():
    m, _ = correction_metrics(inputs(), CorrectionPlan(("token_tis",)))
    rho = [E(0.9), E(-0.1), 1.0, E(-1.0), E(-0.6)]  # 2.459603 .904837 1 .367879 .548812
    assert m["correction/num_tokens"] == 5 and m["correction/num_seqs"] == 2
    assert m["correction/raw/ratio_mean"] == pytest.approx(sum(rho) / 5)  # 5.281131 / 5 = 1.056226
    # 5 tokens: the nearest-rank p1 is the smallest, p99 the largest (exact: the histogram edges are capped there)
    assert m["correction/raw/ratio_p1"] == pytest.approx(E(-1.0))
    assert m["correction/raw/ratio_p99"] == pytest.approx(E(0.9))
    assert m["correction/raw/ratio_max"] == pytest.approx(E(0.9))  # 2.459603: before the cap of 2
    # chi2 = mean(rho^2) - 1 = (6.049647 + .818731 + 1 + .135335 + .301194) / 5 - 1 = 0.660982
    assert m["correction/raw/chi2_token"] == pytest.approx(sum(r * r for r in rho) / 5 - 1)
    assert m["correction/raw/ess_token"] == pytest.approx(sum(rho) ** 2 / (5 * sum(r * r for r in rho)))
    # sequences: prod rho = 2.225541, 0.201897
    seq = [E(0.8), E(-1.6)]
    assert m["correction/raw/seq_ratio_mean"] == pytest.approx(sum(seq) / 2)
    assert m["correction/raw/seq_ratio_p1"] == pytest.approx(E(-1.6))
    assert m["correction/raw/seq_ratio_p99"] == m["correction/raw/seq_ratio_max"] == pytest.approx(E(0.8))
    assert m["correction/raw/chi2_seq"] == pytest.approx((E(1.6) + E(-3.2)) / 2 - 1)  # 1.496897
    assert m["correction/raw/ess_seq"] == pytest.approx(sum(seq) ** 2 / (2 * (E(1.6) + E(-3.2))))


def test_what_the_weights_changed():
    m, _ = correction_metrics(inputs(), CorrectionPlan(("token_tis",)))
    w = [2.0, E(-0.1), 1.0, E(-1.0), E(-0.6)]
    assert m["correction/frac_clipped"] == pytest.approx(0.2) and m["correction/frac_masked"] == 0.0
    assert m["correction/frac_seqs_masked"] == 0.0
    assert m["correction/weight_mean"] == pytest.approx(sum(w) / 5)  # 0.964306
    assert m["correction/ess"] == pytest.approx(0.743283, abs=1e-6)  # 4.821528^2 / (5 * 6.255260)
    # A = +1, +1, +1, -1, -1: loss change = -mean((w - 1) A) = -((1 + -.095163 + 0) - (-.632121 + -.451188)) / 5
    assert m["correction/loss_change"] == pytest.approx(-(1.0 + E(-0.1) - 1 + 0 - (E(-1.0) - 1) - (E(-0.6) - 1)) / 5)
    # signal kept: sum w|A| / sum |A| = 4.821528 / 5
    assert m["correction/signal_kept"] == pytest.approx(sum(w) / 5)
    assert "correction/batch_norm_factor" not in m and not any(k.count("/") > 2 for k in m)


def test_masking_rule_metrics():
    m, _ = correction_metrics(inputs(), CorrectionPlan(("opsm",)))  # row 1 (A = -1) masked
    assert m["correction/frac_masked"] == pytest.approx(0.4) and m["correction/frac_seqs_masked"] == 0.5
    assert m["correction/ess"] == pytest.approx(0.6)  # 3^2 / (5 * 3)
    # dropping the two A = -1 tokens raises the ratio-1 loss -mean(w A) from -(3 - 2) / 5 to -3 / 5: change -0.4
    assert m["correction/loss_change"] == pytest.approx(-0.4)
    assert m["correction/signal_kept"] == pytest.approx(0.6)


def test_several_rules_report_each_and_batch_norm_factor():
    m, out = correction_metrics(inputs(), CorrectionPlan(("token_tis", "token_k1"), batch_normalize=True))
    assert m["correction/token_tis/frac_clipped"] == pytest.approx(0.2)
    assert m["correction/token_tis/frac_masked"] == 0.0
    assert m["correction/token_k1/frac_masked"] == pytest.approx(0.4)
    # the clipped token (rho 2.46) is also outside token_k1's band: masked overall, not clipped
    assert m["correction/frac_clipped"] == 0.0 and m["correction/frac_masked"] == pytest.approx(0.4)
    assert m["correction/batch_norm_factor"] == pytest.approx((2 + E(-0.1) + 1 + E(-1.0) + E(-0.6)) / 5)


def test_no_advantages_no_loss_keys_and_empty_batch():
    m, _ = correction_metrics(CorrectionInputs.of(TRAIN, ROLL, MASK), CorrectionPlan(("token_tis",)))
    assert "correction/loss_change" not in m and "correction/ess" in m
    m, _ = correction_metrics(CorrectionInputs.of(TRAIN, ROLL, torch.zeros(2, 3)), CorrectionPlan(("token_tis",)))
    assert m == {"correction/num_tokens": 0.0, "correction/num_seqs": 0.0}


def test_huge_ratios_do_not_overflow():
    train = TRAIN.clone()
    train[0, 0] = 900.0  # d = 901: rho would be inf
    m, out = correction_metrics(inputs(train=train), CorrectionPlan(("seq_tis",)))
    assert all(math.isfinite(v) for v in m.values()), m
    assert m["correction/raw/ratio_max"] == pytest.approx(E(20.0))  # clamped at verl's SAFETY_BOUND
    assert out.weights[0, 0] == 2.0  # the product ratio is compared in log space: capped, never formed


def _pool(parts):
    out = {}
    for k in parts[0]:
        vals = torch.stack([p[k] for p in parts])
        out[k] = vals.amax(0) if reduction(k) == "max" else vals.sum(0)
    return out


def test_pooled_over_shards_equals_one_batch():
    g = torch.Generator().manual_seed(0)
    train = -torch.rand(16, 9, generator=g) * 3
    roll = train + 0.3 * torch.randn(16, 9, generator=g)
    mask = torch.rand(16, 9, generator=g) > 0.2
    adv = torch.randn(16, 1, generator=g).expand(16, 9).clone()
    plan = CorrectionPlan(("token_tis", "seq_mean_k3"), {})
    whole = finalize(correction_stats(CorrectionInputs.of(train, roll, mask, adv),
                                      plan.apply(CorrectionInputs.of(train, roll, mask, adv)), plan))
    shards = []
    for rows in (slice(0, 5), slice(5, 11), slice(11, 16)):
        inp = CorrectionInputs.of(train[rows], roll[rows], mask[rows], adv[rows])
        shards.append(correction_stats(inp, plan.apply(inp), plan))
    pooled = finalize(_pool(shards))
    assert pooled.keys() == whole.keys()
    for k in whole:
        assert pooled[k] == pytest.approx(whole[k], rel=1e-12, abs=1e-12), k


def test_histogram_percentiles_are_never_less_extreme_and_within_a_bin():
    g = torch.Generator().manual_seed(1)
    d = torch.randn(4000, generator=g, dtype=torch.float64) * 0.2
    m, _ = correction_metrics(CorrectionInputs.of(d.view(40, 100), torch.zeros(40, 100), torch.ones(40, 100)),
                              CorrectionPlan())
    s = torch.sort(d).values
    exact_p1, exact_p99 = float(s[math.ceil(0.01 * 4000) - 1]), float(s[math.ceil(0.99 * 4000) - 1])
    p1, p99 = math.log(m["correction/raw/ratio_p1"]), math.log(m["correction/raw/ratio_p99"])
    assert exact_p1 * 1.024 <= p1 <= exact_p1 and exact_p99 <= p99 <= exact_p99 * 1.024


def test_signed_quantile_by_hand():
    from parity.metrics import _abs_hist

    # values -2, -0.5, 0, 0.5, 3: nearest rank of q = 0.4 is the 2nd smallest (-0.5), of 0.6 the 3rd (0)
    x = torch.tensor([-2.0, -0.5, 0.0, 0.5, 3.0], dtype=torch.float64)
    neg, pos = _abs_hist(-x[x < 0]), _abs_hist(x[x >= 0])
    assert -0.5 * 1.024 <= signed_quantile(neg, pos, 0.4, -2.0, 3.0) <= -0.5
    assert 0 <= signed_quantile(neg, pos, 0.6, -2.0, 3.0) <= 1e-7
    assert signed_quantile(neg, pos, 0.0, -2.0, 3.0) == -2.0 and signed_quantile(neg, pos, 1.0, -2.0, 3.0) == 3.0


def test_every_key_is_documented_once():
    # in the first cell of exactly one row of docs/parity-metrics.md's tables
    page = (REPO / "docs" / "parity-metrics.md").read_text()
    cells = [line.split("|")[1] for line in page.splitlines() if line.startswith("| `")]
    m, _ = correction_metrics(inputs(), CorrectionPlan(("token_tis", "token_k1"), batch_normalize=True))
    assert "correction/batch_norm_factor" in m and "correction/token_k1/frac_masked" in m
    for key in m:
        generic = re.sub(r"^correction/(token_tis|token_k1)/", "correction/<rule>/", key)
        rows = [c for c in cells if f"`{generic}`" in c]
        assert len(rows) == 1, f"{generic} is in {len(rows)} rows of docs/parity-metrics.md"
