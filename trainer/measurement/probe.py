"""The parity probe: fixed token sequences scored by the engine and the trainer after every weight sync.

The step's own parity metrics measure the engine that produced the step's rollouts,
i.e. the weights pushed one step earlier, on prompts that change every step. The
probe measures the weights *just* pushed, on the same tokens every time: a broken or
partial sync shows up before the next rollout is spent on it, and its values are
comparable across the run (a trend in ``probe/mae`` is the policy drifting into regions
where the two numerics disagree more, not a change of tokens).

How, and why it is cheap: the probe prompts get one completion each, generated ONCE when
the probe is first run (the start of the run, or of a resume). Every probe then scores
those fixed prompt + completion sequences with one prefill pass in the engine
(``engine.score``: vLLM's prompt log-probs, no decoding) and one gradient-free forward in
the trainer, and compares the completion tokens' log-probs. Both sides score at temperature
1 (vLLM's prompt log-probs are unscaled); the step's ``parity/*`` keeps the decode path at
the rollout temperature, where it comes for free. Decoding the probe after every sync cost
a third of a tiny-model step; the prefill costs about as much as the trainer's forward.
Every engine scores: the colocated vLLM engine through ``SamplingParams.prompt_logprobs``, the
server engine through the same field on its token-in/token-out route, the HF engine with a
forward pass.

Frequency: ``parity.probe_first`` syncs always, then every ``parity.probe_every``-th.

A vision-language run probes its first prompts with their images (``ProbeImages``): the engine expands each prompt's
placeholders when it first generates and again at every scoring (it is given the unexpanded prompt and the images,
as a rollout is), the trainer scores the expanded ids with its processor's pixels, and the expanded ids are checked
against the trainer's processor's once, when the sequences are fixed (``trainer.vision.identity``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from rollout.types import Rollouts, SamplingSpec
from trainer.config import RunConfig
from trainer.data.datasets import encode_prompts
from trainer.distributed.data_parallel import DataParallel
from trainer.lifecycle.stops import ParityLimitExceeded
from trainer.measurement.scoring import score_batch
from trainer.models.batch import batch_from_rollouts
from trainer.models.routing_replay import attached_replay
from trainer.vision.identity import TrainerInputs, input_differences
from trainer.vision.pixels import vision_batch
from trainer.vision.prompts import VisionPrompts

# A fixed seed distinct from every step's (engines.sampling_spec uses seed * 1_000_003 + step).
PROBE_SEED = 0x5EED


def probe_spec(cfg: RunConfig) -> SamplingSpec:
    r = cfg.rollout
    return SamplingSpec(n=1, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                        seed=PROBE_SEED + cfg.train.seed, logprobs_topk=cfg.parity.topk)


def due(cfg: RunConfig, step: int) -> bool:
    """Whether the probe runs after step ``step``'s sync (step 0: before training, always)."""
    p = cfg.parity
    return step <= p.probe_first or step % p.probe_every == 0


def probe_prompt_ids(cfg: RunConfig, dataset, tokenizer) -> list[list[int]]:
    """The probe's prompts: the dataset's first ``parity.probe_prompts`` rows, the same every step and after a
    resume."""
    d = cfg.data
    n_probe = min(cfg.parity.probe_prompts, len(dataset))
    if not n_probe:
        return []
    return encode_prompts(tokenizer, [dataset[i]["prompt"] for i in range(n_probe)],
                          use_chat_template=d.use_chat_template, max_prompt_tokens=d.max_prompt_tokens,
                          system_prompt=d.system_prompt)


@dataclass(frozen=True)
class ProbeImages:
    """A vision-language probe's images: per prompt its images as the engine takes them (PIL) and the trainer's side
    of it (its processor's expanded ids and pixels); ``image_token_id``: the placeholder id."""

    images: list[list[Any]]
    expected: list[TrainerInputs]
    image_token_id: int


def probe_prompts(cfg: RunConfig, dataset, tokenizer,
                  vision: Optional[VisionPrompts] = None) -> tuple[list[list[int]], Optional[ProbeImages]]:
    """The probe's prompts (``probe_prompt_ids``) and, for a vision-language run, their images: the prompts then as
    ``VisionPrompts`` encodes a rollout's (one placeholder per image, unexpanded)."""
    if vision is None:
        return probe_prompt_ids(cfg, dataset, tokenizer), None
    n_probe = min(cfg.parity.probe_prompts, len(dataset))
    if not n_probe:
        return [], None
    encoded = vision.encode([dataset[i] for i in range(n_probe)])
    return encoded.ids, ProbeImages(encoded.images, encoded.expected, vision.image_token_id)


class Probe:
    """The probe of one run: its prompts (and a vision-language run's images), and the sequences fixed on the first
    call."""

    def __init__(self, prompt_ids: list[list[int]], cfg: RunConfig, *, pad_id: int, device: torch.device | str,
                 dp: Optional[DataParallel] = None, images: Optional[ProbeImages] = None) -> None:
        self.prompt_ids, self.cfg, self.pad_id, self.device = prompt_ids, cfg, pad_id, device
        self.images = images
        self.dp = dp or DataParallel()
        self.fixed: Optional[Rollouts] = None  # prompt + completion token ids, scored by every later probe
        self.exact = None  # trainer.models.exact.ExactLogprobs when the recipe's log-probs are the engine's

    def __call__(self, engine, model) -> dict[str, float]:
        """``probe/*`` parity metrics of ``engine`` vs ``model`` (empty without probe prompts).

        Scored in eval mode without gradient; the model's train/eval mode is restored. With
        data parallel every rank probes its own engine on the same prompts and the metrics pool
        all ranks' tokens.
        """
        if not self.prompt_ids:
            return {}
        if self.fixed is None:
            # the generation's routes are not kept: every probe replays its own scoring pass's; nor its kept sets:
            # the probe compares full distributions on both sides (the engine's prompt log-probs are untruncated)
            images = {} if self.images is None else {"images": self.images.images}
            fixed = engine.generate(self.prompt_ids, replace(probe_spec(self.cfg), logprobs_topk=0), **images)
            if self.images is not None:
                self._check_inputs(fixed, engine)
            self.fixed = _fit(replace(fixed, routes=[], support=[], images=[]), getattr(engine, "max_model_len", None))
        return self._compare(model, self._engine_scores(engine, replay=attached_replay(model) is not None))

    def _check_inputs(self, fixed: Rollouts, engine) -> None:
        """The probe's prompts as the engine consumed them are the trainer's processor's (else the probe would
        compare other prompts): a parity stop naming the first that differs, as a step's own check stops the run."""
        problems = input_differences(fixed, self.images.expected, self.images.image_token_id, engine.torch_dtype)
        if problems:
            raise ParityLimitExceeded(f"the parity probe's prompts: the engine's inputs are not the trainer's: "
                                      f"{problems[0]}")

    def state_dict(self) -> dict:
        """The fixed sequences (checkpointed, so a resumed run probes the same tokens as an uninterrupted one)."""
        f = self.fixed
        return {} if f is None else {"prompt_ids": f.prompt_ids, "completion_ids": f.completion_ids,
                                     "rollout_logprobs": f.rollout_logprobs, "finish_reasons": f.finish_reasons}

    def load_state_dict(self, state: Optional[dict]) -> None:
        self.fixed = Rollouts(group_size=1, **state) if state else None

    def _engine_scores(self, engine, replay: bool = False) -> Rollouts:
        """The fixed sequences with the engine's log-probs of their completion tokens (prefill, T = 1), and with
        ``replay`` the routes of that prefill (an MoE engine's, ``rollout.routes``)."""
        f, topk = self.fixed, self.cfg.parity.topk
        if self.images is None:
            scored = engine.score([p + c for p, c in zip(f.prompt_ids, f.completion_ids)], topk=topk)
        else:  # the unexpanded prompts with their images, as generated: the engine expands them again
            scored = engine.score([p + c for p, c in zip(self.prompt_ids, f.completion_ids)], topk=topk,
                                  images=self.images.images)
            lost = [k for k, (p, c) in enumerate(zip(f.prompt_ids, f.completion_ids))
                    if len(scored.logprobs[k]) != len(p) + len(c) - 1]
            if lost:
                k = lost[0]
                raise RuntimeError(f"the parity probe: the engine expanded prompt {k} to another length when scoring "
                                   f"({len(scored.logprobs[k]) + 1} ids) than when it generated "
                                   f"({len(f.prompt_ids[k]) + len(f.completion_ids[k])})")

        def completion_part(per_seq: list, k: int) -> list:
            return per_seq[len(f.prompt_ids[k]) - 1:]  # position t - 1 holds token t's score

        n = len(f.completion_ids)
        return replace(f, rollout_logprobs=[completion_part(scored.logprobs[k], k) for k in range(n)],
                       topk_ids=[completion_part(scored.topk_ids[k], k) for k in range(n)] if topk else [],
                       topk_logprobs=[completion_part(scored.topk_logprobs[k], k) for k in range(n)] if topk else [],
                       routes=scored.routes if replay else [])

    def _compare(self, model, rollouts: Rollouts) -> dict[str, float]:
        batch = batch_from_rollouts(rollouts, self.pad_id, self.device)
        if self.images is not None:  # one sample per prompt: row k holds prompt k's images
            batch.vision = vision_batch([e.pixels for e in self.images.expected],
                                        self.images.image_token_id).to(self.device)
        was_training = model.training
        model.eval()
        try:  # one forward of the whole batch; the engine's prompt log-probs are unscaled (module docstring)
            # packed as the step's scores are, so the probe measures the forward the updates use
            scores = score_batch(model, batch, micro_batch_size=len(batch), temperature=1.0,
                                 chunk_size=self.cfg.parity.chunk_size, exact=self.exact, entropy=False,
                                 pack_sequences=self.cfg.train.pack_sequences)
        finally:
            model.train(was_training)
        return self.dp.pooled_parity(scores.logprobs, batch.rollout_logprobs, batch.mask,
                                     train_topk_logprobs=scores.topk, rollout_topk_logprobs=batch.topk_logprobs,
                                     prefix="probe/")


def _fit(r: Rollouts, max_model_len: Optional[int]) -> Rollouts:
    """Completions cut so that prompt + completion + the one token a scoring request samples fit the engine."""
    if max_model_len is None:
        return r
    keep = [max(1, max_model_len - 1 - len(p)) for p in r.prompt_ids]
    return replace(r, completion_ids=[c[:k] for c, k in zip(r.completion_ids, keep)],
                   rollout_logprobs=[x[:k] for x, k in zip(r.rollout_logprobs, keep)],
                   finish_reasons=[f if len(c) <= k else "length" for f, c, k in zip(r.finish_reasons, r.completion_ids, keep)],
                   completion_texts=[])
