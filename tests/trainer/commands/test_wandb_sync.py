"""The README's offline wandb workflow, as far as it runs offline: a resumed run's two offline folders hold one
run id, and `wandb sync` given them (--dry-run: no upload, no credentials) would sync both into that run."""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from trainer.io.run_logger import RunLogger

REPO = Path(__file__).resolve().parents[3]


def test_readme_sync_command_takes_both_folders_of_a_resumed_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "runs" / "demo"
    first = RunLogger(run_dir, config={}, wandb_mode="offline")
    first.log(1, {"reward/mean": 0.25}, echo=False)
    run_id = first.wandb_run.id
    first.close()
    # wandb names an offline folder by its start time to the second (offline-run-YYYYMMDD_HHMMSS-<id>): a resume
    # started within the same second would write into the first folder, as a real resume never does
    time.sleep(1.1)
    resumed = RunLogger(run_dir, config={}, wandb_mode="offline", resume=True)
    resumed.log(2, {"reward/mean": 0.5}, echo=False)
    resumed.close()
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and {f.name.rsplit("-", 1)[1] for f in folders} == {run_id}

    readme = (REPO / "README.md").read_text()
    assert "wandb sync runs/<name>/wandb/offline-run-*" in readme
    env = {k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}
    env["HOME"] = str(tmp_path / "home")  # no ~/.netrc credentials: nothing could be uploaded
    wandb = Path(sys.executable).with_name("wandb")
    proc = subprocess.run([str(wandb), "sync", "--dry-run", *map(str, folders)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert "Would sync 2 run(s)" in out, out
    assert len(re.findall(rf"run-{run_id}\.wandb", out)) == 2
