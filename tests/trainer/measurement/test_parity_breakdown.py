import json

import torch

from trainer.measurement.parity_breakdown import append_breakdown, step_breakdown


class FakeTok:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def test_breakdown_rows_and_worst_token_text(tmp_path):
    t = torch.tensor([[-0.1, -0.5, 0.0], [-1.0, -2.0, -3.0]])
    r = torch.tensor([[-0.1, -0.3, 9.0], [-1.5, -2.0, -3.0]])  # d = [0, -0.2, pad], [0.5, 0, 0]
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    targets = torch.tensor([[7, 8, -100], [9, 10, 11]])
    ent = torch.tensor([[0.05, 0.3, 0.0], [1.5, 0.0, 0.0]])
    b = step_breakdown(t, r, mask, targets, FakeTok(), entropy=ent, k=2)
    worst = b["worst_tokens"]
    assert [(w["sample"], w["position"], w["token"]) for w in worst] == [(1, 0, "<9>"), (0, 1, "<8>")]
    assert abs(worst[0]["d"] - 0.5) < 1e-6
    # position 0 holds d = 0 and 0.5 -> mean |d| 0.25 over 2 tokens
    first = b["by_position"][0]
    assert first["num_tokens"] == 2 and abs(first["mean_abs_d"] - 0.25) < 1e-6
    assert sum(row["num_tokens"] for row in b["by_entropy"]) == 5
    append_breakdown(tmp_path, 3, b)
    line = json.loads((tmp_path / "parity_breakdown.jsonl").read_text())
    assert line["step"] == 3 and line["worst_tokens"][0]["token_id"] == 9
