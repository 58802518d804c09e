"""What every check of the doctor shares: the recipe's model, tokenizer and prompts, one engine started as training
starts it, one trainer model in the recipe's precision, one fixed batch of sampled tokens, and the levels a healthy
setup reaches in this dtype. An MoE model runs with the recipe's ``parity.routing_replay`` as training resolves it
(``routing``): with replay or measure the engine returns its routes and the trainer's routers are wrapped, so that
every check's trainer forward replays the engine's experts where training would.

Everything is built on first use, once: a check that needs no engine (the tokens check) runs without one, and an
engine that cannot start is said once (``EngineCannotStart``) and every check that needs it is skipped with that
reason; the others still run.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from parity.metrics import compare
from rollout.base import EngineCannotLoad, one_line
from rollout.types import Rollouts, SamplingSpec
from trainer.builtin.resolve import resolve_model_path
from trainer.config import RunConfig
from trainer.config.validate import sequence_length
from trainer.data.datasets import encode_prompts, load_prompt_dataset
from trainer.doctor.records import Finding, at_most
from trainer.lifecycle.preflight import local_model_config
from trainer.measurement.routing_parity import install_routing
from trainer.measurement.scoring import score_batch
from trainer.models.architecture import decoder_depth
from trainer.models.batch import batch_from_rollouts
from trainer.models.policy import load_base_model, load_tokenizer
from trainer.models.routing_mode import routing_mode
from trainer.precision import recipe_for
from trainer.precision.levels import FLOOR_DEPTH, parity_level
from trainer.sampling.engines import make_engine
from trainer.vision.pixels import PromptPixels, samples_vision_batch
from trainer.vision.prompts import VisionPrompts, vision_prompts

# A fixed batch small enough for the whole battery to run in under two minutes on two CPU cores with the tiny model,
# large enough that a mean over it is steady (8 x 24 tokens).
NUM_PROMPTS = 8
MAX_NEW_TOKENS = 24


class EngineCannotStart(RuntimeError):
    """The recipe's engine could not be started for this model; the message is the engine's reason."""


class Doctor:
    """The shared state of one ``parityrl doctor`` run (see the module docstring)."""

    def __init__(self, cfg: RunConfig, out_dir: Path, *, engine=None, say: Callable[[str], None] = print,
                 hook_checks: Sequence[str] = ()) -> None:
        self.cfg, self.out_dir, self.say = cfg, Path(out_dir), say
        self.hook_checks = tuple(hook_checks)  # the checks asked that hook the engine's modules (engine_config)
        self.model_dir = resolve_model_path(cfg.model.path)
        self.dtype = cfg.model.dtype
        self.precision = recipe_for(cfg.precision.recipe)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.tokenizer = load_tokenizer(self.model_dir)
        self._engine, self._engine_error, self._owns_engine = engine, None, engine is None
        self._model = None
        self._routing: Optional[str] = None
        self._batch: Optional[Rollouts] = None
        self._prompt_ids: Optional[list[list[int]]] = None
        self._rows: Optional[list[dict]] = None
        self._vision: Optional[VisionPrompts] = None

    # ---- inputs ------------------------------------------------------------------------------
    @property
    def rows(self) -> list[dict]:
        """The recipe's first ``NUM_PROMPTS`` data rows (each with ``prompt``, and its images' column for a
        vision-language recipe)."""
        if self._rows is None:
            d = self.cfg.data
            data = load_prompt_dataset(d.source, split=d.split, prompt_column=d.prompt_column,
                                       answer_column=d.answer_column, num_examples=d.num_examples,
                                       seed=self.cfg.train.seed, builtin_kwargs=d.builtin_kwargs)
            self._rows = [data[i] for i in range(min(NUM_PROMPTS, len(data)))]
        return self._rows

    @property
    def prompt_ids(self) -> list[list[int]]:
        """The recipe's first ``NUM_PROMPTS`` prompts, encoded as training encodes text prompts. A vision-language
        recipe's prompts without their images: the language model alone (the images check runs them with theirs)."""
        if self._prompt_ids is None:
            d = self.cfg.data
            self._prompt_ids = encode_prompts(self.tokenizer, [r["prompt"] for r in self.rows],
                                              use_chat_template=d.use_chat_template,
                                              max_prompt_tokens=d.max_prompt_tokens, system_prompt=d.system_prompt)
        return self._prompt_ids

    @property
    def vision(self) -> Optional[VisionPrompts]:
        """How training turns the recipe's rows into prompts with images (``trainer.vision.prompts``); None for a
        recipe without ``data.image_column``."""
        if self._vision is None and self.cfg.data.image_column is not None:
            self._vision = vision_prompts(self.cfg, self.model_dir)
        return self._vision

    def spec(self, **change) -> SamplingSpec:
        """The recipe's sampling (temperature, truncation), one sample per prompt, a short fixed budget."""
        r = self.cfg.rollout
        base = dict(n=1, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p,
                    max_new_tokens=min(MAX_NEW_TOKENS, r.max_new_tokens), seed=self.cfg.train.seed)
        return SamplingSpec(**{**base, **change})

    # ---- the two sides -----------------------------------------------------------------------
    @property
    def engine(self):
        """The recipe's engine (started on first use, as training starts it); ``EngineCannotStart`` if it cannot."""
        if self._engine is None:
            if self._engine_error is not None:
                raise EngineCannotStart(self._engine_error)
            self.say(f"starting the {self.cfg.rollout.engine} engine on {self.model_dir}")
            cfg = engine_config(self.cfg, self.hook_checks, say=self.say)
            try:
                self._engine = make_engine(cfg, self.model_dir, max_model_len=sequence_length(self.cfg),
                                           return_routes=self.routing != "off")
            except Exception as e:  # noqa: BLE001 - any refusal of the engine is this model's diagnosis
                self._engine_error = engine_reason(e)
                raise EngineCannotStart(self._engine_error) from None
        return self._engine

    @property
    def model(self):
        """The trainer's model in the recipe's dtype and precision (the base weights, eval mode)."""
        if self._model is None:
            self.say(f"loading the trainer's model ({self.dtype}, precision {self.precision.name})")
            model = self.precision.transform(load_base_model(self.model_dir, self.dtype, self.device)).eval()
            install_routing(self.cfg, model)  # training's: the routers replay (or measure) the routes a batch carries
            self._model = model
        return self._model

    @property
    def routing(self) -> str:
        """``parity.routing_replay`` resolved for this model as training resolves it: replay | measure | off (a dense
        model, or replay turned off), read from the model's config before anything loads."""
        if self._routing is None:
            config = local_model_config(self.model_dir)
            self._routing = "off" if config is None else routing_mode(self.cfg.parity.routing_replay, config,
                                                                       where=f"recipe {self.cfg.name!r}")
        return self._routing

    def batch(self) -> Rollouts:
        """One fixed batch sampled by the engine (prompts x 1, the recipe's sampling), the same for every check."""
        if self._batch is None:
            self._batch = self.engine.generate(self.prompt_ids, self.spec())
        return self._batch

    def trainer_logprobs(self, rollouts: Rollouts, *, micro_batch_size: int = 16, chunk_size: Optional[int] = None,
                         temperature: Optional[float] = None,
                         pixels: Optional[Sequence[PromptPixels]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The trainer's log-probs [S, C] of the rollouts' completion tokens (the training step's scoring), and the
        completion mask. ``pixels``: per prompt its images as the trainer runs them (a vision-language batch)."""
        batch = batch_from_rollouts(rollouts, self.tokenizer.pad_token_id, self.device)
        if pixels is not None:
            batch.vision = samples_vision_batch(pixels, rollouts.group_size, len(batch),
                                                self.vision.image_token_id).to(self.device)
        t = self.cfg.rollout.temperature if temperature is None else temperature
        scores = score_batch(self.model, batch, micro_batch_size=micro_batch_size, temperature=t,
                             chunk_size=chunk_size)
        mask = (batch.mask > 0).cpu()
        return scores.logprobs.float().cpu() * mask, mask

    def parity(self, rollouts: Rollouts, **score_kw) -> dict[str, float]:
        """Every ``parity/*`` metric of the rollouts' engine log-probs against the trainer's."""
        lp_t, mask = self.trainer_logprobs(rollouts, **score_kw)
        lp_r = batch_from_rollouts(rollouts, self.tokenizer.pad_token_id, "cpu").rollout_logprobs.float()
        return compare(lp_t, lp_r * mask, mask)

    # ---- levels ------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return decoder_depth(self.model.config, default=FLOOR_DEPTH)

    def mae_level(self) -> float:
        """The parity mae a healthy setup reaches with this precision recipe and dtype on this model
        (``trainer.precision.levels``)."""
        return parity_level(self.precision, self.dtype, self.num_layers)

    @property
    def engine_error(self) -> Optional[str]:
        """Why the engine could not start (None: it started, or nothing asked for it)."""
        return self._engine_error

    def close(self) -> None:
        if self._owns_engine and self._engine is not None:
            self._engine.close()
        self._engine = None


def engine_config(cfg: RunConfig, hook_checks: Sequence[str], say: Callable[[str], None] = print) -> RunConfig:
    """The recipe the battery's engine starts from: training's, run eagerly when a check asked hooks the engine's
    modules (``Check.hooks_engine``: layers, images, routing). Forward hooks do not fire inside a replayed CUDA graph nor in
    vLLM's ``torch.compile``d forward, and on CUDA the engine runs both by default (``rollout.enforce_eager: null``),
    so without this the layers check would always be skipped there. In eager mode Model Runner V2 runs the model's
    modules as they are, the logits through the ``LogitsProcessor`` module the check hooks
    (``vllm/v1/worker/gpu/model_runner.py``; read from source, not run on a GPU by this project). The cost: every
    check of that battery measures the eager engine, not the graphs and compiled kernels training runs on CUDA; a
    battery without layers and routing (``--only``) keeps the recipe's engine."""
    if not hook_checks or cfg.rollout.enforce_eager is True:
        return cfg
    if torch.cuda.is_available() or cfg.rollout.enforce_eager is False:
        say(f"  the engine runs eagerly for {', '.join(hook_checks)} (module hooks do not fire in CUDA graphs or a "
            "compiled forward): every check of this battery measures the eager engine")
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, enforce_eager=True))


def engine_reason(e: BaseException) -> str:
    """One line: what the engine said when it refused (``EngineCannotLoad`` says it already)."""
    return str(e) if isinstance(e, EngineCannotLoad) else one_line(e)


def engine_prefill(engine, rollouts: Rollouts, n: int = 2) -> torch.Tensor:
    """The engine's prefill log-probs of the first ``n`` sequences of ``rollouts``, flattened (float64). Taken before
    and after a check that loads weights into the engine and restores them, they say whether the engine computes what
    it did: a layer's weights may read back restored while the state its kernel computes with is not (an MoE layer's
    experts after vLLM 0.32's in-place reload on CPU, tests/doctor/moe_doctor_cases.py)."""
    seqs = [list(p) + list(c) for p, c in zip(rollouts.prompt_ids[:n], rollouts.completion_ids[:n])]
    return torch.tensor([x for lp in engine.score(seqs).logprobs for x in lp], dtype=torch.float64)


def engine_restored(check: str, before: torch.Tensor, after: torch.Tensor) -> Finding:
    """PASS when the engine's prefill log-probs after a check's load and restore are those before it, bit for bit
    (the same requests on the same weights)."""
    moved = float((after - before).abs().max()) if before.numel() else 0.0
    return at_most(check, "engine's log-probs after the check vs before: max |dlp|", moved, 0.0,
                   "the engine computes other log-probs after this check loaded weights and restored them: a weight "
                   "load leaves it in another state than its weights say (on CPU, vLLM 0.32's in-place reload of an "
                   "MoE model's experts); every check after this one runs on that engine", details={"tokens": before.numel()})


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ over all elements, in float64 (0 for two zero tensors)."""
    a, b = a.double(), b.double()
    denom = float(b.norm())
    num = float((a - b).norm())
    return num / denom if denom > 0 else (0.0 if num == 0 else math.inf)
