"""bench/parity/shadow_table.py: a run's shadow tables averaged per rule, beside the raw-ratio statistics of those steps."""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "parity"))

import shadow_table  # noqa: E402


def _row(rule, frac, in_use=False):
    return {"rule": rule, "in_use": in_use, "options": f"{rule}(x=1)", "frac_masked": frac, "frac_clipped": 0.0,
            "frac_seqs_masked": frac, "ess": 1 - frac, "weight_mean": 1 - frac, "loss_change": -frac,
            "signal_kept": 1 - frac}


def test_mean_over_the_shadow_steps(tmp_path, capsys):
    lines = [{"step": 1, "by_position": []},
             {"step": 2, "correction_shadow": [_row("token_tis", 0.0, True), _row("seq_mean_k1", 0.2)]},
             {"step": 3, "correction_shadow": [_row("token_tis", 0.0, True), _row("seq_mean_k1", 0.4)]}]
    (tmp_path / "parity_breakdown.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    raw = {f"correction/raw/{k}": 1.0 for k in shadow_table.RAW}
    metrics = [{"step": s, **raw, "parity/mae": 0.001 * s, "correction/num_tokens": 100.0} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in metrics))
    assert shadow_table.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "steps 2..3 (2 with a shadow table)" in out
    assert "| **token_tis(x=1)** (in use) | 0.0000 |" in out
    assert "| seq_mean_k1(x=1) | 0.3000 | 0.0000 | 0.3000 | 0.7000 |" in out  # the mean of 0.2 and 0.4
    assert "| `parity/mae` | 0.0025 |" in out  # steps 2 and 3 only
    assert shadow_table.main([str(tmp_path), "--last"]) == 0
    assert "| seq_mean_k1(x=1) | 0.4000 |" in capsys.readouterr().out
