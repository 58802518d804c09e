"""Held-out evaluation during RL (``eval:``): is the policy getting better at the task, not only at the reward?

Every ``eval.every`` steps, before step 1 and after the last, the engine (holding the weights just synced) samples
``eval.samples`` completions per held-out prompt at ``eval.temperature``, and one greedy completion per prompt
(``eval.greedy``), through the same sampling round as training (``Sampler.sample``: single-turn completions, or
episodes with ``env:``), scored by the same reward functions. The prompts are the first ``eval.num_prompts`` rows
of ``eval.source`` / ``eval.split`` (the same every time), split across data-parallel ranks.

Success rule: a completion is solved when ``eval.success_reward`` (default: the first reward function) gives at
least ``eval.success_threshold`` (1.0: the built-in exact-answer reward's "right").

Metrics (``eval/``, pooled over ranks; docs/evaluation.md):

* ``eval/mean@k``: the share of the k samples per prompt that are solved, averaged over prompts: the estimate of
  pass@1 from k samples;
* ``eval/pass@j`` for j in ``eval.pass_k`` (default 1 and k): the unbiased estimator of Chen et al. 2021
  (arXiv 2107.03374, Eq. 1), per prompt with c solved of n = k samples, ``1 - C(n - c, j) / C(n, j)``, averaged
  over prompts (``pass_at_k``); pass@1 equals mean@k;
* ``eval/greedy``: the share of greedy completions solved;
* ``eval/reward/mean`` and ``eval/reward/<name>`` over the sampled completions; ``eval/mean_length`` and
  ``eval/frac_truncated``;
* per data source when the rows have ``eval.source_column``: ``eval/<source>/mean@k``, ``pass@j``, ``greedy``;
* ``eval/parity/*``: the engine's log-probs of the sampled completions against the trainer's (one scoring pass, no
  gradient), as ``parity/*`` on the training batch: does the mismatch differ off the training distribution?

Seeds: each evaluation draws with the seed of its step (``eval_spec``), so a resumed run evaluates as the
uninterrupted one would, and two evaluations of the same weights give the same completions.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch

from parity.metrics import finalize
from rollout.types import SamplingSpec
from trainer.config import RecipeError, RunConfig
from trainer.data.datasets import apply_prompt_budget, load_prompt_dataset
from trainer.distributed.data_parallel import DataParallel
from trainer.lifecycle.run_health import held_out_fell
from trainer.lifecycle.stops import RunStopped
from trainer.measurement.scoring import score_batch
from trainer.models.batch import batch_from_rollouts
from trainer.sampling.drawn import Drawn
from trainer.sampling.sampler import Sampler
from trainer.vision.images import prompt_identity

# Seeds of evaluation samples sit above every training sample index of the same step (trainer/sampling/engines.py's
# per-step seed, sample indices from 0): a distinct stream.
EVAL_INDEX_OFFSET = 1 << 30


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``c`` solved out of ``n`` samples (Chen et al. 2021, Eq. 1):
    ``1 - C(n - c, k) / C(n, k)``, computed as a product to stay exact for large n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: expected 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def eval_rows(cfg: RunConfig, tokenizer) -> list[dict]:
    """The held-out rows: the first ``eval.num_prompts`` of ``eval.source`` (default data.source) / ``eval.split``,
    under the training prompts' budget (``data.max_prompt_tokens``, ``data.overlong_prompts``)."""
    e, d = cfg.eval, cfg.data
    ds = load_prompt_dataset(e.source or d.source, split=e.split, prompt_column=d.prompt_column,
                             answer_column=d.answer_column, num_examples=e.num_prompts, seed=cfg.train.seed,
                             builtin_kwargs=d.builtin_kwargs)
    ds = apply_prompt_budget(ds, tokenizer, replace(d, source=e.source or d.source), verbose=False)
    return [ds[i] for i in range(min(e.num_prompts, len(ds)))]


def pass_ks(cfg: RunConfig) -> list[int]:
    """The j of ``eval/pass@j``: ``eval.pass_k``, or 1 and ``eval.samples``."""
    return list(cfg.eval.pass_k) or sorted({1, cfg.eval.samples})


def eval_spec(cfg: RunConfig, step: int, *, greedy: bool) -> SamplingSpec:
    """The evaluation's sampling: k samples at eval.temperature (top_p / top_k as rollout's), or one greedy
    completion (top_k 1: the argmax, whose engine log-prob is 0 and is not compared)."""
    r, e = cfg.rollout, cfg.eval
    seed = cfg.train.seed * 1_000_003 + step
    if greedy:
        return SamplingSpec(n=1, temperature=1.0, top_k=1, max_new_tokens=r.max_new_tokens, seed=seed,
                            index_offset=EVAL_INDEX_OFFSET)
    return SamplingSpec(n=e.samples, temperature=e.temperature, top_p=r.top_p, top_k=r.top_k,
                        max_new_tokens=r.max_new_tokens, seed=seed, index_offset=EVAL_INDEX_OFFSET + e.num_prompts)


@dataclass
class Evaluator:
    """The held-out evaluation of a run: its rows (this rank's share), what judges success, and how it scores."""

    cfg: RunConfig
    rows: list[dict]  # every rank's, in order (this rank evaluates its shard)
    dp: DataParallel
    pad_id: int
    first: Optional[tuple[int, dict]] = None  # (step, figures) of the first evaluation this process printed

    @classmethod
    def from_config(cls, cfg: RunConfig, dp: DataParallel, tokenizer, train_rows) -> Optional["Evaluator"]:
        """None with ``eval.every`` 0. ``RecipeError`` before the engine starts for held-out rows that are too few,
        or that the training prompts (``train_rows``) also hold."""
        if not cfg.eval.every:
            return None
        rows = eval_rows(cfg, tokenizer)
        where = f"eval.source = {cfg.eval.source or cfg.data.source!r} (split {cfg.eval.split!r})"
        if len(rows) < dp.world:
            raise RecipeError(f"{where}: {len(rows)} held-out rows for {dp.world} processes; expected at least one "
                              "per process (eval.num_prompts, or a larger source)")
        # every rank the same number of prompts: ZeRO-3 gathers the weights in every forward of the scoring pass,
        # which every rank must run as often as the others
        usable = len(rows) - len(rows) % dp.world
        if usable < len(rows) and dp.rank == 0:
            print(f"eval: {len(rows)} held-out prompts for {dp.world} processes: evaluating the first {usable}",
                  flush=True)
        rows = rows[:usable]
        # a prompt is its text, and its images with an image column (trainer.vision.images.prompt_identity)
        column = cfg.data.image_column
        seen = {prompt_identity(r, column, i) for i, r in enumerate(train_rows)}
        shared = [r["prompt"] for i, r in enumerate(rows) if prompt_identity(r, column, i) in seen]
        if shared:
            raise RecipeError(f"{where}: {len(shared)} of its {len(rows)} prompts are also training prompts (e.g. "
                              f"{shared[0]!r}); expected held-out prompts: another eval.split or eval.source")
        return cls(cfg=cfg, rows=rows, dp=dp, pad_id=tokenizer.pad_token_id)

    @property
    def success_reward(self) -> str:
        return self.cfg.eval.success_reward or next(iter(list(self.cfg.reward.functions) + list(self.cfg.reward.models)))

    def due(self, step: int) -> bool:
        """Before step 1 (step 0), every ``eval.every`` steps, and after the last."""
        every = self.cfg.eval.every
        return bool(every) and (step == 0 or step % every == 0 or step == self.cfg.train.steps)

    def console_line(self, step: int, m: dict) -> str:
        """The held-out figures of ``step`` (0: the weights training starts from) in one line; a second, the
        warning, when they fell from the first evaluation this process ran (trainer/lifecycle/run_health.py)."""
        shown = "  ".join(f"{k[5:]} {v:.3f}" for k, v in m.items()
                          if k.startswith(("eval/mean@", "eval/pass@", "eval/greedy", "eval/reward/mean")))
        when = "before step 1" if step == 0 else f"after step {step}"
        line = f"held-out {when}: {shown}  ({len(self.rows)} prompts, {m['perf/eval_s']:.1f} s)"
        if self.first is None:
            self.first = (step, m)
            return line
        fell = held_out_fell(*self.first, step, m)
        return line if fell is None else f"{line}\n{fell}"

    def __call__(self, sampler: Sampler, model, step: int, *, exact=None) -> dict[str, float]:
        """The ``eval/`` metrics of the weights the engine holds now (see the module docstring). Collective."""
        t0 = time.perf_counter()
        e, dp = self.cfg.eval, self.dp
        shard = _shard(self.rows, dp)
        sums: dict[str, float] = {}
        per_source: dict[str, dict[str, float]] = {}
        m: dict[str, float] = {}
        if e.samples:
            with _said_as_evaluation():
                drawn = sampler.sample(shard, eval_spec(self.cfg, step, greedy=False), step,
                                       first=_first(self.rows, dp) * e.samples, total=len(self.rows) * e.samples)
            self._accumulate(drawn, e.samples, sums, per_source, "sampled")
            m.update(self._parity(drawn, model, exact))
        if e.greedy:
            with _said_as_evaluation():
                drawn = sampler.sample(shard, eval_spec(self.cfg, step, greedy=True), step,
                                       first=_first(self.rows, dp), total=len(self.rows))
            self._accumulate(drawn, 1, sums, per_source, "greedy")
        m.update(self._finish(sums, per_source))
        m["perf/eval_s"] = time.perf_counter() - t0
        return m

    def _solved(self, drawn: Drawn) -> list[bool]:
        return [v >= self.cfg.eval.success_threshold for v in drawn.per_fn[self.success_reward]]

    def _accumulate(self, drawn: Drawn, k: int, sums: dict, per_source: dict, kind: str) -> None:
        """Per-prompt sums of this rank (pooled later): solved shares, pass@j, rewards, lengths."""
        e = self.cfg.eval
        solved = self._solved(drawn)
        for g, row in enumerate(drawn.rows):
            c = sum(solved[g * k:(g + 1) * k])
            if kind == "greedy":
                values = {"n_greedy": 1.0, "greedy": float(c)}
            else:
                values = {"n": 1.0, f"mean@{k}": c / k, **{f"pass@{j}": pass_at_k(k, c, j) for j in pass_ks(self.cfg)}}
            targets = [sums] + ([per_source.setdefault(str(row[e.source_column]), {})]
                                if e.source_column in row else [])
            for target in targets:
                for key, v in values.items():
                    target[key] = target.get(key, 0.0) + v
        if kind == "sampled":
            r = drawn.rollouts
            sums["reward_sum"] = sum(drawn.rewards)
            for name, vals in drawn.per_fn.items():
                sums[f"reward/{name}"] = sum(vals)
            sums["samples"] = float(len(r))
            sums["length_sum"] = float(sum(len(c) for c in r.completion_ids))
            sums["truncated"] = float(sum(f == "length" for f in r.finish_reasons))

    def _finish(self, sums: dict, per_source: dict) -> dict[str, float]:
        """Pool every rank's sums (every rank must send the same keys: sources are gathered first) and divide."""
        dp = self.dp
        sources = sorted({s for rank in dp.gather_objects(sorted(per_source)) for s in rank})
        keys = sorted({k for rank in dp.gather_objects(sorted(sums)) for k in rank})
        flat = {f"all/{k}": sums.get(k, 0.0) for k in keys}
        source_keys = sorted({k for rank in dp.gather_objects(sorted({k for v in per_source.values() for k in v}))
                              for k in rank})
        for s in sources:
            for k in source_keys:
                flat[f"{s}/{k}"] = per_source.get(s, {}).get(k, 0.0)
        pooled = dp.sum_metrics(flat)
        out = _ratios({k[4:]: v for k, v in pooled.items() if k.startswith("all/")}, "eval/")
        for s in sources:
            out.update(_ratios({k[len(s) + 1:]: v for k, v in pooled.items() if k.startswith(f"{s}/")},
                               f"eval/{s}/", accuracy_only=True))
        return out

    def _parity(self, drawn: Drawn, model, exact) -> dict[str, float]:
        """Engine vs trainer on the sampled evaluation completions, as ``parity/*`` (``eval/parity/*``)."""
        cfg, dp = self.cfg, self.dp
        batch = batch_from_rollouts(drawn.rollouts, self.pad_id, _device(model))
        was_training = model.training
        model.eval()
        try:
            scores = score_batch(model, batch, micro_batch_size=cfg.train.micro_batch_size,
                                 temperature=cfg.eval.temperature, chunk_size=cfg.parity.chunk_size, exact=exact,
                                 entropy=False, pack_sequences=cfg.train.pack_sequences)
        finally:
            model.train(was_training)
        stats = dp.pooled_stats(scores.logprobs, batch.rollout_logprobs, batch.mask)
        return {"eval/" + k: v for k, v in finalize(stats).items() if k in _PARITY_KEYS}


_PARITY_KEYS = ("parity/mae", "parity/kl_k3", "parity/max_abs", "parity/num_tokens")


def _ratios(p: dict[str, float], prefix: str, accuracy_only: bool = False) -> dict[str, float]:
    out = {}
    for k, v in p.items():
        if k.startswith(("mean@", "pass@")):
            out[prefix + k] = v / max(p["n"], 1.0)
    if "greedy" in p:
        out[prefix + "greedy"] = p["greedy"] / max(p["n_greedy"], 1.0)
    if accuracy_only or not p.get("samples"):
        return out
    out[prefix + "reward/mean"] = p["reward_sum"] / p["samples"]
    for k, v in p.items():
        if k.startswith("reward/"):
            out[prefix + k] = v / p["samples"]
    out[prefix + "mean_length"] = p["length_sum"] / p["samples"]
    out[prefix + "frac_truncated"] = p["truncated"] / p["samples"]
    return out


@contextlib.contextmanager
def _said_as_evaluation():
    """A reward function, an environment or the engine failing on held-out prompts: the stop's message says so
    ("held-out evaluation, step 0: ..."), its type (and exit status) unchanged."""
    try:
        yield
    except RunStopped as e:
        if e.args and isinstance(e.args[0], str):
            e.args = (f"held-out evaluation, {e.args[0]}", *e.args[1:])
        raise


def _shard(rows: list[dict], dp: DataParallel) -> list[dict]:
    """This rank's contiguous share (the rows are a multiple of the ranks: ``Evaluator.from_config``)."""
    return dp.shard(rows, what="eval.num_prompts")


def _first(rows: list[dict], dp: DataParallel) -> int:
    return dp.offset(len(rows) // dp.world)


def _device(model) -> torch.device:
    return next(model.parameters()).device


__all__ = ["EVAL_INDEX_OFFSET", "BestCheckpoint", "Evaluator", "eval_metric_names", "eval_rows", "eval_spec",
           "pass_at_k"]


def eval_metric_names(cfg: RunConfig) -> list[str]:
    """The ``eval/`` keys an evaluation of ``cfg`` logs (without the per-source ones)."""
    e = cfg.eval
    if not e.every:
        return []
    names = []
    if e.samples:
        names += [f"eval/mean@{e.samples}", *(f"eval/pass@{j}" for j in pass_ks(cfg)),
                  "eval/reward/mean", *(f"eval/reward/{n}" for n in [*cfg.reward.functions, *cfg.reward.models]),
                  "eval/mean_length", "eval/frac_truncated", *("eval/" + k for k in _PARITY_KEYS)]
    if e.greedy:
        names.append("eval/greedy")
    return names


@dataclass
class BestCheckpoint:
    """``checkpoint.best_metric``: the best value so far and its step, kept in the run state (so a resume goes on
    comparing against it, and the checkpoint pruning keeps that step: trainer/io/checkpoint.py)."""

    metric: Optional[str]
    mode: str = "max"
    value: Optional[float] = None
    step: Optional[int] = None

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "BestCheckpoint":
        """``RecipeError`` before the engine starts for a metric the run never logs."""
        c = cfg.checkpoint
        if c.best_metric is not None:
            names = eval_metric_names(cfg) + ["reward/mean"] + [f"reward/{n}" for n in
                                                                [*cfg.reward.functions, *cfg.reward.models]]
            if c.best_metric not in names and not (c.best_metric.startswith("eval/") and cfg.eval.every
                                                    and c.best_metric.count("/") >= 2
                                                    and c.best_metric.split("/")[1] not in ("reward", "parity")):
                raise RecipeError(f"checkpoint.best_metric = {c.best_metric!r}: the run never logs it; expected one "
                                  f"of {', '.join(names)} (or eval/<source>/... for a source column)")
        return cls(metric=c.best_metric, mode=c.best_mode)

    def update(self, step: int, metrics: dict) -> bool:
        """Whether ``metrics`` (step ``step``'s) hold a new best; then it is recorded."""
        v = metrics.get(self.metric) if self.metric else None
        if v is None or v != v:  # not logged this step, or NaN
            return False
        better = self.value is None or (v > self.value if self.mode == "max" else v < self.value)
        if better:
            self.value, self.step = float(v), step
        return better

    def state_dict(self) -> dict:
        return {"metric": self.metric, "value": self.value, "step": self.step}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state and state.get("metric") == self.metric:  # another metric named now: start over
            self.value, self.step = state.get("value"), state.get("step")
