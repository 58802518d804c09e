"""distill/* (trainer/teacher/metrics.py) against hand-computed values."""
import math

import torch

from trainer.teacher.metrics import distill_metrics, distill_sums, noise_frac

STUDENT = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.1, -3.0]])
TEACHER = torch.tensor([[-1.5, -1.0, 9.0], [-0.5, -0.4, -1.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])


def test_distill_metrics_hand_computed():
    # d = s - t on valid tokens: 0.5, -1.0 | 0.0, 0.3, -2.0 -> sum -2.2 over 5 tokens, 2 sequences; |d| sum 3.8
    top_s = torch.tensor([[4, 5, 6], [7, 8, 9]])
    top_t = torch.tensor([[4, 0, 6], [7, 8, 0]])  # agree at 3 of the 5 valid positions (the pad's match ignored)
    sums = distill_sums(STUDENT, TEACHER, MASK, top_s, top_t)
    assert sums["n"] == 5 and sums["seqs"] == 2 and math.isclose(sums["rkl"], -2.2, abs_tol=1e-6)
    assert math.isclose(sums["abs"], 3.8, abs_tol=1e-6) and sums["agree"] == 3
    m = distill_metrics(sums)
    assert math.isclose(m["distill/reverse_kl"], -0.44, abs_tol=1e-6)
    assert math.isclose(m["distill/reverse_kl_seq"], -1.1, abs_tol=1e-6)
    assert math.isclose(m["distill/top1_agree"], 0.6)
    # mean |d| = 0.76: a teacher engine 0.019 off its trainer-side scores is 2.5% of the signal
    assert math.isclose(noise_frac(0.019, sums), 0.025, rel_tol=1e-6)


def test_without_top1_no_agreement_and_identical_models_infinite_noise_frac():
    sums = distill_sums(TEACHER, TEACHER, MASK)
    assert "agree" not in sums and "distill/top1_agree" not in distill_metrics(sums)
    assert distill_metrics(sums)["distill/reverse_kl"] == 0.0
    assert noise_frac(1e-3, sums) == float("inf")
