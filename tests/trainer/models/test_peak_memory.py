"""``perf/peak_memory_gb``: how it is measured on the CPU, and the run summary's line."""
import resource
from types import SimpleNamespace

import pytest

from trainer.lifecycle.summary import print_summary
from trainer.models import memory
from trainer.models.memory import GIB, peak_memory_gb


def test_cpu_peak_is_the_process_peak_rss_in_gib(monkeypatch):
    usage = SimpleNamespace(ru_maxrss=3 * 1024 * 1024 // 2)  # Linux: KiB -> 1.5 GiB
    monkeypatch.setattr(memory.resource, "getrusage", lambda who: usage)
    monkeypatch.setattr(memory.sys, "platform", "linux")
    assert peak_memory_gb("cpu") == 1.5
    usage.ru_maxrss = 3 * GIB  # macOS: bytes
    monkeypatch.setattr(memory.sys, "platform", "darwin")
    assert peak_memory_gb("cpu") == 3.0


def test_cpu_peak_of_this_process_is_read_from_getrusage():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    assert before <= peak_memory_gb() == pytest.approx(before, abs=0.5)


def test_the_summary_prints_the_runs_largest_peak(tmp_path, capsys):
    rows = [{"step": s, "reward/mean": 0.5, "parity/mae": 1e-3, "parity/kl_k3": 1e-6, "parity/max_abs": 0.1,
             "perf/peak_memory_gb": gb} for s, gb in ((1, 1.25), (2, 2.5), (3, 2.0))]
    got = {}
    logger = SimpleNamespace(enabled=True, metrics_path=tmp_path / "missing.jsonl", wandb_location="disabled",
                             summary=got.update)
    print_summary(rows, tmp_path / "step_3", logger)
    assert "memory   peak 2.50 GiB (CUDA: torch.cuda.max_memory_allocated; CPU: the process's peak RSS)" in \
        capsys.readouterr().out
    assert got["summary/peak_memory_gb"] == 2.5
