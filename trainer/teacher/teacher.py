"""The teacher of a run: its engine, started beside the student's, and each step's scores of the sampled ids.

``Teacher.from_config`` (the loop's setup, after the student's model and before its engine): the teacher's
tokenizer checked against the student's (``trainer.lifecycle.teacher_checks``), its engine started (``teacher.engine``: a second colocated
vLLM engine in the precision recipe's settings, a Transformers model, a `parityrl serve` of the teacher at
``teacher.server_url``, or any vLLM OpenAI-compatible server there, which must serve ``teacher.path``'s model:
``check_served_model``; a server is read, never written: every data-parallel rank connects to it, none pushes
weights), and asked once for prompt log-probs
(an engine that cannot return them is refused before training). Each step (``Teacher.__call__``) the engine scores
the student's sampled sequences at temperature 1 (the teacher's own distribution: vLLM's prompt log-probs are
unscaled); on ``teacher.parity_every`` steps the trainer scores them too, with the fused kernel
(``trainer.measurement.scoring.score_batch``, the teacher loaded into the trainer once, no gradient), so that
``teacher_parity/*`` is the same comparison as the student's ``parity/*`` (``parity.metrics``).
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from rollout.base import EngineUnavailable
from rollout.completions_scorer import CompletionsScorer
from rollout.hf_engine import HFEngine
from rollout.server_engine import ServerEngine, ServerKeys, UnusableServer
from rollout.types import Rollouts
from trainer.builtin.resolve import resolve_model_path
from trainer.config import RolloutConfig, RunConfig
from trainer.lifecycle.capacity import gpu_total_bytes
from trainer.lifecycle.teacher_checks import check_engine_order, check_same_tokenizer
from trainer.lifecycle.teacher_memory import model_size, teacher_dtype_name, teacher_engine_options
from trainer.measurement.probe import due
from trainer.measurement.scoring import score_batch
from trainer.models.batch import TokenBatch
from trainer.models.policy import load_base_model
from trainer.precision import recipe_for
from trainer.sampling.engines import block_fp8_engine, connect_shared_server, start_vllm
from trainer.teacher.metrics import distill_metrics, distill_sums, noise_frac
from trainer.teacher.scores import teacher_scores


def teacher_dtype(cfg: RunConfig) -> str:
    """The teacher's dtype: ``teacher.dtype``, else the student's (``model.dtype``, the precision recipe's)."""
    return teacher_dtype_name(cfg)


def teacher_server_keys(cfg: RunConfig) -> ServerKeys:
    """What a teacher server's errors name: its keys, and how ``teacher.engine`` expects it started (the
    connect wait is ``teacher.server_timeout_s`` capped by rollout.server_connect_timeout_s's default)."""
    t = cfg.teacher
    start = "`parityrl serve <teacher recipe>`" if t.engine == "server" else f"`vllm serve {t.path}`"
    return ServerKeys(url="teacher.server_url", timeout="teacher.server_timeout_s",
                      connect_timeout=f"teacher.server_timeout_s, at most {RolloutConfig.server_connect_timeout_s:g} s "
                                      "when nothing listens", start=start)


def start_teacher_engine(cfg: RunConfig, teacher_dir: str, *, max_model_len: int, device, dp=None):
    """The teacher's scoring engine as ``teacher.engine`` says (``Teacher`` docstring); ``dp``: the data-parallel
    group whose ranks share a teacher server."""
    dtype, t = teacher_dtype(cfg), cfg.teacher
    if t.engine == "hf":
        return HFEngine(teacher_dir, dtype=dtype, device=str(device))
    if t.engine == "server":
        # the student's server client (rollout.server_engine): it checks the server's dtype and context. The server
        # loaded the teacher's checkpoint itself and its weights never change: nothing is pushed, no transfer is
        # opened and no version set (served_weights), and every rank connects as the student's ranks do
        def connect(_first: bool) -> ServerEngine:
            return ServerEngine(t.server_url, model_dir=teacher_dir, timeout_s=t.server_timeout_s, dtype=dtype,
                                max_model_len=max_model_len,
                                connect_timeout_s=min(t.server_timeout_s, RolloutConfig.server_connect_timeout_s),
                                pushes_weights=False, served_weights=True, keys=teacher_server_keys(cfg))

        try:
            return connect_shared_server(dp, connect)
        except EngineUnavailable as e:
            raise type(e)(f"teacher.server_url = {t.server_url!r} (teacher.engine server): {e}") from None
    if t.engine == "vllm_url":
        # any vLLM server: the OpenAI-compatible /v1/completions with prompt log-probs (rollout.completions_scorer)
        try:
            engine = CompletionsScorer(t.server_url, timeout_s=t.server_timeout_s, max_model_len=max_model_len,
                                       connect_timeout_s=min(t.server_timeout_s,
                                                             RolloutConfig.server_connect_timeout_s),
                                       keys=teacher_server_keys(cfg))
        except EngineUnavailable as e:
            raise type(e)(f"teacher.server_url = {t.server_url!r} (teacher.engine vllm_url): {e}") from None
        try:
            check_served_model(engine.served, t.path, teacher_dir, t.server_url)
        except BaseException:
            engine.close()
            raise
        return engine
    # a prefill per sequence, nothing decoded: on CUDA eager, its own KV cache and GPU share, never asleep
    # (trainer.lifecycle.teacher_memory)
    cuda = torch.cuda.is_available()
    options = teacher_engine_options(cfg, model_size(teacher_dir), max_model_len=max_model_len, cuda=cuda,
                                     gpu_total=gpu_total_bytes() if cuda else None,
                                     fp8=block_fp8_engine(recipe_for(cfg.precision.recipe)))
    return start_vllm(teacher_dir, precision=cfg.precision.recipe, dtype=dtype, max_model_len=max_model_len,
                      seed=cfg.train.seed, work_dir=cfg.run_dir / "teacher", **options)


def check_served_model(card: dict, teacher_path: str, teacher_dir: str, url: str) -> None:
    """UnusableServer naming ``teacher.server_url`` unless the vLLM server at ``url`` serves ``teacher.path``'s model.

    The tokenizer check (``teacher_checks.check_same_tokenizer``) reads ``teacher.path``, and nothing of the server's
    vocabulary can be read through its OpenAI API: the check holds for the server only if it loaded the same model.
    Its ``/v1/models`` card names what it loaded (``root``: the ``--model`` it was started with, whatever
    ``--served-model-name`` says): ``teacher.path`` itself (a hub id, a path), or a directory that is
    ``teacher.path``'s."""
    served = card.get("root") or card.get("id")
    same = served in (teacher_path, teacher_dir) or (
        isinstance(served, str) and Path(served).is_dir() and Path(served).resolve() == Path(teacher_dir).resolve())
    if not same:
        raise UnusableServer(f"teacher.server_url = {url!r} (teacher.engine vllm_url): the server loaded {served!r}; "
                             f"expected teacher.path's model ({teacher_path!r}, {teacher_dir}): the tokenizer check "
                             "reads teacher.path, so set it to the model the server was started with (its hub id, "
                             "or the same directory)")


def check_prompt_logprobs(engine, cfg: RunConfig, vocab_probe: list[int]) -> None:
    """EngineUnavailable naming ``teacher.engine`` unless the engine returns one finite log-prob per scored token
    (the distillation signal needs the teacher's log-prob of every sampled id)."""
    try:
        scored = engine.score([vocab_probe], topk=1)
        ok = len(scored.logprobs[0]) == len(vocab_probe) - 1 and all(math.isfinite(x) for x in scored.logprobs[0])
        why = f"returned {scored.logprobs[0]!r} for {len(vocab_probe)} tokens"
    except Exception as e:  # noqa: BLE001 - any failure is the same refusal, with its reason
        ok, why = False, f"{type(e).__name__}: {e}"
    if not ok:
        at = f", teacher.server_url = {cfg.teacher.server_url!r}" if cfg.teacher.server_url else ""
        raise EngineUnavailable(f"teacher.engine = {cfg.teacher.engine!r} ({cfg.teacher.path}{at}): expected an engine "
                                f"that returns prompt log-probs of given ids (one finite value per token); {why}")


class Teacher:
    """A run's teacher: its engine, and the trainer's copy of it when teacher parity is measured."""

    def __init__(self, cfg: RunConfig, teacher_dir: str, engine, *, dp, device) -> None:
        self.cfg, self.teacher_dir, self.engine, self.dp, self.device = cfg, teacher_dir, engine, dp, device
        self.model = None  # the teacher in the trainer, loaded at the first teacher-parity step

    @classmethod
    def from_config(cls, cfg: RunConfig, student_dir: str, *, dp, device, max_model_len: int,
                    where: str = "<recipe>", probe_ids: Optional[list[int]] = None) -> Optional["Teacher"]:
        """The recipe's teacher, checked and started; None without ``teacher.path``. ``probe_ids``: a sequence
        to ask the engine for prompt log-probs once (default: the first ids of the vocabulary)."""
        if not cfg.teacher.path:
            return None
        teacher_dir = resolve_model_path(cfg.teacher.path)
        check_same_tokenizer(student_dir, teacher_dir, cfg.teacher.path, where)
        check_engine_order(cfg, student_dir, teacher_dir, where)  # before the teacher's engine starts
        # one more than the student's sequences: vLLM samples one token after a scored sequence
        engine = start_teacher_engine(cfg, teacher_dir, max_model_len=max_model_len + 1, device=device, dp=dp)
        try:
            check_prompt_logprobs(engine, cfg, probe_ids or [1, 2, 3])
        except BaseException:
            engine.close()
            raise
        return cls(cfg, teacher_dir, engine, dp=dp, device=device)

    def parity_due(self, step: int) -> bool:
        """Whether ``teacher_parity/*`` is measured at ``step``: ``teacher.parity_every`` (null: the probe's)."""
        every = self.cfg.teacher.parity_every
        if every is None:
            return due(self.cfg, step)
        return bool(every) and (step == 1 or step % every == 0)

    def score_step(self, step: int, rollouts: Rollouts, batch: TokenBatch, m: dict) -> torch.Tensor:
        """The teacher's log-probs of the batch's completion tokens [S, C]; this step's metrics added to ``m``."""
        teacher_lp, metrics = self(step, rollouts, batch)
        m.update(metrics)
        return teacher_lp

    def __call__(self, step: int, rollouts: Rollouts, batch: TokenBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """(the teacher's log-probs of the batch's completion tokens [S, C], this step's ``distill/*``,
        ``teacher_parity/*`` and ``perf/teacher_s``)."""
        t0 = time.perf_counter()
        student_top1 = None if batch.topk_ids is None else batch.topk_ids[..., 0]
        teacher_lp, teacher_top1 = teacher_scores(self.engine, rollouts, batch.mask.shape[1], batch.mask.device,
                                                  top1=student_top1 is not None)
        sums = self.dp.sum_metrics(distill_sums(batch.rollout_logprobs, teacher_lp, batch.mask, student_top1,
                                                teacher_top1))
        m = distill_metrics(sums)
        if self.parity_due(step):
            m.update(self.parity(batch, teacher_lp))
            m["distill/teacher_noise_frac"] = noise_frac(m["teacher_parity/mae"], sums)
        m["perf/teacher_s"] = time.perf_counter() - t0
        return teacher_lp, m

    def parity(self, batch: TokenBatch, teacher_lp: torch.Tensor) -> dict[str, float]:
        """``teacher_parity/*``: the trainer's fused-kernel scores of the teacher vs its engine's, same tokens."""
        if self.model is None:
            self.model = load_base_model(self.teacher_dir, teacher_dtype(self.cfg), self.device).eval()
            self.model.requires_grad_(False)
        p = self.cfg
        # the teacher's engine scores its full softmax at temperature 1 (prompt log-probs skip the sampling
        # processors): the student's truncated-sampling sets and top-k ids are not the teacher's
        batch = replace(batch, support=None, topk_ids=None, topk_logprobs=None)
        trainer_lp = score_batch(self.model, batch, micro_batch_size=p.train.micro_batch_size, temperature=1.0,
                                 chunk_size=p.parity.chunk_size, entropy=False,
                                 pack_sequences=p.train.pack_sequences).logprobs
        return self.dp.pooled_parity(trainer_lp, teacher_lp, batch.mask, prefix="teacher_parity/")

    def close(self) -> None:
        self.engine.close()
        self.model = None
