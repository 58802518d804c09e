import json
import time

from trainer.io.run_logger import RunLogger, resolve_wandb_mode


def test_auto_mode_is_offline_without_credentials(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    assert resolve_wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the environment wins, as wandb's own variable
    assert resolve_wandb_mode("online") == "disabled"


def test_metrics_jsonl_appends_and_nulls_non_finite(tmp_path, capsys):
    log = RunLogger(tmp_path, config={}, wandb_mode="disabled", total_steps=2)
    log.log(1, {"reward/mean": 0.5, "parity/mae": float("nan")})
    log.log(2, {"reward/mean": 0.75})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "reward/mean": 0.5, "parity/mae": None}, {"step": 2, "reward/mean": 0.75}]
    assert "step    2/2" in capsys.readouterr().out
    # a resumed run appends; nothing earlier is lost
    log = RunLogger(tmp_path, config={}, wandb_mode="disabled", total_steps=3)
    log.log(3, {"reward/mean": 1.0})
    log.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_non_main_process_writes_nothing(tmp_path):
    log = RunLogger(tmp_path / "r", config={}, wandb_mode="offline", enabled=False)
    log.log(1, {"a": 1.0})
    log.close()
    assert not (tmp_path / "r").exists()


def test_an_online_start_that_cannot_connect_gives_up_within_10_s_and_goes_offline(tmp_path, monkeypatch):
    """An invalid key / no network: wandb waits for its server up to init_timeout; online gets 10 s, then offline."""
    import sys
    import types

    import pytest

    from trainer.io.run_logger import RunLogger

    calls = []

    def init(**kw):
        calls.append((kw["mode"], kw["settings"].init_timeout))
        if kw["mode"] == "online":
            raise TimeoutError("Run initialization has timed out")  # what wandb raises after init_timeout
        return types.SimpleNamespace(finish=lambda **k: None, define_metric=lambda *a, **k: None)

    fake = types.SimpleNamespace(init=init, Settings=lambda **kw: types.SimpleNamespace(**kw))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.warns(UserWarning, match="wandb online start failed.*retrying offline"):
        logger = RunLogger(tmp_path, config={}, wandb_mode="online")
    assert calls[0] == ("online", 10.0) and calls[1][0] == "offline"
    assert logger.wandb_mode == "offline"


def test_resume_continues_the_same_wandb_run_with_tags_and_package_versions(tmp_path, monkeypatch):
    """Offline: a resumed logger writes into the wandb run of the first (same id, resume='allow'); read back from
    the offline run directories wandb leaves in the run directory."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    first = RunLogger(tmp_path, config={"a": 1}, wandb_mode="offline", tags=("algorithm:grpo", "precision:bf16"))
    run_id = first.wandb_run.id
    assert tuple(first.wandb_run.tags) == ("algorithm:grpo", "precision:bf16")
    assert first.wandb_run.config["packages"]["torch"] and first.wandb_run.config["a"] == 1
    first.log(1, {"reward/mean": 0.5}, echo=False)
    first.close()
    time.sleep(1.1)  # offline folders are named to the second: a real resume starts in a later one
    second = RunLogger(tmp_path, config={"a": 1}, wandb_mode="offline", resume=True)
    assert second.wandb_run.id == run_id
    second.log(2, {"reward/mean": 0.6}, echo=False)
    second.close()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{run_id}" in r.name for r in runs)
    assert all((r / f"run-{run_id}.wandb").is_file() for r in runs)
    # a new (not resumed) logger in a fresh directory gets another id
    third = RunLogger(tmp_path / "other", config={}, wandb_mode="offline")
    assert third.wandb_run.id != run_id
    third.close()


def test_wandb_charts_use_the_training_step_and_get_the_mismatch_histogram(tmp_path, monkeypatch):
    """Read back from the offline run: define_metric (step axis, tokens axis, max summaries), the step on every
    row, and a histogram logged as wandb's histogram type with the given bins."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    from wandb_records import history, metric_definitions

    monkeypatch.setenv("WANDB_MODE", "offline")
    log = RunLogger(tmp_path, config={}, wandb_mode="offline")
    log.log_histogram(3, "parity/log10_abs_d", [2.0, 5.0], [-7.0, -6.9, -6.8])
    log.log(3, {"parity/mae": 0.25, "train/tokens_seen": 96.0}, echo=False)
    run_id = log.wandb_run.id
    log.close()
    (path,) = (tmp_path / "wandb").glob(f"offline-run-*/run-{run_id}.wandb")
    defs = {(d.name or d.glob_name): d for d in metric_definitions(path)}
    assert defs["*"].step_metric == "train/global_step" and defs["*"].options.step_sync
    assert {"train/global_step", "train/tokens_seen"} <= set(defs) and defs["parity/mae"].summary.max
    rows = history(path)
    merged = {k: v for row in rows for k, v in row.items()}
    assert merged["parity/log10_abs_d._type"] == '"histogram"'
    assert merged["parity/log10_abs_d.values"] == "[2,5]" and merged["parity/log10_abs_d.bins"] == "[-7,-6.9,-6.8]"
    assert merged["parity/mae"] == "0.25" and merged["train/global_step"] == "3" and merged["_step"] == "3"


def test_long_tags_are_cut_to_wandbs_limit_keeping_their_end(tmp_path, monkeypatch):
    """wandb refuses a tag over 64 characters, and with it the run: a model path tag keeps its kind and its end."""
    from trainer.io.run_logger import fit_tag

    path = "/tmp/pytest-of-root/pytest-13/test_sft_merge_rm_ppo_end_to_e0/merged"
    tag = fit_tag(f"model:{path}")
    assert len(tag) == 64 and tag.startswith("model:…") and tag.endswith("ppo_end_to_e0/merged")
    assert fit_tag("algorithm:grpo") == "algorithm:grpo"
    monkeypatch.setenv("WANDB_MODE", "offline")
    log = RunLogger(tmp_path, config={}, wandb_mode="offline", tags=(f"model:{path}", "sft"))
    assert log.wandb_run is not None and tuple(log.wandb_run.tags) == (tag, "sft")
    log.close()
