"""trainer/measurement/correction_report.py on a hand-made batch: which buckets the masked tokens fall in."""
import math
from types import SimpleNamespace

import pytest
import torch

from trainer.config import CorrectionSection
from trainer.distributed.data_parallel import DataParallel
from trainer.measurement.correction_report import correction_report
from trainer.measurement.scoring import Scores


def test_masked_tokens_by_position_probability_entropy_and_turn():
    # one episode row: turn 1 = positions 0-1, a reply (mask 0), turn 2 = positions 3-4; one single-turn row.
    # d = 1.0 (rho 2.72, outside token_k1's [0.5, 2]) at row 0's position 1 and row 1's position 0, else 0.
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.float32)
    rollout = torch.log(torch.tensor([[0.5, 0.05, 1.0, 0.95, 0.5], [0.05, 0.5, 0.95, 1.0, 1.0]])) * mask
    train = rollout.clone()
    train[0, 1] += 1.0
    train[1, 0] += 1.0
    entropy = torch.tensor([[0.005, 3.0, 0.0, 0.2, 0.2], [3.0, 0.2, 0.2, 0.0, 0.0]])
    batch = SimpleNamespace(rollout_logprobs=rollout, mask=mask)
    section = CorrectionSection(rule="token_k1")
    m, t = correction_report(section, batch, Scores(logprobs=train, entropy=entropy), torch.ones(2, 5) * mask,
                             DataParallel(), by_turn=True)
    assert m["correction/frac_masked"] == pytest.approx(2 / 7)
    # position = valid tokens before it in its row: row 0's tokens are at 0, 1, 2, 3 (the reply is not counted)
    assert t["correction_by_position"] == [
        {"position_start": 0.0, "position_end": 1.0, "num_tokens": 2, "frac_clipped": 0.0, "frac_masked": 0.5},
        {"position_start": 1.0, "position_end": 2.0, "num_tokens": 2, "frac_clipped": 0.0, "frac_masked": 0.5},
        {"position_start": 2.0, "position_end": 4.0, "num_tokens": 3, "frac_clipped": 0.0, "frac_masked": 0.0}]
    # both dropped tokens had engine probability 0.05: the [0, 0.1) bin
    prob = {r["prob_start"]: (r["num_tokens"], r["frac_masked"]) for r in t["correction_by_rollout_prob"]}
    assert prob[0.0] == (2, 1.0) and all(f == 0.0 for s, (n, f) in prob.items() if s > 0)
    ent = {r["entropy_start"]: (r["num_tokens"], r["frac_masked"]) for r in t["correction_by_entropy"]}
    assert ent[2.0] == (2, 1.0) and ent[0.0] == (1, 0.0)  # entropy 3.0 sits in [2, 4)
    assert t["correction_by_turn"] == [
        {"num_tokens": 5, "frac_clipped": 0.0, "frac_masked": 0.4, "turn": 1},
        {"num_tokens": 2, "frac_clipped": 0.0, "frac_masked": 0.0, "turn": 2}]
    assert "correction_shadow" not in t
    assert all(math.isfinite(v) for v in m.values())
