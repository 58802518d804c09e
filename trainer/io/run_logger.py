"""Per-step metrics to ``metrics.jsonl``, wandb and the console.

``metrics.jsonl`` gets one JSON object per step with exactly the keys sent to
wandb (plus ``step``); it is appended and flushed line by line, so a crash
loses at most the step being written. A resume (``resumed_step``) first moves the
rows past its checkpoint, which it trains again, to ``metrics.superseded.jsonl``
(and likewise ``samples.jsonl`` and ``parity_breakdown.jsonl``;
trainer/io/superseded_rows.py says why moved, not marked), so a step appears
once. A crash in the middle of a write leaves a partial last line: the next run
on the directory moves it to ``metrics.jsonl.partial-<time>`` (with a note)
before appending, so its first record starts on a line of its own instead of
being glued to the fragment and lost to every reader.

A file of the run directory that cannot be written here (a full disk at the
start) raises ``write_failure.StartNotWritten``: one sentence, exit status 6.

wandb runs online when credentials exist (``WANDB_API_KEY`` or a netrc entry),
offline otherwise (``wandb sync`` uploads it later); an online start that fails
for lack of network (or an invalid key) within ``ONLINE_INIT_TIMEOUT_S`` (10 s) falls
back to offline with a warning instead of failing or stalling the run.
"""
from __future__ import annotations

import json
import math
import netrc
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

from trainer.io import superseded_rows
from trainer.io.write_failure import writing_at_start


def _has_wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        rc = netrc.netrc(os.environ.get("NETRC", os.path.expanduser("~/.netrc")))
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return any("wandb" in host for host in rc.hosts)


def resolve_wandb_mode(mode: str) -> str:
    env = os.environ.get("WANDB_MODE")
    if env in ("online", "offline", "disabled"):
        return env
    if mode != "auto":
        return mode
    return "online" if _has_wandb_credentials() else "offline"


# An online start that has not connected within this time (no network, an invalid key: wandb
# waits for its server) falls back to offline with a warning instead of stalling the run.
ONLINE_INIT_TIMEOUT_S = 10.0
OFFLINE_INIT_TIMEOUT_S = 60.0


def _finite_or_none(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf; a null is visible and parseable
    return v


WANDB_ID_FILE = "wandb_run_id"
PACKAGES = ("parityrl", "vllm", "torch", "transformers", "peft", "accelerate", "deepspeed")


def package_versions() -> dict[str, str]:
    """Installed versions of the packages a run's numbers depend on (into the wandb config)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in PACKAGES:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = "not installed"
    return out


MAX_TAG = 64  # wandb refuses a longer tag, and with it the whole run (pydantic ValidationError in wandb.init)


def fit_tag(tag: str) -> str:
    """``tag`` cut to wandb's 64 characters keeping its ``kind:`` and its END (the informative part of a
    model path: ``model:/very/long/.../merged`` -> ``model:…/merged``)."""
    if len(tag) <= MAX_TAG:
        return tag
    head = tag[:tag.index(":") + 1] if ":" in tag[:20] else ""
    return head + "…" + tag[len(tag) - (MAX_TAG - len(head) - 1):]


STEP_METRIC = "train/global_step"  # HF's WandbCallback name for the x-axis, so TRL users find it


def _define_metrics(run) -> None:
    """Charts against the training step (every metric, also tables and histograms logged between rows),
    ``train/tokens_seen`` available as an x-axis, and the worst mismatch of the run as the summary."""
    try:
        run.define_metric(STEP_METRIC)
        run.define_metric("train/tokens_seen")
        run.define_metric("*", step_metric=STEP_METRIC, step_sync=True)
        for key in ("parity/mae", "parity/max_abs", "parity/kl_k3", "probe/mae", "probe/max_abs"):
            run.define_metric(key, summary="max")
    except Exception as e:  # noqa: BLE001 - chart settings must not cost the run its logging
        warnings.warn(f"wandb define_metric failed ({type(e).__name__}: {e}); charts use wandb's own step",
                      stacklevel=4)


def set_aside_partial_line(path: Path) -> Optional[Path]:
    """If ``path`` ends in a line without its newline (a crash mid-write), move that fragment to
    ``<path>.partial-<time>`` and cut it from ``path``, with a note; the file it went to, or None."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size == 0:
                return None
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return None
            # the fragment is at most one record: read backwards in blocks to its line's start
            start, block = size, 1 << 16
            while start > 0:
                f.seek(max(0, start - block))
                chunk = f.read(start - max(0, start - block))
                cut = chunk.rfind(b"\n")
                if cut >= 0:
                    start = start - len(chunk) + cut + 1
                    break
                start = max(0, start - block)
            f.seek(start)
            fragment = f.read()
    except FileNotFoundError:
        return None
    aside = path.with_name(f"{path.name}.partial-{time.strftime('%Y%m%dT%H%M%S')}")
    n = 1
    while aside.exists():
        aside, n = aside.with_name(f"{path.name}.partial-{time.strftime('%Y%m%dT%H%M%S')}-{n}"), n + 1
    aside.write_bytes(fragment)  # first the copy, then the cut: a crash in between loses nothing
    os.truncate(path, start)
    print(f"note: {path} ended in a partial line ({len(fragment)} bytes, a crash while writing it); moved it to "
          f"{aside} so the next record starts on its own line", flush=True)
    return aside


def eta_text(step: int, first_step: Optional[int], since_first_s: float, total_steps: int) -> str:
    """'123s' from the steps after the first one logged (``since_first_s``: the time since it ended), '-' before
    there is one (the first step's own time is mostly warm-up)."""
    done = step - (first_step if first_step is not None else step)
    if done <= 0 or not total_steps:
        return "-"
    return f"{since_first_s / done * (total_steps - step):.0f}s"


def distill_text(m: dict[str, Any]) -> str:
    """A step's distillation figures for its console line (a run with a teacher): the per-token reverse KL to the
    teacher, and on teacher-parity steps the share of it the teacher's numerics could account for; "" otherwise."""
    rkl = m.get("distill/reverse_kl")
    if not isinstance(rkl, (int, float)):
        return ""
    noise = m.get("distill/teacher_noise_frac")
    return f"distill rkl {rkl:+.3f}" + (f" noise {noise:.2f}" if isinstance(noise, (int, float)) else "") + "  "


class RunLogger:
    def __init__(self, run_dir: Path, *, config: dict, wandb_mode: str = "auto", project: str = "parityrl",
                 entity: Optional[str] = None, name: str = "run", total_steps: int = 0, print_every: int = 1,
                 enabled: bool = True, resume: bool = False, tags: tuple[str, ...] = (),
                 resumed_step: Optional[int] = None):
        """``resumed_step``: the step of the checkpoint this process resumed from (None: not a resume); the rows
        of the record files past it are moved aside, with one line on the console and a wandb summary key."""
        self.run_dir = Path(run_dir)
        self.enabled = enabled  # False on non-main processes
        self.total_steps = total_steps
        self.print_every = print_every
        self.metrics_path = self.run_dir / "metrics.jsonl"
        # The ETA counts from the end of the first step this process logs: that step carries the warm-up
        # (first kernels, the engine's first batch), ~10x a later step on CPU (issue 29).
        self._first_step: Optional[int] = None
        self._t_first: float = 0.0
        self.wandb_run = None
        self.wandb_mode = "disabled"
        if not enabled:
            return
        moved: dict[str, list[int]] = {}
        with writing_at_start(self.run_dir):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for record in superseded_rows.RECORD_FILES:  # before the rows are read, so none is glued to a fragment
                set_aside_partial_line(self.run_dir / record)
            if resumed_step is not None:  # before the append below opens it: a handle open during a rewrite would write to the replaced file
                moved = superseded_rows.move_superseded_rows(self.run_dir, resumed_step)
        with writing_at_start(self.run_dir, self.metrics_path):
            self._file = open(self.metrics_path, "a", buffering=1)
        mode = resolve_wandb_mode(wandb_mode)
        if mode != "disabled":
            self.wandb_run, self.wandb_mode = self._start_wandb(mode, project, entity, name,
                                                                {**config, "packages": package_versions()},
                                                                resume=resume, tags=tags)
        line = superseded_rows.resume_line(self.run_dir, resumed_step, moved, wandb=self.wandb_run is not None)
        if line:
            print(line, flush=True)
            steps = superseded_rows.step_ranges([s for v in moved.values() for s in v])
            self.summary({"resume/superseded_steps": f"{steps} (resumed from step {resumed_step})"})

    def _run_id(self, resume: bool) -> str:
        """The wandb run id of this run directory: kept in ``wandb_run_id`` so that ``--resume`` continues the
        same wandb run (its charts join) instead of starting a second one."""
        import secrets

        path = self.run_dir / WANDB_ID_FILE
        if resume and path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        run_id = secrets.token_hex(4)  # wandb's ids are short lowercase alphanumerics
        with writing_at_start(self.run_dir, path):
            path.write_text(run_id + "\n")
        return run_id

    def _start_wandb(self, mode: str, project: str, entity: Optional[str], name: str, config: dict, *,
                     resume: bool = False, tags: tuple[str, ...] = ()):
        try:
            import wandb
        except ImportError:
            warnings.warn("wandb is not installed; metrics go to metrics.jsonl only", stacklevel=3)
            return None, "disabled"
        wdir = self.run_dir
        run_id = self._run_id(resume)
        for attempt in ([mode, "offline"] if mode == "online" else [mode]):
            wait = ONLINE_INIT_TIMEOUT_S if attempt == "online" else OFFLINE_INIT_TIMEOUT_S
            try:
                run = wandb.init(project=project, entity=entity, name=name, config=config, dir=str(wdir), mode=attempt,
                                 settings=wandb.Settings(init_timeout=wait, console="off", silent=True),
                                 reinit="finish_previous", id=run_id, resume="allow",
                                 tags=[fit_tag(t) for t in tags] or None)
                _define_metrics(run)
                return run, attempt
            except Exception as e:  # noqa: BLE001 - any wandb failure must not end training
                warnings.warn(f"wandb {attempt} start failed ({type(e).__name__}: {e}); "
                              + ("retrying offline" if attempt == "online" else "metrics go to metrics.jsonl only"),
                              stacklevel=3)
        return None, "disabled"

    def log(self, step: int, metrics: dict[str, Any], *, echo: bool = True) -> None:
        """Append one step's metrics (and print the progress line every ``print_every`` steps, if ``echo``)."""
        if not self.enabled:
            return
        if not echo:
            self._write(step, metrics)
            return
        if self._first_step is None:
            self._first_step, self._t_first = step, time.time()
        self._write(step, metrics)
        if step % self.print_every == 0 or step == self.total_steps:
            self._print(step, metrics)

    def _write(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({**metrics, STEP_METRIC: step}, step=step)

    def _print(self, step: int, m: dict[str, Any]) -> None:
        eta = eta_text(step, self._first_step, time.time() - self._t_first, self.total_steps)

        def f(key: str, fmt: str) -> str:
            v = m.get(key)
            return format(v, fmt) if isinstance(v, (int, float)) else "-"

        print(f"step {step:>4}/{self.total_steps}  reward {f('reward/mean', '.3f')}  "
              f"parity mae {f('parity/mae', '.2e')} kl_k3 {f('parity/kl_k3', '.1e')}  {distill_text(m)}"
              f"loss {f('train/loss', '+.4f')}  rollout {f('perf/rollout_tokens_per_s', '.0f')} tok/s  "
              f"step {f('perf/step_s', '.1f')}s  ETA {eta}", flush=True, file=sys.stdout)

    def log_histogram(self, step: int, key: str, counts: list[float], edges: list[float]) -> None:
        """A ``wandb.Histogram`` of pre-binned counts (wandb only: metrics.jsonl keeps scalars)."""
        if not self.enabled or self.wandb_run is None:
            return
        import numpy as np
        import wandb

        self.wandb_run.log({key: wandb.Histogram(np_histogram=(np.asarray(counts), np.asarray(edges))),
                            STEP_METRIC: step}, step=step)

    def log_image(self, key: str, path: Path) -> None:
        """A picture (the run's timeline) as a ``wandb.Image`` under ``key`` (wandb only: the file is in the run
        folder already)."""
        if not self.enabled or self.wandb_run is None:
            return
        import wandb

        self.wandb_run.log({key: wandb.Image(str(path))})

    def summary(self, values: dict[str, Any]) -> None:
        if self.enabled and self.wandb_run is not None:
            for k, v in values.items():
                self.wandb_run.summary[k] = v

    @property
    def wandb_location(self) -> str:
        if self.wandb_run is None:
            return "wandb disabled"
        if self.wandb_mode == "online":
            return getattr(self.wandb_run, "url", None) or "online run"
        return f"{self.wandb_run.dir.rsplit('/files', 1)[0]} (offline: upload with `wandb sync` on that directory)"

    def close(self) -> None:
        if not self.enabled:
            return
        try:
            self._file.close()
        except OSError:  # the line whose write failed is still buffered; that failure was reported when it happened
            pass
        if self.wandb_run is not None:
            self.wandb_run.finish()
